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
from oarlock.attention.masks import TILE_SKIP, canonicalize, classify_tiles, dense_keep_rows

sys.path.insert(0, str(Path(__file__).parent))
from flashmask_cpu import masks  # noqa: E402  (the same mask grid)

FLOP_BLOCK = 128  # tile edge for "unmasked tiles" FLOP counts (FlexAttention's block; FlashMask V3's too)


def mask_stats(idx: torch.Tensor, causal: bool, seqlen_q: int, *, block: int = FLOP_BLOCK,
               chunk: int = 4096) -> dict:
    """Sparsity of a FlashMask mask (batch 0, mask head 0) without an ``Sq x Sk`` matrix.

    Returns ``density``: the attended fraction of the score matrix (the FlashMask paper's FLOP basis), and
    ``tile_density``: the fraction of ``block x block`` tiles not wholly masked (what a tile-skipping kernel
    computes; FLOPs "counting only unmasked tiles"). Rows are expanded ``chunk`` at a time on the mask's device.
    """
    canon = canonicalize(idx[:1, :1], causal=causal, seqlen_q=seqlen_q)
    sk = canon.shape[2]
    kept = 0
    for r0 in range(0, seqlen_q, chunk):
        rows = torch.arange(r0, min(r0 + chunk, seqlen_q), device=canon.device)
        kept += int(dense_keep_rows(canon, rows, None, causal=causal, seqlen_q=seqlen_q).sum())
    cls = classify_tiles(canon, causal=causal, seqlen_q=seqlen_q, block_m=block, block_n=block)
    return {"density": kept / max(1, seqlen_q * sk), "tile_density": float((cls != TILE_SKIP).float().mean())}


def forward_flops(fraction: float, b: int, h: int, sq: int, sk: int, d: int) -> float:
    """Forward FLOPs of attention over ``fraction`` of the score matrix (``4 * fraction * B * H * Sq * Sk * D``);
    the backward counts 2.5x that, forward+backward 3.5x."""
    return 4.0 * fraction * b * h * sq * sk * d


def attention_fns(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, idx: torch.Tensor,
                  causal: bool, *, flex=None, block_mask=None, sdpa: str | None = None) -> tuple[dict, tuple]:
    """``(fns, (qt, kt, vt))``: callables timing one mask, ``oarlock_fwd`` / ``oarlock_fwdbwd`` (``flashmask_attention`` on ``[B, S, H, D]``
    inputs), and with ``flex`` (a compiled ``flex_attention``) and its ``block_mask`` ``flex_fwd`` /
    ``flex_fwdbwd``; with ``sdpa`` (``"causal"``: the flash back end with ``is_causal``; ``"dense"``: the dense
    boolean mask of ``idx``) ``sdpa_fwd`` / ``sdpa_fwdbwd``; and the ``[B, H, S, D]`` copies of the inputs that Flex
    and SDPA get (None without them)."""
    fns = {}

    def fm_f():
        with torch.no_grad():
            return flashmask_attention(q, k, v, idx, causal=causal)

    def fm_fb():
        out = flashmask_attention(q, k, v, idx, causal=causal)
        return torch.autograd.grad(out, (q, k, v), dout)

    fns["oarlock_fwd"], fns["oarlock_fwdbwd"] = fm_f, fm_fb
    if flex is None and sdpa is None:
        return fns, None
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))
    dt = dout.transpose(1, 2).contiguous()
    if flex is not None:
        def fx_f():
            with torch.no_grad():
                return flex(qt, kt, vt, block_mask=block_mask)

        def fx_fb():
            out = flex(qt, kt, vt, block_mask=block_mask)
            return torch.autograd.grad(out, (qt, kt, vt), dt)

        fns["flex_fwd"], fns["flex_fwdbwd"] = fx_f, fx_fb
    if sdpa is not None:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if sdpa == "causal":
            backends, kw = [SDPBackend.FLASH_ATTENTION], {"is_causal": True}
        else:
            keep = to_dense_mask(idx, causal=causal, seqlen_q=q.shape[1])  # [B, Hm, Sq, Sk] bool
            # built once: SDPA would otherwise turn a bool mask into this additive one inside every timed call
            mask = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill_(~keep, float("-inf"))
            del keep
            # no math back end on CUDA: at 32k it would materialise every score (a refusal is reported instead)
            backends = ([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION] if q.is_cuda else
                        [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION])
            kw = {"attn_mask": mask}

        def sd_f():
            with torch.no_grad(), sdpa_kernel(backends):
                return F.scaled_dot_product_attention(qt, kt, vt, **kw)

        def sd_fb():
            with sdpa_kernel(backends):
                out = F.scaled_dot_product_attention(qt, kt, vt, **kw)
            return torch.autograd.grad(out, (qt, kt, vt), dt)

        fns["sdpa_fwd"], fns["sdpa_fwdbwd"] = sd_f, sd_fb
    return fns, (qt, kt, vt)


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
        for name, (idx, causal) in masks(s).items():
            idx = idx.cuda().expand(b, -1, -1, -1).contiguous()
            density = mask_stats(idx, causal, s)["density"]
            flops_f = forward_flops(density, b, h, s, s, d)
            bmask = to_flex_block_mask(idx, causal=causal, block_size=FLOP_BLOCK)
            fns, _ = attention_fns(q, k, v, dout, idx, causal, flex=flex, block_mask=bmask)
            t = {n: triton.testing.do_bench(fns[f]) / 1e3 for n, f in
                 (("fm_f", "oarlock_fwd"), ("fm_fb", "oarlock_fwdbwd"), ("fx_f", "flex_fwd"), ("fx_fb", "flex_fwdbwd"))}
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
