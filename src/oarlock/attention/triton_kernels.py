"""FlashMask Triton kernels (GPU; the Triton interpreter runs them on CPU in tests). Imported lazily.

FlashAttention-2 style (Dao 2023) forward and backward with FlashMask tile skipping (arXiv 2410.01359;
``docs/flashmask.md`` section 3):

* Host preprocessing, O(B * Hm * (Sk + Tr * Tc)): per key block min/max of the canonical vectors, tile
  classification, then the FlashMask-V3 idea of a **compacted list of live key blocks per query block**
  (entry ``j`` = partial tile, ``-j - 1`` = unmasked tile) and, for the backward, of live query blocks per key
  block. Kernels iterate over these lists only: no iteration or load is spent on a skipped tile, and only
  partial tiles load the four index vectors and evaluate the element mask.
* Forward: grid (query blocks, batch x heads), online softmax, writes ``out`` and ``lse``.
* Backward: ``delta = rowsum(dO * O)`` on the host; kernel 1 is column-parallel (grid key blocks x batch x KV
  heads, looping over the query heads of the GQA group) and accumulates dK, dV on chip; kernel 2 is row-parallel
  and accumulates dQ. No atomics: deterministic.

Under ``TRITON_INTERPRET=1`` (CPU tensors) bf16 ``tl.dot`` is wrong (triton#11584), so operands are upcast to
fp32 before every ``tl.dot`` when interpreting.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from oarlock.attention.masks import TILE_FULL, TILE_SKIP, classify_tiles

BLOCK_M = 64
BLOCK_N = 64


# The kernels below are decorated (interpreted or compiled) when this module is imported: remember which.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PREC: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _element_masked(lts_p, lte_p, uts_p, ute_p, rows, cols, Sq, Sk, CAUSAL: tl.constexpr):
    """True where row ``rows[:, None]`` may not see column ``cols[None, :]`` (canonical 4-vector semantics)."""
    cm = cols < Sk
    lts = tl.load(lts_p + cols, mask=cm, other=0)
    lte = tl.load(lte_p + cols, mask=cm, other=0)
    uts = tl.load(uts_p + cols, mask=cm, other=0)
    ute = tl.load(ute_p + cols, mask=cm, other=0)
    r = rows[:, None]
    m = ((r >= lts[None, :]) & (r < lte[None, :])) | ((r >= uts[None, :]) & (r < ute[None, :]))
    if CAUSAL:
        m = m | (cols[None, :] > r + (Sk - Sq))
    return m


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, CANON, KV_LIST, KV_CNT,
                sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh,
                Sq, Sk, H, HK, HM, TR, TC, scale,
                CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, UPCAST: tl.constexpr,
                PREC: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // (H // HK)
    hm = h // (H // HM)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dq_ = tl.arange(0, BLOCK_D)
    dv_ = tl.arange(0, BLOCK_DV)
    rmask = rows < Sq
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dq_[None, :],
                mask=rmask[:, None] & (dq_[None, :] < D), other=0.0)
    base = (b * HM + hm) * Sk * 4
    lts_p = CANON + base
    lte_p = CANON + base + Sk
    uts_p = CANON + base + 2 * Sk
    ute_p = CANON + base + 3 * Sk
    lst = KV_LIST + ((b * HM + hm) * TR + pid_m) * TC
    cnt = tl.load(KV_CNT + (b * HM + hm) * TR + pid_m)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for t in range(0, cnt):
        enc = tl.load(lst + t)
        j = tl.where(enc >= 0, enc, -enc - 1)
        cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
        cm = cols < Sk
        k = tl.load(K + b * skb + hk * skh + cols[:, None] * sks + dq_[None, :],
                    mask=cm[:, None] & (dq_[None, :] < D), other=0.0)
        s = _dot(q, tl.trans(k), UPCAST, PREC) * scale
        s = tl.where(cm[None, :], s, float("-inf"))
        if enc >= 0:  # partial tile: element mask from the index vectors
            s = tl.where(_element_masked(lts_p, lte_p, uts_p, ute_p, rows, cols, Sq, Sk, CAUSAL),
                         float("-inf"), s)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + b * svb + hk * svh + cols[:, None] * svs + dv_[None, :],
                    mask=cm[:, None] & (dv_[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST, PREC)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(l_i > 0, m_safe + tl.log(l_safe), float("-inf"))  # -inf on rows that saw nothing
    tl.store(O + b * sob + h * soh + rows[:, None] * sos + dv_[None, :], out.to(O.dtype.element_ty),
             mask=rmask[:, None] & (dv_[None, :] < DV))
    tl.store(LSE + (b * H + h) * Sq + rows, lse, mask=rmask)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV_, CANON, Q_LIST, Q_CNT,
                     sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh,
                     Sq, Sk, H, HK, HM, TR, TC, scale,
                     CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_DV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, UPCAST: tl.constexpr,
                     PREC: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HK
    hk = pid_bh % HK
    G = H // HK
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cm = cols < Sk
    dq_ = tl.arange(0, BLOCK_D)
    dv_ = tl.arange(0, BLOCK_DV)
    k = tl.load(K + b * skb + hk * skh + cols[:, None] * sks + dq_[None, :],
                mask=cm[:, None] & (dq_[None, :] < D), other=0.0)
    v = tl.load(V + b * svb + hk * svh + cols[:, None] * svs + dv_[None, :],
                mask=cm[:, None] & (dv_[None, :] < DV), other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for g in range(0, G):
        h = hk * G + g
        hm = h // (H // HM)
        base = (b * HM + hm) * Sk * 4
        lst = Q_LIST + ((b * HM + hm) * TC + pid_n) * TR
        cnt = tl.load(Q_CNT + (b * HM + hm) * TC + pid_n)
        for t in range(0, cnt):
            enc = tl.load(lst + t)
            i = tl.where(enc >= 0, enc, -enc - 1)
            rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
            rmask = rows < Sq
            q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dq_[None, :],
                        mask=rmask[:, None] & (dq_[None, :] < D), other=0.0)
            do = tl.load(DO + b * sdob + h * sdoh + rows[:, None] * sdos + dv_[None, :],
                         mask=rmask[:, None] & (dv_[None, :] < DV), other=0.0)
            lse = tl.load(LSE + (b * H + h) * Sq + rows, mask=rmask, other=float("inf"))
            delta = tl.load(DELTA + (b * H + h) * Sq + rows, mask=rmask, other=0.0)
            s = _dot(q, tl.trans(k), UPCAST, PREC) * scale
            s = tl.where(cm[None, :], s, float("-inf"))
            if enc >= 0:
                s = tl.where(_element_masked(CANON + base, CANON + base + Sk, CANON + base + 2 * Sk,
                                             CANON + base + 3 * Sk, rows, cols, Sq, Sk, CAUSAL), float("-inf"), s)
            p = tl.exp(s - lse[:, None])  # lse = +inf on empty rows -> 0
            dv += _dot(tl.trans(p).to(do.dtype), do, UPCAST, PREC)
            dp = _dot(do, tl.trans(v), UPCAST, PREC)
            ds = p * (dp - delta[:, None])
            dk += _dot(tl.trans(ds).to(q.dtype), q, UPCAST, PREC)
    # dK, dV are written in fp32 [B, Sk, Hk, D] and cast on the host
    tl.store(DK + ((b * Sk + cols[:, None]) * HK + hk) * D + dq_[None, :], dk * scale,
             mask=cm[:, None] & (dq_[None, :] < D))
    tl.store(DV_ + ((b * Sk + cols[:, None]) * HK + hk) * DV + dv_[None, :], dv,
             mask=cm[:, None] & (dv_[None, :] < DV))


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CANON, KV_LIST, KV_CNT,
                   sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh,
                   Sq, Sk, H, HK, HM, TR, TC, scale,
                   CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, UPCAST: tl.constexpr,
                   PREC: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // (H // HK)
    hm = h // (H // HM)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < Sq
    dq_ = tl.arange(0, BLOCK_D)
    dv_ = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dq_[None, :],
                mask=rmask[:, None] & (dq_[None, :] < D), other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + rows[:, None] * sdos + dv_[None, :],
                 mask=rmask[:, None] & (dv_[None, :] < DV), other=0.0)
    lse = tl.load(LSE + (b * H + h) * Sq + rows, mask=rmask, other=float("inf"))
    delta = tl.load(DELTA + (b * H + h) * Sq + rows, mask=rmask, other=0.0)
    base = (b * HM + hm) * Sk * 4
    lst = KV_LIST + ((b * HM + hm) * TR + pid_m) * TC
    cnt = tl.load(KV_CNT + (b * HM + hm) * TR + pid_m)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for t in range(0, cnt):
        enc = tl.load(lst + t)
        j = tl.where(enc >= 0, enc, -enc - 1)
        cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
        cm = cols < Sk
        k = tl.load(K + b * skb + hk * skh + cols[:, None] * sks + dq_[None, :],
                    mask=cm[:, None] & (dq_[None, :] < D), other=0.0)
        v = tl.load(V + b * svb + hk * svh + cols[:, None] * svs + dv_[None, :],
                    mask=cm[:, None] & (dv_[None, :] < DV), other=0.0)
        s = _dot(q, tl.trans(k), UPCAST, PREC) * scale
        s = tl.where(cm[None, :], s, float("-inf"))
        if enc >= 0:
            s = tl.where(_element_masked(CANON + base, CANON + base + Sk, CANON + base + 2 * Sk,
                                         CANON + base + 3 * Sk, rows, cols, Sq, Sk, CAUSAL), float("-inf"), s)
        p = tl.exp(s - lse[:, None])
        dp = _dot(do, tl.trans(v), UPCAST, PREC)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, UPCAST, PREC)
    tl.store(DQ + ((b * Sq + rows[:, None]) * H + h) * D + dq_[None, :], dq * scale,
             mask=rmask[:, None] & (dq_[None, :] < D))


def _prepare(canon: torch.Tensor | None, b: int, sq: int, sk: int, causal: bool,
             block_mask: torch.Tensor | None, device: torch.device):
    """Canonical vectors as int32 ``[B, Hm, 4, Sk]`` and the compacted live-block lists (``docs/flashmask.md``
    section 3)."""
    if canon is None:
        canon = torch.zeros(b, 1, sk, 4, dtype=torch.int64, device=device)
        canon[..., :2] = sq
    cls = classify_tiles(canon, causal=causal, seqlen_q=sq, block_m=BLOCK_M, block_n=BLOCK_N)
    if block_mask is not None:
        tr, tc = cls.shape[2], cls.shape[3]
        bi = (torch.arange(tr, device=device) * BLOCK_M) // 128
        bj = (torch.arange(tc, device=device) * BLOCK_N) // 128
        cls = cls.masked_fill(block_mask[:, :, bi][:, :, :, bj] == 0, TILE_SKIP)

    def lists(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        live = c != TILE_SKIP
        j = torch.arange(c.shape[-1], device=device).expand_as(c)
        enc = torch.where(c == TILE_FULL, -j - 1, j)
        order = torch.argsort((~live).to(torch.int8), dim=-1, stable=True)
        return torch.gather(enc, -1, order).to(torch.int32).contiguous(), live.sum(-1).to(torch.int32).contiguous()

    kv_list, kv_cnt = lists(cls)  # per query block: live key blocks
    q_list, q_cnt = lists(cls.transpose(-1, -2))  # per key block: live query blocks
    vec = canon.transpose(-1, -2).to(torch.int32).contiguous()  # [B, Hm, 4, Sk]
    return vec, cls.shape[2], cls.shape[3], kv_list, kv_cnt, q_list, q_cnt


def _consts(query: torch.Tensor, value: torch.Tensor, causal: bool) -> dict:
    d, dv = query.shape[-1], value.shape[-1]
    return dict(CAUSAL=causal, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_DV=max(16, triton.next_power_of_2(dv)),
                D=d, DV=dv, UPCAST=_INTERPRETED or query.dtype == torch.float32,
                PREC="ieee" if query.dtype == torch.float32 else None)


def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, canon: torch.Tensor | None, *,
            causal: bool, scale: float, block_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward; same contract as :func:`oarlock.attention.cpu.forward`."""
    b, sq, h, _ = query.shape
    sk, hk, dv = key.shape[1], key.shape[2], value.shape[3]
    query, key, value = (x.contiguous() for x in (query, key, value))
    vec, tr, tc, kv_list, kv_cnt, _, _ = _prepare(canon, b, sq, sk, causal, block_mask, query.device)
    hm = vec.shape[1]
    out = torch.empty(b, sq, h, dv, dtype=query.dtype, device=query.device)
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=query.device)
    _fwd_kernel[(tr, b * h)](query, key, value, out, lse, vec, kv_list, kv_cnt,
                             query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1),
                             key.stride(2), value.stride(0), value.stride(1), value.stride(2), out.stride(0),
                             out.stride(1), out.stride(2), sq, sk, h, hk, hm, tr, tc, scale,
                             **_consts(query, value, causal))
    return out, lse


def backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, canon: torch.Tensor | None, *, causal: bool, scale: float,
             block_mask: torch.Tensor | None = None,
             grad_lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton backward; same contract as :func:`oarlock.attention.cpu.backward`."""
    b, sq, h, d = query.shape
    sk, hk, dv_ = key.shape[1], key.shape[2], value.shape[3]
    query, key, value, grad_out = (x.contiguous() for x in (query, key, value, grad_out))
    vec, tr, tc, kv_list, kv_cnt, q_list, q_cnt = _prepare(canon, b, sq, sk, causal, block_mask, query.device)
    hm = vec.shape[1]
    delta = (grad_out.float() * out.float()).sum(-1).transpose(1, 2).contiguous()  # [B, H, Sq]
    if grad_lse is not None:  # d lse / d s = P, so it enters dS = P (dP - delta) as -grad_lse
        delta = (delta - torch.nan_to_num(grad_lse.float(), posinf=0.0, neginf=0.0)).contiguous()
    lse = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse).contiguous()
    dq = torch.empty(b, sq, h, d, dtype=torch.float32, device=query.device)
    dk = torch.empty(b, sk, hk, d, dtype=torch.float32, device=query.device)
    dv = torch.empty(b, sk, hk, dv_, dtype=torch.float32, device=query.device)
    strides = (query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
               value.stride(0), value.stride(1), value.stride(2), grad_out.stride(0), grad_out.stride(1),
               grad_out.stride(2))
    consts = _consts(query, value, causal)
    _bwd_dkdv_kernel[(tc, b * hk)](query, key, value, grad_out, lse, delta, dk, dv, vec, q_list, q_cnt, *strides,
                                   sq, sk, h, hk, hm, tr, tc, scale, **consts)
    _bwd_dq_kernel[(tr, b * h)](query, key, value, grad_out, lse, delta, dq, vec, kv_list, kv_cnt, *strides,
                                sq, sk, h, hk, hm, tr, tc, scale, **consts)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)
