"""``oarlock debug diff`` / ``render`` / ``show``: debugging subcommands of the CLI."""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_diff(args: argparse.Namespace) -> int:
    from oarlock.debug.diff import diff
    from oarlock.utils import print_report

    rep = diff(args.run_a, args.run_b)
    return print_report(args.json, rep.to_json, lambda: rep.format(max_frames=args.frames), not rep.diverged)


def cmd_render(args: argparse.Namespace) -> int:
    from oarlock.debug.dump import load_dump
    from oarlock.debug.graph import backward_dot, forward_dot, render_graph_html

    dump = load_dump(args.dump)
    other = load_dump(args.diff) if args.diff else None  # read both before writing anything
    out = Path(args.output) if args.output else dump.path.with_suffix(".html")
    page = render_graph_html(dump, diff_with=other, layout=args.layout)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    written = [out]
    if args.dot:
        base = out.with_suffix("")
        for name, text in (("forward", forward_dot(dump)), ("backward", backward_dot(dump))):
            p = base.with_name(f"{base.name}.{name}.dot")
            p.write_text(text, encoding="utf-8")
            written.append(p)
    for p in written:
        print(p)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from oarlock.debug.dump import load_dump
    from oarlock.utils import progress

    dump = load_dump(args.dump)
    print(f"{dump.path}: {len(dump.forward_ops())} forward ops, {len(dump.backward_ops())} backward ops, "
          f"{len(dump.nodes)} autograd nodes, checksum {dump.checksum}")
    for r in progress(dump.ops[: args.limit] if args.limit else dump.ops, desc="ops"):
        outs = ", ".join("-" if m is None else f"{m[1]}{m[0]}" for m in r.get("out") or [])
        mod = r.get("mod")
        mod = "-" if mod is None else (mod or "(root)")
        extra = f" <{r['nname']}>" if r["ph"] == "b" else ""
        hashes = " ".join(h or "-" for h in r.get("h") or [])
        print(f"{r['i']:>6} {r['ph']} {mod:<28} {r['op']:<40} {outs}{extra}  {hashes}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("debug", help="captured-run tools: diff two runs, render graphs, list ops",
                       description="Tools for dumps written by oarlock.debug.capture(...).")
    dsub = p.add_subparsers(dest="debug_command", metavar="SUBCOMMAND", parser_class=type(p))
    dsub.required = True
    d = dsub.add_parser("diff", help="find the first op where two captured runs diverge",
                        description="Align two capture dumps (even when their op sequences differ) and report "
                                    "the first op whose outputs differ, with both call stacks and, when the "
                                    "runs saved tensors, the max abs/rel difference. Exit code 0: no "
                                    "divergence, 1: divergence found, 2: bad input.")
    d.add_argument("run_a", help="first dump (.jsonl)")
    d.add_argument("run_b", help="second dump (.jsonl)")
    d.add_argument("--json", action="store_true", help="machine-readable report")
    d.add_argument("--frames", type=int, default=6, help="stack frames to show per stack (default 6)")
    d.set_defaults(func=cmd_diff)
    r = dsub.add_parser("render", help="write the forward/backward graphs as HTML (and DOT)",
                        description="Write a self-contained HTML page (inline SVG) with the forward graph and "
                                    "the backward (autograd) graph of a dump, clustered by module, shapes on "
                                    "edges; with --diff RUN_B the first divergent op is highlighted; with --dot "
                                    "also Graphviz DOT files next to it.")
    r.add_argument("dump", help="a capture dump (.jsonl)")
    r.add_argument("-o", "--output", help="HTML file to write (default: DUMP with .html)")
    r.add_argument("--dot", action="store_true", help="also write OUTPUT.forward.dot and OUTPUT.backward.dot")
    r.add_argument("--diff", metavar="RUN_B", help="another run's dump: highlight the first op where DUMP "
                                                   "diverges from it and the producers of its inputs")
    r.add_argument("--layout", choices=("auto", "dot", "outline"), default="auto",
                   help="auto (default): Graphviz dot when installed, else the built-in outline")
    r.set_defaults(func=cmd_render)
    s = dsub.add_parser("show", help="list the recorded ops of a dump",
                        description="One line per op: index, phase, module, op, outputs, autograd node, checksums.")
    s.add_argument("dump", help="a capture dump (.jsonl)")
    s.add_argument("--limit", type=int, default=0, help="show only the first N ops")
    s.set_defaults(func=cmd_show)
