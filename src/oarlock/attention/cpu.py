"""Tiled FlashMask attention for CPU: forward and backward that skip fully masked tiles.

Algorithm (``docs/flashmask.md`` section 3, FlashMask paper arXiv 2410.01359, adapted to a CPU with BLAS):

1. Per key block of ``BLOCK_N`` columns, min/max of the four canonical vectors; every (query block, key block)
   tile is classified skip / partial / full (:func:`oarlock.attention.masks.classify_tiles`), united over
   mask heads (a tile is skipped only if every mask head skips it).
2. For each batch row and query block, the live key blocks are merged into *runs* of contiguous columns
   (documents and windows give one or two runs), and the runs are gathered side by side into one softmax step
   (up to ``MAX_RUN`` keys; longer rows take several steps joined by the online-softmax recurrence of
   FlashAttention-2). A step is one batched matmul over all heads for ``Q K^T``, one broadcast add of the
   element masks of its partial tiles (built for all partial tiles of the query block at once), the fused
   softmax, one matmul for ``P V``. Skipped tiles cost nothing, and Python overhead is per query block, not per
   tile, so small tiles stay cheap.
3. Backward recomputes ``P = exp(S - LSE)`` step by step (row-parallel, so dK/dV accumulate into column slices
   without atomics): ``dV += P^T dO``, ``dP = dO V^T``, ``dS = P (dP - rowsum(dO O))``, ``dQ += scale dS K``,
   ``dK += scale dS^T Q``.

Queries are laid out ``[B, Hk, Sq, G, D]`` (``G = H / Hk``) so that one matmul serves a whole GQA group and
the mask (per mask head ``Hm in {1, Hk}``) broadcasts over ``G``. Math is fp32 whatever the input dtype.
"""

from __future__ import annotations

import torch

from oarlock.attention.masks import TILE_FULL, TILE_SKIP, classify_tiles, dense_keep_rows
from oarlock.attention.reference import expand_block_mask

BLOCK_M = 128  # query rows per block (x G heads per matmul)
BLOCK_N = 64  # key columns per tile: fine enough to skip much, runs keep the op count low
MAX_RUN = 8192  # longest run of keys per softmax step (bounds the score buffer)
_NEG = -1e30  # finite stand-in for the running max of rows that saw no key yet


class _Plan:
    """Runs of live key columns per (batch, query block), and the element masks of their partial tiles.

    Keys are padded to ``Sk_pad = Tc * BLOCK_N`` (padded columns are masked) so that every run and every partial
    segment is a whole number of tiles: the masks of all partial tiles of a query block are then built in one
    vectorised shot (:meth:`bias`) and added per segment with one broadcast add, whatever the segment count.
    """

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
        tc = cls.shape[3]
        self.sk_pad = tc * BLOCK_N
        live = (cls != TILE_SKIP).any(1)  # [B, Tr, Tc]
        full = (cls == TILE_FULL).all(1)
        if self.sk_pad != sk:
            full[..., -1] = False  # the ragged last key tile holds padding columns to mask
        # runs[b][i] = [(c0, c1, [(p0, p1, first, count), ...]), ...]: live key columns [c0, c1) of query block
        # i; per partial segment [p0, p1) the index of its first tile in partial[b][i] and its tile count.
        self.runs: list[list[list[tuple[int, int, list[tuple[int, int, int, int]]]]]] = []
        self.partial: list[list[list[int]]] = []
        live_l, full_l = live.tolist(), full.tolist()
        self.live_tiles = int(live.sum())
        for bb in range(b):
            per_row, per_row_partial = [], []
            for lrow, frow in zip(live_l[bb], full_l[bb]):
                runs: list = []
                ptiles: list[int] = []
                start = -1
                segs: list = []
                for j in range(tc + 1):
                    alive = j < tc and lrow[j]
                    if start >= 0 and (not alive or (j - start) * BLOCK_N >= MAX_RUN):
                        runs.append((start * BLOCK_N, j * BLOCK_N, segs))
                        start, segs = -1, []
                    if alive:
                        if start < 0:
                            start = j
                        if not frow[j]:
                            c0 = j * BLOCK_N
                            if segs and segs[-1][1] == c0:
                                p0, _, first, cnt = segs[-1]
                                segs[-1] = (p0, c0 + BLOCK_N, first, cnt + 1)
                            else:
                                segs.append((c0, c0 + BLOCK_N, len(ptiles), 1))
                            ptiles.append(j)
                per_row.append(runs)
                per_row_partial.append(ptiles)
            self.runs.append(per_row)
            self.partial.append(per_row_partial)
        # steps[b][i]: runs grouped so each softmax step covers at most MAX_RUN keys; one step (the usual case)
        # needs no online-softmax rescaling and uses the fused softmax kernel
        self.steps = [[_group_runs(runs) for runs in row] for row in self.runs]
        # pad the vectors with "masked for every row" columns (LTS = 0, LTE = Sq)
        pad = self.sk_pad - sk
        vec = canon
        if pad:
            filler = torch.tensor([0, seqlen_q, 0, 0], dtype=canon.dtype).expand(b, hm, pad, 4)
            vec = torch.cat([canon, filler], 2)
        lts, lte, uts, ute = (vec[..., k].contiguous() for k in range(4))
        self.lts = lts
        self.lte = lte if bool((lte < seqlen_q).any()) else None
        has_ut = bool((ute > uts).any())
        self.uts = uts if has_ut else None
        self.ute = ute if has_ut else None
        self.block_mask = block_mask
        self._tile_cols = torch.arange(BLOCK_N)

    def bias(self, b: int, i: int, r0: int, r1: int) -> torch.Tensor | None:
        """fp32 ``[Hm, P, r1 - r0, BLOCK_N]`` for the P partial tiles of query block ``i``: ``-inf`` where the
        element is masked, else 0 (an add is several times cheaper than ``masked_fill`` on CPU, and the bias is
        G x Hk / Hm times smaller than the scores)."""
        tiles = self.partial[b][i]
        if not tiles:
            return None
        cols = (torch.tensor(tiles).view(-1, 1) * BLOCK_N + self._tile_cols).view(1, len(tiles), 1, BLOCK_N)
        rows = torch.arange(r0, r1).view(1, 1, -1, 1)
        flat = cols.flatten()

        def vec(t: torch.Tensor) -> torch.Tensor:
            return t[b][:, flat].view(-1, len(tiles), 1, BLOCK_N)

        m = rows >= vec(self.lts)
        if self.lte is not None:
            m &= rows < vec(self.lte)
        if self.uts is not None:
            m |= (rows >= vec(self.uts)) & (rows < vec(self.ute))
        if self.causal:
            m |= cols > rows + (self.sk - self.sq)
        if self.block_mask is not None:
            bmk = self.block_mask[b][:, (torch.arange(r0, r1) // 128)][:, :, (flat.clamp(max=self.sk - 1) // 128)]
            m |= (bmk == 0).view(-1, r1 - r0, len(tiles), BLOCK_N).transpose(1, 2)
        return torch.zeros(m.shape, dtype=torch.float32).masked_fill_(m, float("-inf"))

    @staticmethod
    def apply(s: torch.Tensor, bias: torch.Tensor | None, step, hk: int, n: int, g: int) -> None:
        """Add the partial tiles' masks to the scores ``s`` ``[Hk, n * G, W]`` of a step (its runs side by side)."""
        sv = None
        off = 0
        for c0, c1, segs in step:
            for p0, p1, first, cnt in segs:
                if sv is None:
                    sv = s.view(hk, n, g, s.shape[-1])
                part = bias[:, first:first + cnt].transpose(1, 2).unsqueeze(2)  # [Hm, n, 1, cnt, BN]
                sv[..., off + p0 - c0:off + p1 - c0].view(hk, n, g, cnt, BLOCK_N).add_(part)
            off += c1 - c0


def _group_runs(runs: list) -> list[list]:
    steps: list[list] = []
    width = 0
    for r in runs:
        w = r[1] - r[0]
        if not steps or width + w > MAX_RUN:
            steps.append([])
            width = 0
        steps[-1].append(r)
        width += w
    return steps


def _gather(x: torch.Tensor, bb: int, step: list) -> torch.Tensor:
    """Keys/values of a step ``[Hk, W, D]``: a view for one run, a copy for several."""
    if len(step) == 1:
        return x[bb, :, step[0][0]:step[0][1]]
    return torch.cat([x[bb, :, c0:c1] for c0, c1, _ in step], 1)


def _scatter_add(dst: torch.Tensor, bb: int, step: list, src: torch.Tensor) -> None:
    """``dst[bb, :, run columns] += src`` for the runs of a step laid side by side in ``src`` ``[Hk, W, D]``."""
    off = 0
    for c0, c1, _ in step:
        dst[bb, :, c0:c1].add_(src[:, off:off + c1 - c0])
        off += c1 - c0


def _keep_scale(shape, dropout: float, seed: int, bb: int, i: int, t: int) -> torch.Tensor:
    """Inverted-dropout multiplier ``Z / (1 - p)`` for step ``t`` of query block ``i`` of batch row ``bb``:
    regenerated bit for bit in the backward from the same (seed, bb, i, t)."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + bb * 65_537 + i * 257 + t) % (2 ** 63))
    return (torch.rand(shape, generator=gen) >= dropout).to(torch.float32).mul_(1.0 / (1.0 - dropout))


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


def _kv_layout(x: torch.Tensor, s_pad: int) -> torch.Tensor:
    """``[B, S, Hk, D]`` -> fp32 ``[B, Hk, s_pad, D]`` contiguous, zero-padded keys beyond ``S``."""
    view = x.transpose(1, 2)
    b, hk, s, d = view.shape
    out = torch.empty(b, hk, s_pad, d, dtype=torch.float32)
    out[:, :, :s].copy_(view)
    out[:, :, s:].zero_()
    return out


def _isolate_nonfinite(key: torch.Tensor, value: torch.Tensor, canon: torch.Tensor, *, causal: bool, seqlen_q: int,
                       heads: int, block_mask: torch.Tensor | None):
    """Keys whose K or V row holds NaN/Inf must contribute exactly nothing to the rows that do not see them: a
    masked score is only made -inf by an *add* (NaN + -inf = NaN) and ``0 * NaN`` in ``P V`` is NaN, so such a
    key would poison every row of its tile. Returns ``(key, value, rows_seeing)``: K/V with non-finite entries
    zeroed, and bool ``[B, Sq, H]`` marking the query rows that do see one of those keys (their result is NaN,
    as in the dense definition), or ``(key, value, None)`` when everything is finite (the common case)."""
    bad = ~(torch.isfinite(key).flatten(2).all(-1) & torch.isfinite(value).flatten(2).all(-1))  # [B, Sk]
    if not bool(bad.any()):
        return key, value, None
    key = torch.where(torch.isfinite(key), key, torch.zeros((), dtype=key.dtype))
    value = torch.where(torch.isfinite(value), value, torch.zeros((), dtype=value.dtype))
    b, hm = canon.shape[:2]
    rows = torch.arange(seqlen_q)
    seeing = torch.zeros(b, hm, seqlen_q, dtype=torch.bool)
    for bb in range(b):
        cols = bad[bb].nonzero().flatten()
        if cols.numel():
            keep = dense_keep_rows(canon[bb:bb + 1], rows, cols, causal=causal, seqlen_q=seqlen_q)
            if block_mask is not None:
                keep = keep & expand_block_mask(block_mask[bb:bb + 1], seqlen_q, canon.shape[2], rows)[..., cols]
            seeing[bb] = keep[0].any(-1)
    seeing = seeing.repeat_interleave(heads // hm, dim=1)  # mask head -> its query heads
    return key, value, seeing.transpose(1, 2)


def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, canon: torch.Tensor | None, *,
            causal: bool, scale: float, block_mask: torch.Tensor | None = None, dropout: float = 0.0,
            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled forward. Shapes as :func:`oarlock.attention.reference.attention_reference`; returns
    ``(out [B, Sq, H, Dv] in the query dtype, lse float32 [B, H, Sq])`` with ``lse = -inf`` on fully masked rows.
    ``dropout`` zeroes normalised weights with masks drawn from ``seed`` (the backward redraws them)."""
    b, sq, h, d = query.shape
    sk, hk, dv = key.shape[1], key.shape[2], value.shape[3]
    g = h // hk
    if canon is None:
        canon = _trivial_canon(b, sk, sq)
    key, value, seeing = _isolate_nonfinite(key, value, canon, causal=causal, seqlen_q=sq, heads=h,
                                            block_mask=block_mask)
    plan = _Plan(canon, causal=causal, seqlen_q=sq, block_mask=block_mask)
    q = _q_layout(query, hk).mul_(scale)
    k = _kv_layout(key, plan.sk_pad)
    v = _kv_layout(value, plan.sk_pad)
    out = torch.zeros(b, hk, sq, g, dv, dtype=torch.float32)
    lse = torch.full((b, hk, sq, g), float("-inf"), dtype=torch.float32)
    tiny = torch.finfo(torch.float32).tiny
    for bb in range(b):
        for i, steps in enumerate(plan.steps[bb]):
            if not steps:
                continue
            r0, r1 = i * BLOCK_M, min((i + 1) * BLOCK_M, sq)
            n = r1 - r0
            qb = q[bb, :, r0:r1].reshape(hk, n * g, d)
            bias = plan.bias(bb, i, r0, r1)
            if len(steps) == 1:
                # One softmax step: the fused softmax kernel does max/exp/sum/div in one sweep; since the
                # row maximum becomes exp(0) / l, log l = -log(max p).
                step = steps[0]
                s = torch.matmul(qb, _gather(k, bb, step).transpose(-1, -2))
                plan.apply(s, bias, step, hk, n, g)
                m = s.amax(-1, keepdim=True)
                p = torch.softmax(s, -1)
                row_lse = m - p.amax(-1, keepdim=True).log()
                if dropout > 0:
                    p.mul_(_keep_scale(p.shape, dropout, seed, bb, i, 0))
                o = torch.matmul(p, _gather(v, bb, step))
                if bias is not None:  # rows that see nothing: softmax gave NaN
                    empty = torch.isneginf(m)
                    o.masked_fill_(empty, 0.0)
                    row_lse.masked_fill_(empty, float("-inf"))
                out[bb, :, r0:r1] = o.view(hk, n, g, dv)
                lse[bb, :, r0:r1] = row_lse.view(hk, n, g)
                continue
            m_i = l_i = acc = None
            for t, step in enumerate(steps):  # online softmax over steps (FlashAttention-2 recurrence)
                s = torch.matmul(qb, _gather(k, bb, step).transpose(-1, -2))
                plan.apply(s, bias, step, hk, n, g)
                m_new = s.amax(-1, keepdim=True)
                if m_i is not None:
                    m_new = torch.maximum(m_new, m_i)
                m_new.clamp_(min=_NEG)
                p = s.sub_(m_new).exp_()
                row_sum = p.sum(-1, keepdim=True)
                if dropout > 0:
                    p.mul_(_keep_scale(p.shape, dropout, seed, bb, i, t))
                if m_i is None:
                    l_i = row_sum
                    acc = torch.matmul(p, _gather(v, bb, step))
                else:
                    alpha = torch.exp(m_i - m_new)
                    l_i = l_i.mul_(alpha).add_(row_sum)
                    acc = acc.mul_(alpha).baddbmm_(p, _gather(v, bb, step))
                m_i = m_new
            out[bb, :, r0:r1] = acc.div_(l_i.clamp(min=tiny)).view(hk, n, g, dv)
            lse[bb, :, r0:r1] = (m_i + l_i.log()).view(hk, n, g)
    out = out.permute(0, 2, 1, 3, 4).reshape(b, sq, h, dv).to(query.dtype)
    lse = lse.permute(0, 1, 3, 2).reshape(b, h, sq)
    if seeing is not None:
        out = out.masked_fill(seeing.unsqueeze(-1), float("nan"))
        lse = lse.masked_fill(seeing.transpose(1, 2), float("nan"))
    return out, lse


def backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, canon: torch.Tensor | None, *, causal: bool, scale: float,
             block_mask: torch.Tensor | None = None, dropout: float = 0.0, seed: int = 0,
             grad_lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiled backward: ``(dq, dk, dv)`` in the dtypes and shapes of ``query, key, value``. With dropout,
    ``rowsum(dO * O)`` still equals ``rowsum(P * dP)`` (O is the dropped output), as in FlashAttention-2.
    ``grad_lse`` (float ``[B, H, Sq]``, optional) is the gradient of the log-sum-exp output: since
    ``d lse_i / d s_ij = P_ij`` it enters as ``dS = P (dP - rowsum(dO O) + grad_lse)``."""
    b, sq, h, d = query.shape
    sk, hk, dv_ = key.shape[1], key.shape[2], value.shape[3]
    g = h // hk
    if canon is None:
        canon = _trivial_canon(b, sk, sq)
    key, value, seeing = _isolate_nonfinite(key, value, canon, causal=causal, seqlen_q=sq, heads=h,
                                            block_mask=block_mask)
    if seeing is not None:  # rows that see a non-finite key have NaN out/lse: leave them out of the sums
        grad_out = grad_out.masked_fill(seeing.unsqueeze(-1), 0.0)
        out = out.masked_fill(seeing.unsqueeze(-1), 0.0)
        lse = lse.masked_fill(seeing.transpose(1, 2), float("-inf"))
        if grad_lse is not None:
            grad_lse = grad_lse.masked_fill(seeing.transpose(1, 2), 0.0)
    plan = _Plan(canon, causal=causal, seqlen_q=sq, block_mask=block_mask)
    q = _q_layout(query, hk).mul_(scale)
    k = _kv_layout(key, plan.sk_pad)
    v = _kv_layout(value, plan.sk_pad)
    do = _q_layout(grad_out, hk)
    o = _q_layout(out, hk)
    delta = (do * o).sum(-1, keepdim=True)  # [B, Hk, Sq, G, 1]
    del o
    if grad_lse is not None:
        gl = torch.nan_to_num(grad_lse.float(), posinf=0.0, neginf=0.0)
        delta -= gl.view(b, hk, g, sq).permute(0, 1, 3, 2).unsqueeze(-1)
    lse_l = lse.view(b, hk, g, sq).permute(0, 1, 3, 2).unsqueeze(-1)  # [B, Hk, Sq, G, 1]
    lse_l = torch.where(torch.isinf(lse_l), torch.full_like(lse_l, float("inf")), lse_l)  # P = 0 on empty rows
    dq = torch.zeros(b, hk, sq, g, d, dtype=torch.float32)
    dk = torch.zeros(b, hk, plan.sk_pad, d, dtype=torch.float32)
    dv = torch.zeros(b, hk, plan.sk_pad, dv_, dtype=torch.float32)
    for bb in range(b):
        for i, steps in enumerate(plan.steps[bb]):
            if not steps:
                continue
            r0, r1 = i * BLOCK_M, min((i + 1) * BLOCK_M, sq)
            n = r1 - r0
            qb = q[bb, :, r0:r1].reshape(hk, n * g, d)
            dob = do[bb, :, r0:r1].reshape(hk, n * g, dv_)
            lb = lse_l[bb, :, r0:r1].reshape(hk, n * g, 1)
            db = delta[bb, :, r0:r1].reshape(hk, n * g, 1)
            dqb = dq[bb, :, r0:r1].view(hk, n * g, d)
            bias = plan.bias(bb, i, r0, r1)
            for t, step in enumerate(steps):
                kb, vb = _gather(k, bb, step), _gather(v, bb, step)
                s = torch.matmul(qb, kb.transpose(-1, -2))
                plan.apply(s, bias, step, hk, n, g)
                p = s.sub_(lb).exp_()
                dp = torch.matmul(dob, vb.transpose(-1, -2))
                if dropout > 0:
                    z = _keep_scale(p.shape, dropout, seed, bb, i, t)
                    dp.mul_(z)
                    pd = p * z  # dropped weights: what multiplied V in the forward
                else:
                    pd = p
                ds = dp.sub_(db).mul_(p)
                dqb.baddbmm_(ds, kb)
                if len(step) == 1:  # accumulate straight into the column slice
                    c0, c1, _ = step[0]
                    dv[bb, :, c0:c1].baddbmm_(pd.transpose(-1, -2), dob)
                    dk[bb, :, c0:c1].baddbmm_(ds.transpose(-1, -2), qb)
                else:
                    _scatter_add(dv, bb, step, torch.matmul(pd.transpose(-1, -2), dob))
                    _scatter_add(dk, bb, step, torch.matmul(ds.transpose(-1, -2), qb))
    dq = dq.mul_(scale).permute(0, 2, 1, 3, 4).reshape(b, sq, h, d).to(query.dtype)
    dk = dk[:, :, :sk].transpose(1, 2).to(key.dtype).contiguous()
    dv = dv[:, :, :sk].transpose(1, 2).to(value.dtype).contiguous()
    if seeing is not None:  # the gradient through a NaN output row is NaN
        dq = dq.masked_fill(seeing.unsqueeze(-1), float("nan"))
    return dq, dk, dv
