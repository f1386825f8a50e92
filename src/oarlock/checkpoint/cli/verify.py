"""``oarlock verify``: a checkpoint's integrity (block checksums, headers, coverage)."""

from __future__ import annotations

import argparse

from oarlock.checkpoint.cli.common import resolve_path


def cmd_verify(args: argparse.Namespace) -> int:
    from oarlock.checkpoint.integrity import verify_checkpoint
    from oarlock.utils import print_report

    rep = verify_checkpoint(resolve_path(args.path))
    return print_report(args.json, rep.to_json, rep.render, rep.intact)


def register(sub: argparse._SubParsersAction) -> None:
    v = sub.add_parser("verify", help="check a checkpoint's integrity (block checksums, headers, coverage)",
                       description="Check every block of every data file against the checksums recorded at save "
                                   "(files in parallel). For checkpoints without checksums (HF, Paddle, older "
                                   "oarlock) check what can be checked: safetensors headers, sizes and offsets, "
                                   "every shard the metadata names, and that each key's shards tile it. Exit "
                                   "status: 0 intact, 1 corrupt (each bad file/block/key named), 2 bad input.")
    v.add_argument("path", help="a .safetensors file or a checkpoint directory")
    v.add_argument("--json", action="store_true", help="machine-readable output")
    v.set_defaults(func=cmd_verify)
