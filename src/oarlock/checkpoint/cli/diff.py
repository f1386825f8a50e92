"""``oarlock diff``: compare the logical tensors of two checkpoints of any formats and layouts."""

from __future__ import annotations

import argparse

from oarlock.checkpoint.cli.common import add_filters, fail, read_aoa_config, resolve_path


def cmd_diff(args: argparse.Namespace) -> int:
    from oarlock.checkpoint.convert.diff import diff_checkpoints
    from oarlock.utils import print_report

    if args.rtol < 0 or args.atol < 0:
        return fail("--rtol and --atol must be >= 0")
    args.a, args.b = resolve_path(args.a), resolve_path(args.b)
    aoa = [read_aoa_config(args.aoa_a) if args.aoa_a else None, read_aoa_config(args.aoa_b) if args.aoa_b else None]
    if args.preset:
        from pathlib import Path

        from oarlock.checkpoint.aoa.presets import preset
        from oarlock.checkpoint.storage import detect_format

        sides = [args.a, args.b]
        oarlock_sides = [i for i, p in enumerate(sides) if detect_format(p) == "oarlock"]
        if not oarlock_sides:
            return fail("--preset maps an oarlock training checkpoint's keys to HF names, and neither A nor B is an "
                        "oarlock checkpoint")
        for i in oarlock_sides:
            if aoa[i] is not None:
                return fail(f"give either --aoa-{'ab'[i]} or --preset for {'AB'[i]}, not both")
            other = sides[1 - i]
            cfg = args.model_config or (other if (Path(other) / "config.json").is_file() else sides[i])
            aoa[i] = preset(args.preset, cfg, reverse=True, source=sides[i])
    rep = diff_checkpoints(args.a, args.b, rtol=args.rtol, atol=args.atol, include=args.include,
                           exclude=args.exclude, aoa_a=aoa[0], aoa_b=aoa[1], verify_checksums=not args.no_verify)
    return print_report(args.json, rep.to_json, rep.render, rep.equal)


def register(sub: argparse._SubParsersAction) -> None:
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
    add_filters(d)
    d.set_defaults(func=cmd_diff)
