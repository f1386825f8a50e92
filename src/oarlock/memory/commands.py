"""``oarlock memory simulate|view|summary|synth``: the memory subcommands of the CLI."""

from __future__ import annotations

import argparse
import re

from oarlock.memory.errors import MemoryToolError

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """``"16GiB"``, ``"512m"``, ``"1048576"`` -> bytes. Raises :class:`MemoryToolError` naming the text."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise MemoryToolError(f"--capacity: cannot parse {text!r} as a byte size (e.g. 16GiB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def cmd_simulate(args: argparse.Namespace) -> int:
    from oarlock.memory.simulate import compare_allocators, format_table
    from oarlock.memory.trace import load_trace
    from oarlock.utils import print_report

    trace = load_trace(args.trace, args.device)
    names = [n.strip() for n in args.allocators.split(",") if n.strip()]
    cap = parse_bytes(args.capacity) if args.capacity else None
    rows = compare_allocators(trace, names, cap, min_capacity=not args.no_min_capacity, progress=True)
    return print_report(args.json, lambda: rows,
                        lambda: f"{args.trace}: {len(trace)} events, {len(trace.ops())} replayed ops"
                        + (f", capacity {args.capacity}" if cap else "") + "\n" + format_table(rows))


def cmd_view(args: argparse.Namespace) -> int:
    from oarlock.memory.observe import render_memory_html, render_png
    from oarlock.memory.trace import load_trace

    trace = load_trace(args.trace, args.device)
    out = args.output or str(args.trace) + ".html"
    render_memory_html(trace, out, top=args.top)
    print(f"wrote {out}")
    if not args.no_png:
        png = args.png or (out[:-5] if out.endswith(".html") else out) + ".png"
        render_png(trace, png)
        print(f"wrote {png}")
    return 0


def cmd_summary(args: argparse.Namespace) -> int:
    from oarlock.memory.observe import memory_summary
    from oarlock.memory.trace import load_trace

    trace = load_trace(args.trace, args.device)
    print(memory_summary(trace, args.allocator, parse_bytes(args.capacity) if args.capacity else None))
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    from oarlock.memory.trace import synthesize_moe

    tr = synthesize_moe(layers=args.layers, hidden=args.hidden, ffn=args.ffn, experts=args.experts,
                        local_experts=args.local_experts, topk=args.topk, tokens=args.tokens,
                        micro_batches=args.micro_batches, steps=args.steps, pipeline_stages=args.pipeline_stages,
                        recompute=args.recompute, imbalance=args.imbalance, seed=args.seed)
    tr.save(args.output)
    print(f"wrote {args.output}: {len(tr)} events, peak live {tr.peak_allocated / (1 << 30):.2f} GiB")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from oarlock.memory.allocators import ALLOCATORS, DEFAULT_ALLOCATORS

    p = sub.add_parser("memory", help="allocator simulator and memory observer",
                       description="Replay memory traces through allocator models, summarise and view them.")
    msub = p.add_subparsers(dest="memory_command", metavar="SUBCOMMAND")
    msub.required = True
    trace_help = ("a torch.cuda.memory._dump_snapshot pickle, a snapshot as JSON, or a torch.profiler chrome "
                  "trace JSON (profile_memory=True)")

    s = msub.add_parser("simulate", help="fragmentation, minimum capacity and driver calls per allocator model",
                        description="Replay TRACE through each allocator model and print peak allocated/"
                                    "reserved bytes, fragmentation = 1 - peak_allocated/peak_reserved, external "
                                    "fragmentation at the peak, driver calls and the minimum feasible capacity.")
    s.add_argument("trace", help=trace_help)
    s.add_argument("--allocators", default=",".join(DEFAULT_ALLOCATORS),
                   help=f"comma-separated models (known: {', '.join(ALLOCATORS)})")
    s.add_argument("--capacity", help="physical memory limit, e.g. 80GiB (default: unlimited)")
    s.add_argument("--no-min-capacity", action="store_true", help="skip the binary search for the minimum "
                                                                  "feasible capacity")
    s.add_argument("--device", type=int, default=None, help="device index inside the snapshot")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_simulate)

    v = msub.add_parser("view", help="write a self-contained HTML page and a PNG of a trace",
                        description="Render live bytes over time, the blocks live at the peak by address, and "
                                    "the largest allocations with their Python frames (offline HTML, no CDN).")
    v.add_argument("trace", help=trace_help)
    v.add_argument("-o", "--output", help="HTML file (default: TRACE.html)")
    v.add_argument("--png", help="PNG file (default: next to the HTML)")
    v.add_argument("--no-png", action="store_true", help="skip the PNG")
    v.add_argument("--top", type=int, default=20, help="how many of the largest allocations to list")
    v.add_argument("--device", type=int, default=None, help="device index inside the snapshot")
    v.set_defaults(func=cmd_view)

    m = msub.add_parser("summary", help="Paddle-style memory_summary tables of a trace replayed by a model",
                        description="Global snapshot, per-pool block statistics (Frag Ratio) and the "
                                    "block-size distribution after replaying TRACE through ALLOCATOR.")
    m.add_argument("trace", help=trace_help)
    m.add_argument("--allocator", default="caching", help=f"one of {', '.join(ALLOCATORS)}")
    m.add_argument("--capacity", help="physical memory limit, e.g. 80GiB")
    m.add_argument("--device", type=int, default=None, help="device index inside the snapshot")
    m.set_defaults(func=cmd_summary)

    y = msub.add_parser("synth", help="write a synthetic MoE training trace (snapshot pickle)",
                        description="Seeded synthetic MoE training trace in PyTorch's snapshot format.")
    y.add_argument("output", help="output file (.pickle, or .json)")
    for name, default, kind in (("layers", 8, int), ("hidden", 2048, int), ("ffn", 1408, int),
                                ("experts", 64, int), ("local-experts", 8, int), ("topk", 8, int),
                                ("tokens", 4096, int), ("micro-batches", 2, int), ("steps", 3, int),
                                ("pipeline-stages", 1, int), ("imbalance", 0.35, float), ("seed", 0, int)):
        y.add_argument(f"--{name}", type=kind, default=default, help=f"default {default}")
    y.add_argument("--recompute", action="store_true", help="recompute activations in backward")
    y.set_defaults(func=cmd_synth)
