"""Dense reference FlashMask attention: additive mask, fp32 math, chunked over query rows.

The definition every other back end is tested against (``docs/flashmask.md`` section 1): build the
``{0, -inf}`` mask from the indices, ``softmax(scale * Q K^T + M) V`` in fp32, mask heads repeated over their
query-head group and K/V heads over theirs. Query rows are processed ``chunk_size`` at a time so memory is
``O(chunk_size * Sk)`` per head instead of ``O(Sq * Sk)``. Plain torch ops, so autograd differentiates it
(that is also how this back end's backward works).
"""

from __future__ import annotations

import math

import torch

from oarlock.attention.masks import dense_keep_rows


def expand_block_mask(block_mask: torch.Tensor, seqlen_q: int, seqlen_k: int, rows: torch.Tensor,
                      block: int = 128) -> torch.Tensor:
    """Element-level keep matrix ``[B, Hm, R, Sk]`` of a ``[B, Hm, ceil(Sq/128), ceil(Sk/128)]`` tile mask."""
    cols = torch.arange(seqlen_k, device=block_mask.device) // block
    return block_mask[:, :, (rows // block)][:, :, :, cols] != 0


def attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, canon: torch.Tensor | None,
                        *, causal: bool, softmax_scale: float | None = None, block_mask: torch.Tensor | None = None,
                        dropout: float = 0.0, chunk_size: int = 1024,
                        generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference FlashMask attention.

    Args:
        query: ``[B, Sq, H, D]``; key ``[B, Sk, Hk, D]``; value ``[B, Sk, Hk, Dv]`` (``H % Hk == 0``).
        canon: int64 ``[B, Hm, Sk, 4]`` canonical indices (:func:`~oarlock.attention.masks.canonicalize`) or None
            (no mask besides ``causal``).
        causal: bottom-right aligned causal constraint.
        softmax_scale: default ``1 / sqrt(D)``.
        block_mask: optional int ``[B, Hm, ceil(Sq/128), ceil(Sk/128)]``, 0 drops a 128x128 tile.
        dropout: probability of zeroing a normalised attention weight (inverted dropout).

    Returns:
        ``(out, lse)``: out ``[B, Sq, H, Dv]`` in the query dtype (rows with no visible key are 0), lse float32
        ``[B, H, Sq]`` (natural-log sum of exp of the scaled scores; ``-inf`` for fully masked rows).
    """
    b, sq, h, d = query.shape
    sk, hk = key.shape[1], key.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    q = query.float().transpose(1, 2)  # [B, H, Sq, D]
    k = key.float().transpose(1, 2).repeat_interleave(h // hk, dim=1)
    v = value.float().transpose(1, 2).repeat_interleave(h // hk, dim=1)
    outs, lses = [], []
    for r0 in range(0, sq, chunk_size):
        rows = torch.arange(r0, min(r0 + chunk_size, sq), device=q.device)
        s = torch.matmul(q[:, :, r0:r0 + rows.numel()], k.transpose(-1, -2)) * scale
        if canon is not None:
            keep = dense_keep_rows(canon, rows, None, causal=causal, seqlen_q=sq)
        else:
            keep = torch.ones(1, 1, rows.numel(), sk, dtype=torch.bool, device=q.device)
            if causal:
                keep = keep & (torch.arange(sk, device=q.device) <= rows.view(-1, 1) + (sk - sq))
        if block_mask is not None:
            keep = keep & expand_block_mask(block_mask, sq, sk, rows)
        keep = keep.repeat_interleave(h // keep.shape[1], dim=1) if keep.shape[1] > 1 else keep
        s = s.masked_fill(~keep, float("-inf"))
        m = s.amax(-1, keepdim=True).detach()
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # fully masked rows: exp(-inf) = 0, no NaN
        p = torch.exp(s - m)
        l = p.sum(-1, keepdim=True)
        lses.append((m + torch.log(l)).squeeze(-1))
        w = p / l.clamp_min(torch.finfo(torch.float32).tiny)
        if dropout > 0:
            keep_d = torch.rand(w.shape, device=w.device, generator=generator) >= dropout
            w = w * keep_d / (1.0 - dropout)
        outs.append(torch.matmul(w, v))
    if sq == 0:
        out = q.new_zeros(b, h, 0, v.shape[-1])
        lse = q.new_zeros(b, h, 0)
    else:
        out = torch.cat(outs, 2)
        lse = torch.cat(lses, 2)
    return out.transpose(1, 2).to(query.dtype), lse
