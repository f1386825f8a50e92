"""An independent float64 FlashMask reference for the tests (issue 41 section 4): the dense mask is decoded
straight from the start/end row-index table of docs/flashmask.md section 1, and attention, its log-sum-exp and
the gradients are plain torch float64 autograd. Nothing here imports ``oarlock``, so a misreading of the index
semantics shared by the library's kernels and its own reference (``attention/reference.py``) cannot hide."""

from __future__ import annotations

import math

import torch


def keep_from_indices(idx: torch.Tensor | None, *, causal: bool, sq: int, sk: int) -> torch.Tensor:
    """Boolean ``[B or 1, Hm or 1, Sq, Sk]``, True where query row ``i`` may see key ``j``, from
    ``startend_row_indices`` ``[B, Hm, Sk, n]`` as docs/flashmask.md's table defines it:

    ======  ==  =============================================================
    causal  n   row ``i`` is masked for key ``j`` when
    ======  ==  =============================================================
    True    1   ``i >= LTS[j]``, or ``j > i + (Sk - Sq)``
    True    2   ``LTS[j] <= i < LTE[j]``, or ``j > i + (Sk - Sq)``
    False   2   ``i >= LTS[j]`` or ``i < UTE[j]``
    False   4   ``LTS[j] <= i < LTE[j]`` or ``UTS[j] <= i < UTE[j]``
    ======  ==  =============================================================
    """
    i = torch.arange(sq).view(sq, 1)
    j = torch.arange(sk).view(1, sk)
    masked = torch.zeros(1, 1, sq, sk, dtype=torch.bool)
    if idx is not None:
        col = [idx[..., c].to(torch.int64).unsqueeze(-2) for c in range(idx.shape[-1])]  # [B, Hm, 1, Sk] each
        n = len(col)
        if causal and n == 1:
            masked = i >= col[0]
        elif causal and n == 2:
            masked = (col[0] <= i) & (i < col[1])
        elif not causal and n == 2:
            masked = (i >= col[0]) | (i < col[1])
        elif not causal and n == 4:
            masked = ((col[0] <= i) & (i < col[1])) | ((col[2] <= i) & (i < col[3]))
        else:
            raise ValueError(f"no index form with causal={causal} and n={n} in docs/flashmask.md")
    if causal:
        masked = masked | (j > i + (sk - sq))  # bottom-right aligned diagonal
    return ~masked


def keep_for_heads(keep: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """Per query head ``[B, H, Sq, Sk]``: mask head count 1 (every head), ``kv_heads`` (one per GQA group: query
    head ``h`` belongs to group ``h // (H / Hk)``) or ``heads`` (one per query head)."""
    hm = keep.shape[1]
    if hm == 1 or hm == heads:
        return keep.expand(keep.shape[0], heads, *keep.shape[2:])
    assert hm == kv_heads, (hm, heads, kv_heads)
    return keep.repeat_interleave(heads // kv_heads, dim=1)


def attention_f64(q, k, v, keep: torch.Tensor, *, scale: float | None = None):
    """Masked softmax attention in float64 on ``[B, S, H, D]`` inputs (K/V with ``Hk`` heads, GQA), ``keep`` per
    query head ``[B or 1, H, Sq, Sk]``. Returns ``(out [B, Sq, H, Dv], lse [B, H, Sq])``; a row that sees no key
    gives output 0 and lse ``-inf`` (docs/flashmask.md section 1). Differentiable in ``q, k, v``."""
    h, hk = q.shape[2], k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qh = q.to(torch.float64).transpose(1, 2)  # [B, H, Sq, D]
    kh = k.to(torch.float64).repeat_interleave(h // hk, dim=2).transpose(1, 2)
    vh = v.to(torch.float64).repeat_interleave(h // hk, dim=2).transpose(1, 2)
    scores = qh @ kh.transpose(-1, -2) * scale
    seen = keep.any(-1, keepdim=True)
    # rows that see nothing get zero scores so that softmax stays finite, then weight 0
    scores = torch.where(keep, scores, float("-inf"))
    scores = torch.where(seen, scores, 0.0)
    p = torch.softmax(scores, dim=-1) * seen
    lse = torch.where(seen.squeeze(-1), torch.logsumexp(scores, dim=-1), float("-inf"))
    return (p @ vh).transpose(1, 2), lse


def reference_with_grads(q, k, v, keep, dout, dlse=None, *, scale: float | None = None):
    """``(out, lse, (dq, dk, dv))`` of :func:`attention_f64`, all float64, the gradients of
    ``sum(out * dout) + sum(lse * dlse)`` (rows with lse ``-inf`` contribute no lse gradient)."""
    leaves = [t.detach().to(torch.float64).requires_grad_(True) for t in (q, k, v)]
    out, lse = attention_f64(*leaves, keep, scale=scale)
    outs, grads_in = [out], [dout.to(torch.float64)]
    if dlse is not None:
        outs.append(lse)
        grads_in.append(dlse.to(torch.float64))
    grads = torch.autograd.grad(outs, leaves, grads_in)
    return out.detach(), lse.detach(), grads
