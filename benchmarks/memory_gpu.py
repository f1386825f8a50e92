"""GPU check (needs CUDA): replay a synthetic MoE trace with real allocations under PyTorch's default caching
allocator, expandable segments, and oarlock's remap pool (VmmArena on the CUDA driver), side by side.

    PYTHONPATH=src .venv/bin/python benchmarks/memory_gpu.py [--scale 0.25] [--write]

Each mode runs in its own process (PYTORCH_CUDA_ALLOC_CONF must be set before CUDA initialises). Reported per
mode: peak allocated (trace bytes), peak reserved (torch.cuda.max_memory_reserved, or the pool's physical
bytes), fragmentation = 1 - peak_allocated/peak_reserved, device memory used per cuMemGetInfo, wall time.
Also prints the simulator's prediction for the same trace, to calibrate the models.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MiB = 1 << 20


def make_trace(scale: float):
    from oarlock.memory.trace import synthesize_moe

    return synthesize_moe(layers=8, hidden=int(2048 * scale) // 64 * 64, ffn=int(1408 * scale) // 64 * 64,
                          tokens=4096, imbalance=0.5, pipeline_stages=4, micro_batches=4, steps=3)


def run_mode(mode: str, scale: float) -> dict:
    import torch

    tr = make_trace(scale)
    ops = tr.ops()
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    free0, total = torch.cuda.mem_get_info()
    live: dict[int, object] = {}
    cur = peak = 0
    peak_res = 0
    t0 = time.perf_counter()
    if mode == "remap":
        from oarlock.memory.vmm import VmmArena

        arena = VmmArena(0)
        alloc = lambda n: arena.empty(max(1, n), torch.uint8)  # noqa: E731
        reserved = lambda: arena.pool.reserved  # noqa: E731
    else:
        alloc = lambda n: torch.empty(max(1, n), dtype=torch.uint8, device=dev)  # noqa: E731
        reserved = torch.cuda.memory_reserved
    used_peak = 0
    for k, op in enumerate(ops):
        if op.kind == "a":
            live[op.id] = alloc(op.size)
            cur += op.size
            peak = max(peak, cur)
        else:
            del live[op.id]
            cur -= op.size
        peak_res = max(peak_res, reserved())
        if k % 200 == 0:
            used_peak = max(used_peak, free0 - torch.cuda.mem_get_info()[0])
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    out = {"mode": mode, "ops": len(ops), "peak_allocated": peak, "peak_reserved": peak_res,
           "fragmentation": 1 - peak / peak_res if peak_res else 0.0, "device_used_peak": used_peak,
           "wall_s": wall}
    if mode == "remap":
        out["driver_calls"] = dict(arena.pool.calls)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="hidden/ffn scale of the synthetic trace")
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--write", action="store_true", help="append to benchmarks/RESULTS.md")
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.scale)))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("memory_gpu.py: no CUDA device; nothing to measure", file=sys.stderr)
        return 0
    rows = []
    envs = {"caching": {}, "expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "remap": {}}
    for mode, extra in envs.items():
        env = {**os.environ, **extra}
        r = subprocess.run([sys.executable, __file__, "--mode", mode, "--scale", str(args.scale)], env=env,
                           capture_output=True, text=True)
        if r.returncode != 0:
            print(f"{mode}: failed:\n{r.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    from oarlock.memory.simulate import replay

    tr = make_trace(args.scale)
    sim = {m: replay(tr, m).fragmentation for m in ("caching", "expandable", "remap")}
    base = next((r for r in rows if r["mode"] == "caching"), None)
    lines = ["", "## memory: real-GPU replay (issue 10)", "",
             f"Command: `PYTHONPATH=src .venv/bin/python benchmarks/memory_gpu.py --scale {args.scale} --write` "
             f"on {torch.cuda.get_device_name(0)}.", "",
             "| mode | peak alloc | peak reserved | frag (measured) | frag (simulated) | device used | wall s | "
             "wall / caching |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["wall_s"] / base["wall_s"] if base else float("nan")
        lines.append(f"| {r['mode']} | {r['peak_allocated'] / MiB:.0f} MiB | {r['peak_reserved'] / MiB:.0f} MiB | "
                     f"{100 * r['fragmentation']:.2f}% | {100 * sim[r['mode']]:.2f}% | "
                     f"{r['device_used_peak'] / MiB:.0f} MiB | {r['wall_s']:.2f} | {ratio:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        res = Path(__file__).with_name("RESULTS.md")
        res.write_text(res.read_text() + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
