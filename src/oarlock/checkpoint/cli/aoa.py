"""``oarlock aoa explain``: compile an AOA config against a checkpoint's keys and show where every destination slice
comes from."""

from __future__ import annotations

import argparse

from oarlock.checkpoint.cli.common import fail, read_aoa_config, resolve_path, reversed_config


def _explain_config(args: argparse.Namespace, source_dir: str) -> object:
    """The AOA config of ``aoa explain``: CONFIG or ``--preset NAME`` (built from SOURCE's config.json or
    ``--model-config``), with ``--reverse`` applied."""
    from oarlock.checkpoint.aoa import AOASyntaxError

    if (args.config is None) == (args.preset is None):
        raise AOASyntaxError("give either an AOA CONFIG file or --preset NAME")
    if args.preset is not None:
        from oarlock.checkpoint.aoa.presets import preset

        return preset(args.preset, args.model_config or source_dir, reverse=args.reverse, source=source_dir,
                      stacked_experts=getattr(args, "stacked_experts", False))
    config = read_aoa_config(args.config)
    return reversed_config(config) if args.reverse else config


def read_target_keys(path: str) -> dict:
    """KEYS.json: ``{key: {"shape": [...], "dtype": "..."}}`` -> ``{key: TensorSpec}``."""
    from pathlib import Path

    from oarlock.checkpoint.aoa import AOAError
    from oarlock.checkpoint.model.mapping import TensorSpec
    from oarlock.checkpoint.model.metadata import parse_json
    from oarlock.utils import dtype_name

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

    args.source = resolve_path(args.source)
    config = _explain_config(args, args.source)
    with open_checkpoint(args.source) as reader:
        meta = reader.metadata
    source = source_specs(meta)
    target = read_target_keys(args.target) if args.target else None
    rules = resolve_tp_rules(args.tp_rules if args.tp_rules or not isinstance(config, dict)
                             else config.get("tp_rules"))
    if args.tp < 1:
        return fail(f"--tp must be at least 1, got {args.tp}")
    try:
        prog = compile_aoa(config, source, target, source_shards=shard_counts(meta), allow_cast=args.allow_cast)
        axes = {}
        if args.tp > 1:  # as convert --tp N: fused_ffn / fused_qkv_old see the degree of every split key
            axes = {k: tp_axis(k, prog.destination_spec(k).shape, rules) for k in prog.destination_keys()}
            prog = compile_aoa(config, source, target, source_shards=shard_counts(meta), allow_cast=args.allow_cast,
                               destination_shards={k: args.tp for k, a in axes.items() if a is not None})
    except AOAError as e:  # the full message: statement, caret, macro expansion chain
        return fail(str(e))
    print(prog.explain(only=args.only, tp=args.tp, tp_axes=axes))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
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
                                                     "vllm_llama, vllm_qwen2, vllm_qwen3_moe, vllm_mixtral (or "
                                                     "vllm): HF keys -> vLLM's fused parameters (docs/vllm.md)")
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
