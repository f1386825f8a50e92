"""``oarlock convert``: a checkpoint converted between HF, oarlock (TP/PP-sharded) and torch DCP, from any format
oarlock reads, optionally through an AOA config or preset."""

from __future__ import annotations

import argparse
import sys

from oarlock.checkpoint.cli.common import add_filters, fail, read_aoa_config, resolve_path, reversed_config


#: source formats that hold a training state: converted to HF by default
_TRAINED = ("oarlock", "paddle", "dcp", "accelerate", "megatron", "deepspeed", "gguf")


def cmd_convert(args: argparse.Namespace) -> int:
    from oarlock.checkpoint.convert import (ConversionLayout, convert_checkpoint, convert_to_dcp, plan_conversion,
                                            resolve_tp_rules)
    from oarlock.checkpoint.storage import detect_format

    config = None
    args.src = resolve_path(args.src)
    if args.aoa and args.preset:
        return fail("give either --aoa CONFIG or --preset NAME, not both")
    if args.aoa:
        config = read_aoa_config(args.aoa)
        if args.reverse:
            config = reversed_config(config)
    elif args.reverse and not args.preset:
        return fail("--reverse needs --aoa CONFIG or --preset NAME")
    parallel = (args.tp, args.pp, args.dp) != (1, 1, 1)
    to = args.to or ("oarlock" if parallel or args.tp_rules else "hf" if detect_format(args.src) in _TRAINED
                     else "oarlock")
    if to == "hf" and (parallel or args.tp_rules):
        return fail("--tp/--pp/--dp/--tp-rules apply to --to oarlock; an HF export holds whole tensors")
    if args.model_prefix is not None and to != "hf":
        return fail("--model-prefix applies to --to hf (the other outputs keep the stored keys)")
    tp_rules = args.tp_rules
    if args.preset:
        from oarlock.checkpoint.aoa.presets import preset

        # an oarlock checkpoint going to HF is in the training layout: the preset runs backwards
        reverse = args.reverse or (to == "hf" and detect_format(args.src) == "oarlock")
        config = preset(args.preset, args.model_config or args.src, reverse=reverse, source=args.src,
                        stacked_experts=getattr(args, "stacked_experts", False))
        tp_rules = tp_rules or config["tp_rules"]
    layout = ConversionLayout(args.tp, args.pp, args.dp, tuple(resolve_tp_rules(tp_rules)))
    keep_opt = args.keep_optimizer_state or to == "oarlock"
    if args.dry_run:
        text = plan_conversion(args.src, to="oarlock" if to == "dcp" else to, aoa_config=config, layout=layout,
                               max_shard_size=args.max_shard_size, include=args.include, exclude=args.exclude,
                               optimizer_state=keep_opt, model_prefix=args.model_prefix if to == "hf" else None
                               ).render()
        if to == "dcp":  # same chunking; each rank file becomes __<rank>_0.distcp
            text = text.replace("-> oarlock:", "-> dcp:", 1)
        print(text)
        return 0
    if to == "hf":
        _export_hf(args, config, keep_opt)
    elif to == "dcp":
        meta = convert_to_dcp(args.src, args.dst, aoa_config=config, tp=args.tp, pp=args.pp, dp=args.dp,
                              tp_rules=tp_rules, copy_side_files=not args.no_side_files, overwrite=args.overwrite)
        print(f"{args.dst}: torch.distributed.checkpoint (DCP), {len(meta.tensors)} tensors in {len(meta.files)} "
              f"file(s) (tp={args.tp} pp={args.pp} dp={args.dp})")
    else:
        meta = convert_checkpoint(args.src, args.dst, aoa_config=config, tp=args.tp, pp=args.pp, dp=args.dp,
                                  tp_rules=tp_rules, copy_side_files=not args.no_side_files,
                                  include=args.include, exclude=args.exclude, optimizer_state=keep_opt,
                                  verify_checksums=not args.no_verify, overwrite=args.overwrite)
        print(f"{args.dst}: oarlock checkpoint, {len(meta.tensors)} tensors in {len(meta.files)} file(s) "
              f"(tp={args.tp} pp={args.pp} dp={args.dp})")
    return 0


def _export_hf(args: argparse.Namespace, config: object, keep_opt: bool) -> None:
    """``convert --to hf``: export, then say what the HF directory holds and what it left out."""
    from pathlib import Path

    from oarlock.checkpoint.convert import export_hf, plan_conversion, side_files
    from oarlock.checkpoint.model.metadata import key_selected
    from oarlock.checkpoint.storage import detect_format, open_checkpoint

    plan = plan_conversion(args.src, to="hf", aoa_config=config, max_shard_size=args.max_shard_size,
                           include=args.include, exclude=args.exclude, optimizer_state=keep_opt,
                           model_prefix=args.model_prefix)
    extra = {}
    if args.preset and args.model_config and (args.no_side_files or "config.json" not in side_files(args.src)):
        # a foreign source (Megatron) carries no HF config: the one the preset was built from goes along
        cfg_file = Path(args.model_config)
        extra["config.json"] = cfg_file / "config.json" if cfg_file.is_dir() else cfg_file
    export_hf(args.src, args.dst, aoa_config=config, max_shard_size=args.max_shard_size,
              copy_side_files=not args.no_side_files, include=args.include, exclude=args.exclude,
              optimizer_state=keep_opt, verify_checksums=not args.no_verify, overwrite=args.overwrite,
              extra_files=extra, model_prefix=args.model_prefix)
    # the plan names the files: listing the output would cost requests on an object store
    print(f"{args.dst}: HuggingFace checkpoint, {len(plan.keys)} tensors in {len(plan.files)} safetensors "
          "file(s)")
    if plan.dropped_optimizer_keys:
        print(f"left out {len(plan.dropped_optimizer_keys)} optimizer state tensor(s) (model weights only; "
              "--keep-optimizer-state keeps them)")
    with open_checkpoint(args.src) as reader:
        stripped = reader.metadata.model_prefix if args.model_prefix is None else args.model_prefix
        values = [k for k in reader.metadata.objects if key_selected(k, args.include, args.exclude)]
    if values:  # an HF checkpoint holds tensors only: say what did not go (a step counter, param groups...)
        more = f" ... ({len(values) - 10} more)" if len(values) > 10 else ""
        print(f"left out {len(values)} non-tensor value(s) (an HF checkpoint holds tensors only): "
              f"{', '.join(repr(k) for k in values[:10])}{more}", file=sys.stderr)
    if config is None and stripped:
        print(f"model keys written without their wrapper prefix {stripped!r} (--model-prefix '' keeps it)")
    elif config is None and detect_format(args.src) in ("oarlock", "dcp", "paddle"):
        # a training checkpoint's keys are the training model's: without a mapping they are not HF names
        print(f"note: keys written under their stored names (e.g. {plan.keys[0].key!r}) since no --aoa/--preset "
              "was given: right when the model was saved under transformers' names; a model trained in "
              "oarlock.models (fused or renamed weights) maps to HF names with --preset NAME "
              "--model-config CONFIG.json (see `oarlock convert --help`, docs/aoa.md)" if plan.keys else
              "note: no tensors selected")


def register(sub: argparse._SubParsersAction) -> None:
    cv = sub.add_parser("convert", help="convert a checkpoint: HF <-> oarlock (TP/PP-sharded) <-> torch DCP; "
                                        "Paddle, Megatron, DeepSpeed, GGUF -> any, optionally through an AOA config",
                        description="Read SRC (oarlock, HuggingFace, Paddle FlexCheckpoint, torch DCP, Megatron-Core "
                                    "torch_dist, DeepSpeed ZeRO, GGUF or .safetensors), apply "
                                    "an optional AOA config, and write DST as a HuggingFace directory "
                                    "(model-0000i-of-0000N.safetensors + index), as an oarlock checkpoint sharded "
                                    "the way a tp*dp*pp job saves it, or as a torch DCP directory chunked the same "
                                    "way. Every output tensor or shard is read straight "
                                    "from the source bytes it needs and written before the next: memory holds one "
                                    "shard. SRC is never modified; DST appears only when complete.")
    cv.add_argument("src", metavar="SRC", help="source checkpoint (file or directory)")
    cv.add_argument("dst", metavar="DST", help="output directory")
    cv.add_argument("--to", choices=("hf", "oarlock", "dcp"),
                    help="output format: hf, oarlock, or dcp (a torch.distributed.checkpoint directory that "
                         "dcp.load reads; chunked by --tp/--pp/--dp like oarlock) (default: oarlock when "
                         "--tp/--pp/--dp/--tp-rules is given, else hf for oarlock/Paddle/DCP/accelerate/Megatron/"
                         "DeepSpeed/GGUF sources and oarlock for HF/safetensors ones)")
    cv.add_argument("--aoa", metavar="CONFIG", help="AOA config: text (one statement per line) or JSON "
                                                    "{\"aoa_statements\": [...], \"aoa_config_reverse\": bool}")
    cv.add_argument("--preset", metavar="NAME",
                    help="a ready-made AOA config and TP rules for an HF architecture (llama, mistral, smollm2, qwen2, "
                         "qwen2_moe, mixtral, deepseek_v3, gemma, gemma2, phi3, gpt2, bert, or auto = config.json's "
                         "model_type): HF -> fused training layout, or back when SRC is an oarlock checkpoint and "
                         "--to hf; megatron_gpt: a Megatron-Core GPT/Llama checkpoint -> HF Llama keys (give the "
                         "HF config.json with --model-config; it is copied into DST)")
    cv.add_argument("--model-config", metavar="CONFIG.json",
                    help="the model's config.json for --preset (default: the one in SRC)")
    cv.add_argument("--stacked-experts", action="store_true",
                    help="with --preset mixtral/qwen2_moe: stack each layer's experts into one [E, out, in] tensor "
                         "(layers.N.mlp.experts.gate_up_proj.weight / down_proj.weight), split on the expert axis")
    cv.add_argument("--reverse", action="store_true", help="invert the AOA statements (export model -> HF)")
    cv.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel degree of the output (oarlock)")
    cv.add_argument("--pp", type=int, default=1, metavar="N", help="pipeline stages of the output (oarlock): "
                                                                   "contiguous blocks of layers")
    cv.add_argument("--dp", type=int, default=1, metavar="N", help="data-parallel replicas (spreads the writes)")
    cv.add_argument("--tp-rules", metavar="NAME|FILE.json",
                    help="which axis each key is split on: 'megatron' (default; torch [out, in] Linear weights: "
                         "q/k/v/qkv/gate/up/intermediate and their biases on axis 0, o/down/output on axis 1, "
                         "embeddings and lm_head on axis 0), 'paddle' (Paddle [in, out] weights), 'none', or a JSON "
                         "file {glob: axis or null} (first match wins; no match = replicated)")
    cv.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                    help="largest HF output file, e.g. 5GB, 500MiB or bytes (default 5GB)")
    cv.add_argument("--no-side-files", action="store_true",
                    help="do not copy config.json, tokenizer and other side files from SRC")
    cv.add_argument("--model-prefix", default=None, metavar="PREFIX",
                    help="--to hf: the wrapper prefix stripped from the model keys (default: the one `inspect` "
                         "shows, 'model.' for torch's {\"model\": ..., \"optim\": ...} training state and "
                         "torchtitan's; '' keeps every key as stored)")
    cv.add_argument("--keep-optimizer-state", action="store_true",
                    help="--to hf: also export optimizer state tensors (exp_avg, ...); by default an HF export "
                         "holds model weights only (--to oarlock keeps everything)")
    add_filters(cv)
    cv.add_argument("--no-verify", action="store_true",
                    help="do not verify the source's block checksums first (oarlock sources record them)")
    cv.add_argument("--overwrite", action="store_true",
                    help="write DST even when it holds files oarlock did not write (without it such a DST is "
                         "refused with exit 2, naming them); those files stay, only files oarlock wrote are "
                         "replaced")
    cv.add_argument("--dry-run", action="store_true",
                    help="print the plan (keys, shapes, dtypes, bytes, split axes, files) and write nothing")
    cv.set_defaults(func=cmd_convert)
