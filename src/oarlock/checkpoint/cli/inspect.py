"""``oarlock inspect``: the tensors of a checkpoint (key, shape, dtype, bytes; shards and grid records)."""

from __future__ import annotations

import argparse
import sys
import json

from oarlock.checkpoint.cli.common import add_filters, resolve_path


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


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

    args.path = resolve_path(args.path)
    with open_checkpoint(args.path) as reader:
        meta = reader.metadata
        reader.check_files()  # a missing or truncated data file is an error (exit 2), as for convert and diff
    if args.include or args.exclude:
        held = len(meta.tensors) + len(meta.objects)
        meta = meta.filtered(args.include, args.exclude)
        if held and not meta.tensors and not meta.objects:  # say so, or "0 tensors" reads like an empty checkpoint
            print(f"oarlock inspect: no key of the {held} in {args.path} matches --include/--exclude (they take glob "
                  "patterns matched against whole keys, e.g. --include 'model.layers.0.*')", file=sys.stderr)
    return print_report(args.json, lambda: _inspect_json(args.path, meta), lambda: _inspect_text(args.path, meta))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="list the tensors of a checkpoint (safetensors file, HF, oarlock, "
                                       "Paddle, torch DCP, Megatron, DeepSpeed directory or GGUF file)",
                       description="Print every tensor key with shape, dtype and size in bytes; for sharded "
                                   "checkpoints also each shard's global offset, local shape and file.")
    p.add_argument("path", help="a .safetensors file or a checkpoint directory")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_filters(p)
    p.set_defaults(func=cmd_inspect)
