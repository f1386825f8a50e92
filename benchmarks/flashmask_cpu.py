"""FlashMask on CPU: oarlock's tiled kernel vs SDPA with a dense bool mask vs compiled FlexAttention.

Grid (issue 8): causal document, sliding window, shared question, prefix LM at S = 256, 1024, 4096, 8192;
B=1, H=4, D=64, fp32. Forward and forward+backward (FlexAttention has no backward on CPU: forward only).
``flashmask_attention`` runs SDPA with the dense mask when ``S * S <= DENSE_DISPATCH_MAX_SCORES``; the "tiled"
column times the tiled kernel alone (dispatch off), which is how the threshold is checked.
Reports best-of-N times (interleaved), ratios (anchor time / oarlock time, > 1 means oarlock is faster), tile sparsity at
oarlock's tile size, live tiles, and mask memory. Appends a markdown table with the command to
benchmarks/RESULTS.md unless --no-write.

    PYTHONPATH=src python benchmarks/flashmask_cpu.py [--seqlens 1024 4096 8192] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention

from oarlock.attention import (causal_document_mask, flashmask_attention, prefix_lm_causal_mask, shared_question_mask,
                               sliding_window_mask, to_dense_mask, to_flex_block_mask)
from oarlock.attention import cpu as fm_cpu
from oarlock.attention import flashmask as fm_module
from oarlock.attention.masks import TILE_SKIP, canonicalize, classify_tiles


def masks(s: int):
    f = s / 8192
    docs = [int(2538 * f), int(1742 * f), int(3213 * f)]  # spec 5.2 defaults; the rest is a padding document
    q, a = int(1024 * f), [int(x * f) for x in (1200, 1200, 1000)]
    return {
        "causal_document": (causal_document_mask(docs, seqlen=s), True),
        "sliding_window": (sliding_window_mask(s, int(1024 * f)), True),
        "shared_question": (shared_question_mask([(q, a), (int(1000 * f), [int(1400 * f), int(1368 * f)])],
                                                 seqlen=s), True),
        "prefix_lm": (prefix_lm_causal_mask(s, int(1024 * f)), False),
    }


def bench(fns: dict, reps: int) -> dict:
    """Best-of-``reps`` seconds per function, the functions interleaved rep by rep so that load from other
    processes on a shared machine hits all contenders alike (the minimum is the least disturbed run)."""
    for fn in fns.values():
        fn()  # warm-up (and compilation)
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: min(v) for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[256, 1024, 4096, 8192])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--masks", nargs="+", default=None)
    ap.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention (compiles per shape)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    b, h, d = 1, 4, 64
    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for s in args.seqlens:
        q, k, v = (torch.randn(b, s, h, d, requires_grad=True) for _ in range(3))
        dout = torch.randn(b, s, h, d)
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))
        for name, (idx, causal) in masks(s).items():
            if args.masks and name not in args.masks:
                continue
            canon = canonicalize(idx, causal=causal, seqlen_q=s)
            cls = classify_tiles(canon, causal=causal, seqlen_q=s, block_m=fm_cpu.BLOCK_M, block_n=fm_cpu.BLOCK_N)
            sparsity = float((cls == TILE_SKIP).float().mean())
            live = int((cls != TILE_SKIP).sum())
            keep = to_dense_mask(idx, causal=causal)  # [1, 1, S, S] bool

            def fm_fwd():
                with torch.no_grad():
                    flashmask_attention(q, k, v, idx, causal=causal)

            def fm_fb():
                out = flashmask_attention(q, k, v, idx, causal=causal)
                torch.autograd.grad(out, (q, k, v), dout)

            def fm_fb_tiled():
                limit, fm_module.DENSE_DISPATCH_MAX_SCORES = fm_module.DENSE_DISPATCH_MAX_SCORES, 0
                try:
                    fm_fb()
                finally:
                    fm_module.DENSE_DISPATCH_MAX_SCORES = limit

            def sdpa_fwd():
                with torch.no_grad():
                    torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=keep)

            def sdpa_fb():
                out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=keep)
                torch.autograd.grad(out, (qt, kt, vt), dout.transpose(1, 2))

            fwd = {"fm": fm_fwd, "sdpa": sdpa_fwd}
            bm_bytes = 0
            if not args.no_flex:
                bmask = to_flex_block_mask(idx, causal=causal, block_size=128)
                bm_bytes = sum(t.numel() * t.element_size() for t in bmask.as_tuple() if isinstance(t, torch.Tensor))
                qd, kd, vd = qt.detach(), kt.detach(), vt.detach()

                def flex_fwd():
                    with torch.no_grad():
                        flex(qd, kd, vd, block_mask=bmask)

                fwd["flex"] = flex_fwd
            tf = bench(fwd, args.reps)
            tb = bench({"fm": fm_fb, "sdpa": sdpa_fb, "tiled": fm_fb_tiled}, args.reps)
            t_fm, t_sd, t_fx = tf["fm"], tf["sdpa"], tf.get("flex", float("nan"))
            t_fm_fb, t_sd_fb = tb["fm"], tb["sdpa"]
            rows.append(dict(mask=name, S=s, sparsity=sparsity, live=live, fm=t_fm, sdpa=t_sd, flex=t_fx,
                             fm_fb=t_fm_fb, sdpa_fb=t_sd_fb, tiled_fb=tb["tiled"], idx_bytes=idx.numel() * 4,
                             dense_bytes=keep.numel(), bm_bytes=bm_bytes))
            r = rows[-1]
            print(f"{name:16s} S={s:5d} sparsity={sparsity:5.1%} live={live:5d} fwd {t_fm * 1e3:8.1f} ms "
                  f"(SDPA x{t_sd / t_fm:5.2f}, flex x{t_fx / t_fm:5.2f})  fwd+bwd {t_fm_fb * 1e3:8.1f} ms "
                  f"(SDPA x{t_sd_fb / t_fm_fb:5.2f})", flush=True)
    table = ["| mask | S | tile sparsity | live tiles | oarlock fwd ms | SDPA-dense fwd ms | flex compiled fwd ms | "
             "SDPA/oarlock fwd | flex/oarlock fwd | oarlock fwd+bwd ms | SDPA-dense fwd+bwd ms | SDPA/oarlock fwd+bwd "
             "| oarlock fwd+bwd us per live tile | tiled kernel alone fwd+bwd ms | "
             "mask bytes: indices / dense bool / flex BlockMask |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['mask']} | {r['S']} | {r['sparsity']:.1%} | {r['live']} | {r['fm'] * 1e3:.1f} | "
                     f"{r['sdpa'] * 1e3:.1f} | {r['flex'] * 1e3:.1f} | {r['sdpa'] / r['fm']:.2f} | "
                     f"{r['flex'] / r['fm']:.2f} | {r['fm_fb'] * 1e3:.1f} | {r['sdpa_fb'] * 1e3:.1f} | "
                     f"{r['sdpa_fb'] / r['fm_fb']:.2f} | {r['fm_fb'] / r['live'] * 1e6:.0f} | "
                     f"{r['tiled_fb'] * 1e3:.1f} | "
                     f"{r['idx_bytes']:,} / {r['dense_bytes']:,} / "
                     f"{r['bm_bytes']:,} |")
    print("\n".join(table))
    if not args.no_write:
        path = Path(__file__).with_name("RESULTS.md")
        cmd = "PYTHONPATH=src python benchmarks/flashmask_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
        with path.open("a") as f:
            f.write(f"\n## FlashMask CPU (oarlock tiled vs SDPA dense bool mask vs compiled FlexAttention)\n\n"
                    f"Command: `{cmd.strip()}` ({torch.get_num_threads()} threads, torch {torch.__version__}); "
                    f"B=1, H=4, D=64, fp32, best of {args.reps} interleaved runs; load average at the end "
                    f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs. Ratios = anchor time / oarlock time "
                    f"(> 1: oarlock faster). Tile sparsity at oarlock's {fm_cpu.BLOCK_M}x{fm_cpu.BLOCK_N} tiles. "
                    f"FlexAttention has no backward on CPU.\n\n" + "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
