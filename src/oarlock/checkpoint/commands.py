"""``oarlock inspect``, ``oarlock aoa explain``, ``oarlock convert``, ``oarlock diff`` and ``oarlock verify``:
checkpoint subcommands of the CLI."""

from __future__ import annotations

import argparse
import json
import sys


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _resolve(path: str) -> str:
    """``path``, or the latest committed step when ``path`` is a CheckpointManager root (said on stderr)."""
    from oarlock.checkpoint.storage import resolve_manager_root

    resolved, step = resolve_manager_root(path)
    if step is not None:
        print(f"{path}: a CheckpointManager root; reading its latest committed step {step} ({resolved})",
              file=sys.stderr)
    return str(resolved)


def _inspect_json(path: str, meta: object) -> dict:
    from oarlock.utils import dtype_itemsize

    return {"path": str(path), "format": meta.format, "num_tensors": len(meta.tensors),
            "total_bytes": meta.total_bytes, "files": meta.files, "objects": meta.objects,
            "model_prefix": meta.model_prefix, "optimizer_state_keys": meta.optimizer_state_keys(),
            "non_model_keys": list(meta.non_model_keys),
            "tensors": [{"key": t.key, "shape": list(t.global_shape), "dtype": t.dtype, "nbytes": t.nbytes,
                         "shards": [s.to_json() | {"nbytes": s.numel * dtype_itemsize(t.dtype)} for s in t.shards]}
                        | ({"grid": t.grid.to_json()} if t.grid is not None else {})
                        for t in meta.tensors.values()]}


def _inspect_text(path: str, meta: object) -> str:
    sharded = any(len(t.shards) > 1 or t.shards[0].local_shape != t.global_shape
                  or t.shards[0].flattened_range is not None for t in meta.tensors.values())
    w = max([len(k) for k in meta.tensors] + [3])
    lines = [f"{path}: {meta.format} checkpoint, {len(meta.tensors)} tensors, "
             f"{_fmt_bytes(meta.total_bytes)} in {len(meta.files)} file(s)",
             f"{'key':<{w}}  {'shape':<20} {'dtype':<10} {'bytes':>12}"]
    for t in meta.tensors.values():
        lines.append(f"{t.key:<{w}}  {str(list(t.global_shape)):<20} {t.dtype:<10} {t.nbytes:>12}")
        if t.grid is not None:  # the record metadata.json keeps (docs/checkpoint-format.md, "Grid records")
            lines.append(f"{'':<{w}}    grid {json.dumps(t.grid.to_json(), separators=(',', ':'))}")
        if sharded:
            for s in t.shards:
                extra = f" flat={list(s.flattened_range)}" if s.flattened_range is not None else ""
                extra += f" replica={s.replica_id}" if s.replica_id else ""
                lines.append(f"{'':<{w}}    shard offset={list(s.global_offset)} local_shape={list(s.local_shape)} "
                             f"file={s.file}{extra}")
    for k, v in meta.objects.items():
        lines.append(f"{k:<{w}}  (object) {json.dumps(v)[:60]}")
    opt, runs = meta.optimizer_state_keys(), [k for k in meta.non_model_keys]
    if opt or runs:
        lines.append(f"# not model weights: {len(opt)} optimizer state tensor(s), {len(runs)} training-run record(s) "
                     "(convert --to hf leaves them out; model_only=True loads ignore them)")
    if meta.model_prefix:
        lines.append(f"# model weights under the wrapper prefix {meta.model_prefix!r} (convert --to hf strips it; "
                     "--model-prefix chooses another)")
    return "\n".join(lines)


def cmd_inspect(args: argparse.Namespace) -> int:
    from oarlock.checkpoint.storage import open_checkpoint
    from oarlock.utils import print_report

    args.path = _resolve(args.path)
    with open_checkpoint(args.path) as reader:
        meta = reader.metadata
        reader.check_files()  # a missing or truncated data file is an error (exit 2), as for convert and diff
    if args.include or args.exclude:
        meta = meta.filtered(args.include, args.exclude)
    return print_report(args.json, lambda: _inspect_json(args.path, meta), lambda: _inspect_text(args.path, meta))


def read_aoa_config(path: str) -> object:
    """An AOA config file: JSON (``{"aoa_statements": [...], ...}`` or a list of strings) or plain text with one
    statement per line (blank lines and ``#`` comments ignored)."""
    from pathlib import Path

    from oarlock.checkpoint.aoa import AOASyntaxError

    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise AOASyntaxError(f"{path}: cannot read the AOA config: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise AOASyntaxError(f"{path}: not a text AOA config (byte {e.start} is not UTF-8)") from None
    if "\x00" in text:
        raise AOASyntaxError(f"{path}: not a text AOA config (it holds NUL bytes)")
    if text.lstrip()[:1] in ("{", "["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise AOASyntaxError(f"{path}: invalid JSON: {e}") from None
        except RecursionError:
            raise AOASyntaxError(f"{path}: JSON nested too deeply for an AOA config") from None
        statements = data.get("aoa_statements") if isinstance(data, dict) else data
        if not isinstance(statements, (list, str)) or not all(isinstance(x, str) for x in
                                                              ([statements] if isinstance(statements, str)
                                                               else statements)):
            raise AOASyntaxError(f"{path}: expected {{\"aoa_statements\": [\"...\", ...]}} or a list of statement "
                                 "strings")
        if not statements:
            raise AOASyntaxError(f"{path}: the AOA config holds no statements")
        return data
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise AOASyntaxError(f"{path}: the AOA config holds no statements")
    return lines


def _explain_config(args: argparse.Namespace, source_dir: str) -> object:
    """The AOA config of ``aoa explain``: CONFIG or ``--preset NAME`` (built from SOURCE's config.json or
    ``--model-config``), with ``--reverse`` applied."""
    from oarlock.checkpoint.aoa import AOASyntaxError

    if (args.config is None) == (args.preset is None):
        raise AOASyntaxError("give either an AOA CONFIG file or --preset NAME")
    if args.preset is not None:
        from oarlock.checkpoint.presets import preset

        return preset(args.preset, args.model_config or source_dir, reverse=args.reverse, source=source_dir,
                      stacked_experts=getattr(args, "stacked_experts", False))
    config = read_aoa_config(args.config)
    if args.reverse:
        config = {"aoa_statements": config} if isinstance(config, list) else dict(config)
        config["aoa_config_reverse"] = True
    return config


def read_target_keys(path: str) -> dict:
    """KEYS.json: ``{key: {"shape": [...], "dtype": "..."}}`` -> ``{key: TensorSpec}``."""
    from pathlib import Path

    from oarlock.checkpoint.aoa import AOAError
    from oarlock.checkpoint.mapping import TensorSpec
    from oarlock.utils import dtype_name

    from oarlock.checkpoint.metadata import parse_json

    try:
        raw = parse_json(Path(path).read_bytes(), path, AOAError)
    except OSError as e:
        raise AOAError(f"{path}: cannot read the target keys: {e.strerror or e}") from None
    if not isinstance(raw, dict):
        raise AOAError(f"{path}: expected an object {{key: {{\"shape\": [...], \"dtype\": \"...\"}}}}")
    out = {}
    for k, v in raw.items():
        try:
            out[k] = TensorSpec(tuple(int(x) for x in v["shape"]), dtype_name(v["dtype"]))
        except (KeyError, TypeError, ValueError) as e:
            raise AOAError(f"{path}: entry {k!r} needs \"shape\" (list of ints) and \"dtype\": {e}") from None
    return out


def cmd_aoa_explain(args: argparse.Namespace) -> int:
    from oarlock.checkpoint.aoa import AOAError, compile_aoa, shard_counts, source_specs
    from oarlock.checkpoint.convert import resolve_tp_rules, tp_axis
    from oarlock.checkpoint.storage import open_checkpoint

    args.source = _resolve(args.source)
    config = _explain_config(args, args.source)
    with open_checkpoint(args.source) as reader:
        meta = reader.metadata
    source = source_specs(meta)
    target = read_target_keys(args.target) if args.target else None
    rules = resolve_tp_rules(args.tp_rules if args.tp_rules or not isinstance(config, dict)
                             else config.get("tp_rules"))
    if args.tp < 1:
        print(f"oarlock: error: --tp must be at least 1, got {args.tp}", file=sys.stderr)
        return 2
    try:
        prog = compile_aoa(config, source, target, source_shards=shard_counts(meta), allow_cast=args.allow_cast)
        axes = {}
        if args.tp > 1:  # as convert --tp N: fused_ffn / fused_qkv_old see the degree of every split key
            axes = {k: tp_axis(k, prog.destination_spec(k).shape, rules) for k in prog.destination_keys()}
            prog = compile_aoa(config, source, target, source_shards=shard_counts(meta), allow_cast=args.allow_cast,
                               destination_shards={k: args.tp for k, a in axes.items() if a is not None})
    except AOAError as e:  # the full message: statement, caret, macro expansion chain
        print(f"oarlock: error: {e}", file=sys.stderr)
        return 2
    print(prog.explain(only=args.only, tp=args.tp, tp_axes=axes))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from oarlock.checkpoint.convert import (ConversionLayout, convert_checkpoint, convert_to_dcp, export_hf,
                                            plan_conversion, resolve_tp_rules)
    from oarlock.checkpoint.storage import detect_format, open_checkpoint

    config = None
    args.src = _resolve(args.src)
    if args.aoa and args.preset:
        print("oarlock: error: give either --aoa CONFIG or --preset NAME, not both", file=sys.stderr)
        return 2
    if args.aoa:
        config = read_aoa_config(args.aoa)
        if args.reverse:
            config = {"aoa_statements": config} if isinstance(config, list) else dict(config)
            config["aoa_config_reverse"] = True
    elif args.reverse and not args.preset:
        print("oarlock: error: --reverse needs --aoa CONFIG or --preset NAME", file=sys.stderr)
        return 2
    parallel = (args.tp, args.pp, args.dp) != (1, 1, 1)
    trained = ("oarlock", "paddle", "dcp", "accelerate", "megatron", "deepspeed", "gguf")
    to = args.to or ("oarlock" if parallel or args.tp_rules else "hf" if detect_format(args.src) in trained
                     else "oarlock")
    if to == "hf" and (parallel or args.tp_rules):
        print("oarlock: error: --tp/--pp/--dp/--tp-rules apply to --to oarlock; an HF export holds whole tensors",
              file=sys.stderr)
        return 2
    if args.model_prefix is not None and to != "hf":
        print("oarlock: error: --model-prefix applies to --to hf (the other outputs keep the stored keys)",
              file=sys.stderr)
        return 2
    tp_rules = args.tp_rules
    if args.preset:
        from oarlock.checkpoint.presets import preset

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
        plan = plan_conversion(args.src, to="hf", aoa_config=config, max_shard_size=args.max_shard_size,
                               include=args.include, exclude=args.exclude, optimizer_state=keep_opt,
                               model_prefix=args.model_prefix)
        from pathlib import Path

        from oarlock.checkpoint.convert import side_files

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
            from oarlock.checkpoint.metadata import key_selected

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


def cmd_diff(args: argparse.Namespace) -> int:
    from oarlock.checkpoint.diff import diff_checkpoints
    from oarlock.utils import print_report

    if args.rtol < 0 or args.atol < 0:
        print("oarlock: error: --rtol and --atol must be >= 0", file=sys.stderr)
        return 2
    args.a, args.b = _resolve(args.a), _resolve(args.b)
    aoa = [read_aoa_config(args.aoa_a) if args.aoa_a else None, read_aoa_config(args.aoa_b) if args.aoa_b else None]
    if args.preset:
        from pathlib import Path

        from oarlock.checkpoint.presets import preset
        from oarlock.checkpoint.storage import detect_format

        sides = [args.a, args.b]
        oarlock_sides = [i for i, p in enumerate(sides) if detect_format(p) == "oarlock"]
        if not oarlock_sides:
            print("oarlock: error: --preset maps an oarlock training checkpoint's keys to HF names, and neither A "
                  "nor B is an oarlock checkpoint", file=sys.stderr)
            return 2
        for i in oarlock_sides:
            if aoa[i] is not None:
                print(f"oarlock: error: give either --aoa-{'ab'[i]} or --preset for {'AB'[i]}, not both",
                      file=sys.stderr)
                return 2
            other = sides[1 - i]
            cfg = args.model_config or (other if (Path(other) / "config.json").is_file() else sides[i])
            aoa[i] = preset(args.preset, cfg, reverse=True, source=sides[i])
    rep = diff_checkpoints(args.a, args.b, rtol=args.rtol, atol=args.atol, include=args.include,
                           exclude=args.exclude, aoa_a=aoa[0], aoa_b=aoa[1], verify_checksums=not args.no_verify)
    return print_report(args.json, rep.to_json, rep.render, rep.equal)


def cmd_verify(args: argparse.Namespace) -> int:
    from oarlock.checkpoint.integrity import verify_checkpoint
    from oarlock.utils import print_report

    rep = verify_checkpoint(_resolve(args.path))
    return print_report(args.json, rep.to_json, rep.render, rep.intact)


def _add_filters(p: argparse.ArgumentParser) -> None:
    p.add_argument("--include", action="append", metavar="GLOB",
                   help="only keys matching this glob (fnmatch syntax, e.g. 'model.layers.*'); repeatable")
    p.add_argument("--exclude", action="append", metavar="GLOB",
                   help="leave out keys matching this glob (e.g. '*.exp_avg*'); repeatable, applied after --include")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="list the tensors of a checkpoint (safetensors file, HF, oarlock, "
                                       "Paddle, torch DCP, Megatron, DeepSpeed directory or GGUF file)",
                       description="Print every tensor key with shape, dtype and size in bytes; for sharded "
                                   "checkpoints also each shard's global offset, local shape and file.")
    p.add_argument("path", help="a .safetensors file or a checkpoint directory")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _add_filters(p)
    p.set_defaults(func=cmd_inspect)

    d = sub.add_parser("diff", help="compare the tensors of two checkpoints (any formats and layouts)",
                       description="Compare the logical (whole) tensors of checkpoints A and B, of any formats and "
                                   "layouts (an HF directory against a TP=4 oarlock checkpoint compares whole "
                                   "tensors), reading one tensor at a time: keys only in A or B, shape and dtype "
                                   "changes, and per differing key the number of differing elements and the max "
                                   "absolute/relative difference. Elements differ when |a-b| > atol + rtol*|b|. "
                                   "Exit status: 0 equal, 1 different, 2 bad input. (For debug dumps see "
                                   "'oarlock debug diff'.)")
    d.add_argument("a", metavar="A", help="first checkpoint (file or directory)")
    d.add_argument("b", metavar="B", help="second checkpoint (file or directory)")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.add_argument("--rtol", type=float, default=0.0, metavar="R", help="relative tolerance (default 0: exact)")
    d.add_argument("--atol", type=float, default=0.0, metavar="A", help="absolute tolerance (default 0: exact)")
    d.add_argument("--aoa-a", metavar="CONFIG", help="read A through this AOA config (JSON or one statement per "
                                                     "line): keys are its destination keys")
    d.add_argument("--aoa-b", metavar="CONFIG", help="read B through this AOA config")
    d.add_argument("--preset", metavar="NAME",
                   help="map each side that is an oarlock training checkpoint to HF names with this preset run "
                        "backwards, as `convert --to hf --preset NAME` does (e.g. compare a demo checkpoint with "
                        "its HF export)")
    d.add_argument("--model-config", metavar="CONFIG.json",
                   help="the model's config.json for --preset (default: the other side's, else the side's own)")
    d.add_argument("--no-verify", action="store_true",
                   help="skip hashing the compared files against their recorded checksums first (a corrupted byte "
                        "then shows as a difference instead of an error)")
    _add_filters(d)
    d.set_defaults(func=cmd_diff)

    v = sub.add_parser("verify", help="check a checkpoint's integrity (block checksums, headers, coverage)",
                       description="Check every block of every data file against the checksums recorded at save "
                                   "(files in parallel). For checkpoints without checksums (HF, Paddle, older "
                                   "oarlock) check what can be checked: safetensors headers, sizes and offsets, "
                                   "every shard the metadata names, and that each key's shards tile it. Exit "
                                   "status: 0 intact, 1 corrupt (each bad file/block/key named), 2 bad input.")
    v.add_argument("path", help="a .safetensors file or a checkpoint directory")
    v.add_argument("--json", action="store_true", help="machine-readable output")
    v.set_defaults(func=cmd_verify)

    aoa = sub.add_parser("aoa", help="AOA weight-transformation language tools",
                         description="Tools for AOA configs (checkpoint -> model key mappings).")
    aoa_sub = aoa.add_subparsers(dest="aoa_command", metavar="SUBCOMMAND", parser_class=type(aoa))
    aoa_sub.required = True
    ex = aoa_sub.add_parser("explain", help="show the expanded statements and where each destination slice comes "
                                            "from",
                            description="Compile an AOA config against a checkpoint's keys and print the primitive "
                                        "statements after macro expansion, then for every destination key each "
                                        "slice's source key, source box, permutation and cast. Run this when a "
                                        "conversion looks wrong.")
    ex.add_argument("config", metavar="CONFIG", nargs="?",
                    help="a text file with one statement per line, or JSON "
                         "{\"aoa_statements\": [...], \"aoa_config_reverse\": false}; or use --preset")
    ex.add_argument("--preset", metavar="NAME", help="a ready-made config for an HF architecture (llama, mistral, "
                                                     "smollm2, qwen2, qwen2_moe, mixtral, deepseek_v3, gemma, gemma2, "
                                                     "phi3, gpt2, bert, or auto), built from the source's config.json; "
                                                     "megatron_gpt: Megatron-Core GPT/Llama -> HF Llama keys; "
                                                     "vllm_llama, vllm_qwen2 (or vllm): HF keys -> vLLM's fused "
                                                     "parameters (docs/vllm.md)")
    ex.add_argument("--model-config", metavar="CONFIG.json", help="the model's config.json for --preset (default: "
                                                                  "the one in --source)")
    ex.add_argument("--stacked-experts", action="store_true",
                    help="with --preset mixtral/qwen2_moe: stack each layer's experts into one [E, out, in] tensor")
    ex.add_argument("--tp", type=int, default=1, metavar="N",
                    help="show the TP-blocked layout and per-rank ranges that convert --tp N writes")
    ex.add_argument("--tp-rules", metavar="NAME|FILE.json", help="split axes for --tp (default: the preset's, "
                                                                 "else 'megatron')")
    ex.add_argument("--source", required=True, metavar="CKPT",
                    help="checkpoint whose metadata gives the source keys (any format oarlock inspect reads)")
    ex.add_argument("--target", metavar="KEYS.json",
                    help="destination keys: {key: {\"shape\": [...], \"dtype\": \"...\"}}; default: the "
                         "program's outputs")
    ex.add_argument("--reverse", action="store_true", help="invert the statements (aoa_config_reverse)")
    ex.add_argument("--only", metavar="GLOB", help="list only what concerns keys matching this glob (statements, "
                                                   "destination keys, skipped, missing, deleted and unused keys)")
    ex.add_argument("--allow-cast", action="store_true",
                    help="cast to the --target dtype where no AOA cast does (default: report a dtype mismatch)")
    ex.set_defaults(func=cmd_aoa_explain)

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
    _add_filters(cv)
    cv.add_argument("--no-verify", action="store_true",
                    help="do not verify the source's block checksums first (oarlock sources record them)")
    cv.add_argument("--overwrite", action="store_true",
                    help="write DST even when it holds files oarlock did not write (without it such a DST is "
                         "refused with exit 2, naming them); those files stay, only files oarlock wrote are "
                         "replaced")
    cv.add_argument("--dry-run", action="store_true",
                    help="print the plan (keys, shapes, dtypes, bytes, split axes, files) and write nothing")
    cv.set_defaults(func=cmd_convert)
