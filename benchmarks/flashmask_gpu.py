"""FlashMask on a CUDA GPU: oarlock's Triton kernel vs compiled FlexAttention, in TFLOP/s.

Same grid as benchmarks/flashmask_cpu.py (causal document, sliding window, shared question, prefix LM at
S = 1024, 4096, 8192; B=1, H=4, D=64 by default) in bf16, forward and forward+backward for both (FlexAttention
has a backward on CUDA). FLOPs are counted on the attended fraction of the score matrix as in the FlashMask paper
(section 4.1 of the spec): forward ``4 * density * B * H * Sq * Sk * D``, backward 2.5x that. Times are medians
of ``triton.testing.do_bench``. Appends a table with the command to benchmarks/RESULTS.md unless --no-write.

    PYTHONPATH=src python benchmarks/flashmask_gpu.py [--seqlens 1024 4096 8192] [--heads 4] [--head-dim 64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from oarlock.attention import flashmask_attention, to_dense_mask, to_flex_block_mask

sys.path.insert(0, str(Path(__file__).parent))
from flashmask_cpu import masks  # noqa: E402  (the same mask grid)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("flashmask_gpu.py needs a CUDA GPU; none is available here (see flashmask_cpu.py for CPU).")
        return 0
    import triton.testing
    from torch.nn.attention.flex_attention import flex_attention

    dtype = getattr(torch, args.dtype)
    b, h, d = args.batch, args.heads, args.head_dim
    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for s in args.seqlens:
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        dout = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))
        for name, (idx, causal) in masks(s).items():
            idx = idx.cuda().expand(b, -1, -1, -1).contiguous()
            density = float(to_dense_mask(idx[:1, :1], causal=causal).float().mean())
            flops_f = 4 * density * b * h * s * s * d
            bmask = to_flex_block_mask(idx, causal=causal, block_size=128)

            def fm_f():
                with torch.no_grad():
                    flashmask_attention(q, k, v, idx, causal=causal)

            def fm_fb():
                out = flashmask_attention(q, k, v, idx, causal=causal)
                torch.autograd.grad(out, (q, k, v), dout)

            def fx_f():
                with torch.no_grad():
                    flex(qt, kt, vt, block_mask=bmask)

            def fx_fb():
                out = flex(qt, kt, vt, block_mask=bmask)
                torch.autograd.grad(out, (qt, kt, vt), dout.transpose(1, 2))

            t = {n: triton.testing.do_bench(f) / 1e3 for n, f in
                 (("fm_f", fm_f), ("fm_fb", fm_fb), ("fx_f", fx_f), ("fx_fb", fx_fb))}
            r = dict(mask=name, S=s, density=density, **t,
                     tf_fm_f=flops_f / t["fm_f"] / 1e12, tf_fx_f=flops_f / t["fx_f"] / 1e12,
                     tf_fm_fb=3.5 * flops_f / t["fm_fb"] / 1e12, tf_fx_fb=3.5 * flops_f / t["fx_fb"] / 1e12)
            rows.append(r)
            print(f"{name:16s} S={s:6d} density={density:.3f} fwd {r['tf_fm_f']:.1f} vs flex {r['tf_fx_f']:.1f} "
                  f"TFLOP/s; fwd+bwd {r['tf_fm_fb']:.1f} vs flex {r['tf_fx_fb']:.1f}", flush=True)
    table = ["| mask | S | density | oarlock fwd ms | flex fwd ms | oarlock fwd TFLOP/s | flex fwd TFLOP/s | "
             "oarlock fwd+bwd ms | flex fwd+bwd ms | oarlock fwd+bwd TFLOP/s | flex fwd+bwd TFLOP/s | "
             "flex/oarlock fwd+bwd time |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['mask']} | {r['S']} | {r['density']:.3f} | {r['fm_f'] * 1e3:.3f} | {r['fx_f'] * 1e3:.3f} | "
                     f"{r['tf_fm_f']:.1f} | {r['tf_fx_f']:.1f} | {r['fm_fb'] * 1e3:.3f} | {r['fx_fb'] * 1e3:.3f} | "
                     f"{r['tf_fm_fb']:.1f} | {r['tf_fx_fb']:.1f} | {r['fx_fb'] / r['fm_fb']:.2f} |")
    print("\n".join(table))
    if not args.no_write:
        cmd = "PYTHONPATH=src python benchmarks/flashmask_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
        with Path(__file__).with_name("RESULTS.md").open("a") as f:
            f.write(f"\n## FlashMask GPU (oarlock Triton vs compiled FlexAttention)\n\nCommand: `{cmd.strip()}` on "
                    f"{torch.cuda.get_device_name()}, torch {torch.__version__}; B={b}, H={h}, D={d}, {args.dtype}.\n\n"
                    + "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
