"""``oarlock inspect`` (and later ``convert``, ``aoa explain``): checkpoint subcommands of the CLI."""

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


def cmd_inspect(args: argparse.Namespace) -> int:
    from oarlock.checkpoint.storage import open_checkpoint
    from oarlock.utils import dtype_itemsize

    with open_checkpoint(args.path) as reader:
        meta = reader.metadata
    sharded = any(len(t.shards) > 1 or t.shards[0].local_shape != t.global_shape
                  or t.shards[0].flattened_range is not None for t in meta.tensors.values())
    if args.json:
        out = {"path": str(args.path), "format": meta.format, "num_tensors": len(meta.tensors),
               "total_bytes": meta.total_bytes, "files": meta.files, "objects": meta.objects,
               "tensors": [{"key": t.key, "shape": list(t.global_shape), "dtype": t.dtype, "nbytes": t.nbytes,
                            "shards": [s.to_json() | {"nbytes": s.numel * dtype_itemsize(t.dtype)}
                                       for s in t.shards]}
                           for t in meta.tensors.values()]}
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    w = max([len(k) for k in meta.tensors] + [3])
    print(f"{args.path}: {meta.format} checkpoint, {len(meta.tensors)} tensors, "
          f"{_fmt_bytes(meta.total_bytes)} in {len(meta.files)} file(s)")
    print(f"{'key':<{w}}  {'shape':<20} {'dtype':<10} {'bytes':>12}")
    for t in meta.tensors.values():
        print(f"{t.key:<{w}}  {str(list(t.global_shape)):<20} {t.dtype:<10} {t.nbytes:>12}")
        if sharded:
            for s in t.shards:
                extra = f" flat={list(s.flattened_range)}" if s.flattened_range is not None else ""
                extra += f" replica={s.replica_id}" if s.replica_id else ""
                print(f"{'':<{w}}    shard offset={list(s.global_offset)} local_shape={list(s.local_shape)} "
                      f"file={s.file}{extra}")
    for k, v in meta.objects.items():
        print(f"{k:<{w}}  (object) {json.dumps(v)[:60]}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="list the tensors of a checkpoint (safetensors file, HF, oarlock or "
                                       "Paddle directory)",
                       description="Print every tensor key with shape, dtype and size in bytes; for sharded "
                                   "checkpoints also each shard's global offset, local shape and file.")
    p.add_argument("path", help="a .safetensors file or a checkpoint directory")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)
