"""Tiled FlashMask attention for CPU: forward and backward that skip fully masked tiles.

Algorithm (spec sections 3.1-3.4, FlashMask paper arXiv 2410.01359, adapted to a CPU with BLAS):

1. Per key block of ``BLOCK_N`` columns, min/max of the four canonical vectors; every (query block, key block)
   tile is classified skip / partial / full (:func:`oarlock.attention.masks.classify_tiles`), united over
   mask heads (a tile is skipped only if every mask head skips it).
2. For each batch row and query block, the live key blocks are merged into *runs* of contiguous columns
   (documents and windows give one or two runs). Each run is one step of an online softmax (FlashAttention-2
   recurrence): one batched matmul over all heads for ``Q K^T``, the element mask only when the run has a
   partial tile, ``exp``, one matmul for ``P V``. Skipped tiles cost nothing; Python overhead is per run, not
   per tile, so the kernel stays fast with small tiles.
3. Backward recomputes ``P = exp(S - LSE)`` run by run (row-parallel, so dK/dV accumulate into column slices
   without atomics): ``dV += P^T dO``, ``dP = dO V^T``, ``dS = P (dP - rowsum(dO O))``, ``dQ += scale dS K``,
   ``dK += scale dS^T Q``.

Queries are laid out ``[B, Hk, Sq, G, D]`` (``G = H / Hk``) so that one matmul serves a whole GQA group and
the mask (per mask head ``Hm in {1, Hk}``) broadcasts over ``G``. Math is fp32 whatever the input dtype.
"""

from __future__ import annotations

import torch

from oarlock.attention.masks import TILE_FULL, TILE_SKIP, classify_tiles

BLOCK_M = 128  # query rows per block (x G heads per matmul)
BLOCK_N = 64  # key columns per tile: fine enough to skip much, runs keep the op count low
MAX_RUN = 8192  # longest run of keys per softmax step (bounds the score buffer)
_NEG = -1e30  # finite stand-in for the running max of rows that saw no key yet


class _Plan:
    """Runs of live key columns per (batch, query block) and which vectors the element mask needs."""

    def __init__(self, canon: torch.Tensor, *, causal: bool, seqlen_q: int, block_mask: torch.Tensor | None):
        b, hm, sk, _ = canon.shape
        self.sq, self.sk, self.causal = seqlen_q, sk, causal
        cls = classify_tiles(canon, causal=causal, seqlen_q=seqlen_q, block_m=BLOCK_M, block_n=BLOCK_N)
        if block_mask is not None:
            tr, tc = cls.shape[2], cls.shape[3]
            bi = (torch.arange(tr) * BLOCK_M) // 128
            bj = (torch.arange(tc) * BLOCK_N) // 128
            drop = (block_mask[:, :, bi][:, :, :, bj] == 0).expand_as(cls)
            cls = cls.masked_fill(drop, TILE_SKIP)
        live = (cls != TILE_SKIP).any(1)  # [B, Tr, Tc]
        full = (cls == TILE_FULL).all(1)
        # runs[b][i] = [(c0, c1, [(p0, p1), ...]), ...]: live key columns [c0, c1) of query block i, with the
        # column segments that hold partial tiles (the only ones that need the element mask).
        self.runs: list[list[list[tuple[int, int, list[tuple[int, int]]]]]] = []
        live_l, full_l = live.tolist(), full.tolist()
        self.live_tiles = int(live.sum())
        for bb in range(b):
            per_row = []
            for lrow, frow in zip(live_l[bb], full_l[bb]):
                runs: list[tuple[int, int, list[tuple[int, int]]]] = []
                start = -1
                segs: list[tuple[int, int]] = []
                for j in range(len(lrow) + 1):
                    alive = j < len(lrow) and lrow[j]
                    if start >= 0 and (not alive or (j - start) * BLOCK_N >= MAX_RUN):
                        runs.append((start * BLOCK_N, min(j * BLOCK_N, sk), segs))
                        start, segs = -1, []
                    if alive:
                        if start < 0:
                            start = j
                        if not frow[j]:
                            c0, c1 = j * BLOCK_N, min((j + 1) * BLOCK_N, sk)
                            if segs and segs[-1][1] == c0:
                                segs[-1] = (segs[-1][0], c1)
                            else:
                                segs.append((c0, c1))
                per_row.append(runs)
            self.runs.append(per_row)
        lts, lte, uts, ute = (canon[..., k].contiguous() for k in range(4))
        self.lts = lts
        self.lte = lte if bool((lte < seqlen_q).any()) else None
        has_ut = bool((ute > uts).any())
        self.uts = uts if has_ut else None
        self.ute = ute if has_ut else None
        self.block_mask = block_mask

    def bias(self, b: int, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """fp32 ``[Hm, r1 - r0, 1, c1 - c0]``: ``-inf`` where the element is masked, else 0 (an add is several
        times cheaper than ``masked_fill`` on CPU, and the bias is G x Hk / Hm times smaller than the scores)."""
        rows = torch.arange(r0, r1).view(1, -1, 1)
        m = rows >= self.lts[b, :, c0:c1].unsqueeze(1)
        if self.lte is not None:
            m &= rows < self.lte[b, :, c0:c1].unsqueeze(1)
        if self.uts is not None:
            m |= (rows >= self.uts[b, :, c0:c1].unsqueeze(1)) & (rows < self.ute[b, :, c0:c1].unsqueeze(1))
        if self.causal:
            m |= torch.arange(c0, c1).view(1, 1, -1) > rows + (self.sk - self.sq)
        if self.block_mask is not None:
            bm = self.block_mask[b][:, (torch.arange(r0, r1) // 128)][:, :, (torch.arange(c0, c1) // 128)]
            m |= bm == 0
        return torch.zeros(m.shape, dtype=torch.float32).masked_fill_(m, float("-inf")).unsqueeze(2)

    def apply(self, s: torch.Tensor, b: int, r0: int, r1: int, c0: int, segs, hk: int, g: int) -> None:
        """Add the mask of the partial column segments to scores ``s`` ``[Hk, (r1 - r0) * G, c1 - c0]``."""
        sv = s.view(hk, r1 - r0, g, s.shape[-1])
        for p0, p1 in segs:
            sv[..., p0 - c0:p1 - c0].add_(self.bias(b, r0, r1, p0, p1))


def _trivial_canon(b: int, sk: int, sq: int) -> torch.Tensor:
    c = torch.zeros(b, 1, sk, 4, dtype=torch.int64)
    c[..., 0] = sq
    c[..., 1] = sq
    return c


def _q_layout(x: torch.Tensor, hk: int) -> torch.Tensor:
    """``[B, S, H, D]`` -> fp32 ``[B, Hk, S, G, D]`` contiguous, in one copy."""
    b, s, h, d = x.shape
    view = x.unflatten(2, (hk, h // hk)).permute(0, 2, 1, 3, 4)
    return torch.empty(view.shape, dtype=torch.float32).copy_(view)


def _kv_layout(x: torch.Tensor) -> torch.Tensor:
    """``[B, S, Hk, D]`` -> fp32 ``[B, Hk, S, D]`` contiguous."""
    view = x.transpose(1, 2)
    return torch.empty(view.shape, dtype=torch.float32).copy_(view)


def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, canon: torch.Tensor | None, *,
            causal: bool, scale: float, block_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled forward. Shapes as :func:`oarlock.attention.reference.attention_reference`; returns
    ``(out [B, Sq, H, Dv] in the query dtype, lse float32 [B, H, Sq])`` with ``lse = -inf`` on fully masked rows."""
    b, sq, h, d = query.shape
    sk, hk, dv = key.shape[1], key.shape[2], value.shape[3]
    g = h // hk
    if canon is None:
        canon = _trivial_canon(b, sk, sq)
    plan = _Plan(canon, causal=causal, seqlen_q=sq, block_mask=block_mask)
    q = _q_layout(query, hk).mul_(scale)
    k = _kv_layout(key)
    v = _kv_layout(value)
    out = torch.zeros(b, hk, sq, g, dv, dtype=torch.float32)
    lse = torch.full((b, hk, sq, g), float("-inf"), dtype=torch.float32)
    tiny = torch.finfo(torch.float32).tiny
    for bb in range(b):
        for i, runs in enumerate(plan.runs[bb]):
            if not runs:
                continue
            r0, r1 = i * BLOCK_M, min((i + 1) * BLOCK_M, sq)
            n = r1 - r0
            qb = q[bb, :, r0:r1].reshape(hk, n * g, d)
            m_i = l_i = acc = None
            for c0, c1, segs in runs:
                s = torch.matmul(qb, k[bb, :, c0:c1].transpose(-1, -2))
                plan.apply(s, bb, r0, r1, c0, segs, hk, g)
                m_new = s.amax(-1, keepdim=True)
                if m_i is not None:
                    m_new = torch.maximum(m_new, m_i)
                m_new.clamp_(min=_NEG)
                p = s.sub_(m_new).exp_()
                if m_i is None:
                    l_i = p.sum(-1, keepdim=True)
                    acc = torch.matmul(p, v[bb, :, c0:c1])
                else:
                    alpha = torch.exp(m_i - m_new)
                    l_i = l_i.mul_(alpha).add_(p.sum(-1, keepdim=True))
                    acc = acc.mul_(alpha).baddbmm_(p, v[bb, :, c0:c1])
                m_i = m_new
            out[bb, :, r0:r1] = acc.div_(l_i.clamp(min=tiny)).view(hk, n, g, dv)
            lse[bb, :, r0:r1] = (m_i + l_i.log()).view(hk, n, g)
    out = out.permute(0, 2, 1, 3, 4).reshape(b, sq, h, dv).to(query.dtype)
    return out, lse.permute(0, 1, 3, 2).reshape(b, h, sq)


def backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, canon: torch.Tensor | None, *, causal: bool, scale: float,
             block_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiled backward: ``(dq, dk, dv)`` in the dtypes and shapes of ``query, key, value``."""
    b, sq, h, d = query.shape
    sk, hk, dv_ = key.shape[1], key.shape[2], value.shape[3]
    g = h // hk
    if canon is None:
        canon = _trivial_canon(b, sk, sq)
    plan = _Plan(canon, causal=causal, seqlen_q=sq, block_mask=block_mask)
    q = _q_layout(query, hk).mul_(scale)
    k = _kv_layout(key)
    v = _kv_layout(value)
    do = _q_layout(grad_out, hk)
    o = _q_layout(out, hk)
    delta = (do * o).sum(-1, keepdim=True)  # [B, Hk, Sq, G, 1]
    del o
    lse_l = lse.view(b, hk, g, sq).permute(0, 1, 3, 2).unsqueeze(-1)  # [B, Hk, Sq, G, 1]
    lse_l = torch.where(torch.isinf(lse_l), torch.full_like(lse_l, float("inf")), lse_l)  # P = 0 on empty rows
    dq = torch.zeros(b, hk, sq, g, d, dtype=torch.float32)
    dk = torch.zeros(b, hk, sk, d, dtype=torch.float32)
    dv = torch.zeros(b, hk, sk, dv_, dtype=torch.float32)
    for bb in range(b):
        for i, runs in enumerate(plan.runs[bb]):
            if not runs:
                continue
            r0, r1 = i * BLOCK_M, min((i + 1) * BLOCK_M, sq)
            n = r1 - r0
            qb = q[bb, :, r0:r1].reshape(hk, n * g, d)
            dob = do[bb, :, r0:r1].reshape(hk, n * g, dv_)
            lb = lse_l[bb, :, r0:r1].reshape(hk, n * g, 1)
            db = delta[bb, :, r0:r1].reshape(hk, n * g, 1)
            dqb = dq[bb, :, r0:r1].view(hk, n * g, d)
            for c0, c1, segs in runs:
                kb, vb = k[bb, :, c0:c1], v[bb, :, c0:c1]
                s = torch.matmul(qb, kb.transpose(-1, -2))
                plan.apply(s, bb, r0, r1, c0, segs, hk, g)
                p = s.sub_(lb).exp_()
                dv[bb, :, c0:c1].baddbmm_(p.transpose(-1, -2), dob)
                ds = torch.matmul(dob, vb.transpose(-1, -2)).sub_(db).mul_(p)
                dqb.baddbmm_(ds, kb)
                dk[bb, :, c0:c1].baddbmm_(ds.transpose(-1, -2), qb)
    dq = dq.mul_(scale).permute(0, 2, 1, 3, 4).reshape(b, sq, h, d).to(query.dtype)
    return (dq, dk.transpose(1, 2).to(key.dtype).contiguous(), dv.transpose(1, 2).to(value.dtype).contiguous())
