"""FlashMask masks: start/end row indices, one constructor per mask type, and conversions.

A FlashMask mask is ``startend_row_indices``, an int32 tensor ``[batch, mask_heads, seqlen_k, n]``. It is
column-wise: for key ``j`` it lists the query rows that may *not* see ``j`` as at most two half-open row
intervals (``docs/flashmask.md``, after Paddle's ``flashmask_attention``):

========  ===  =====================  ==============================================
causal    n    last dim               row ``i`` masked for key ``j`` when
========  ===  =====================  ==============================================
True      1    ``[LTS]``              ``i >= LTS[j]``  or ``j > i + (Sk - Sq)``
True      2    ``[LTS, LTE]``         ``LTS[j] <= i < LTE[j]`` or ``j > i + (Sk - Sq)``
False     2    ``[LTS, UTE]``         ``i >= LTS[j]`` or ``i < UTE[j]``
False     4    ``[LTS, LTE, UTS, UTE]`` ``LTS[j] <= i < LTE[j]`` or ``UTS[j] <= i < UTE[j]``
========  ===  =====================  ==============================================

The causal constraint is aligned bottom-right (FlashAttention >= 2.1, FlashMask V3): query ``i`` sees keys
``j <= i + Sk - Sq``. Internally every form is first put in the canonical 4-vector form ``[LTS, LTE, UTS, UTE]``
(int64, clamped to ``[0, Sq]``) by :func:`canonicalize`.

In the pictures of the constructors below, rows are queries, columns keys, ``#`` = attend, ``.`` = masked.
Each constructor returns int32 ``[batch_size, 1, seqlen, n]`` (``random_eviction_mask``: ``[batch_size,
num_heads, seqlen, 1]``) and says which ``causal`` flag it is meant for.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from oarlock.attention.errors import AttentionInputError, MaskNotRepresentableError

__all__ = [
    "canonicalize", "block_bounds", "classify_tiles", "dense_keep_rows", "to_dense_mask", "from_dense_mask",
    "to_mask_mod", "to_flex_block_mask", "window_to_indices", "mask_picture",
    "causal_mask", "sliding_window_mask", "bidirectional_sliding_window_mask", "causal_document_mask",
    "causal_document_mask_from_ids", "document_mask", "shared_question_mask", "global_sliding_window_mask",
    "prefix_lm_causal_mask",
    "prefix_lm_document_mask", "qk_sparse_mask", "random_eviction_mask", "causal_blockwise_mask",
    "TILE_SKIP", "TILE_PARTIAL", "TILE_FULL",
]

#: Tile classes of :func:`classify_tiles`.
TILE_SKIP, TILE_PARTIAL, TILE_FULL = 0, 1, 2


# ----------------------------------------------------------------------------------------------------------
# canonical form, block bounds, tile classification
# ----------------------------------------------------------------------------------------------------------

def canonicalize(startend_row_indices: torch.Tensor, *, causal: bool, seqlen_q: int) -> torch.Tensor:
    """The canonical ``[LTS, LTE, UTS, UTE]`` form of a FlashMask index tensor.

    Args:
        startend_row_indices: integer ``[B, Hm, Sk, n]`` with ``n`` in ``{1, 2}`` (causal) or ``{2, 4}``.
        causal: the ``causal`` flag the indices are used with (it decides what ``n == 2`` means).
        seqlen_q: number of query rows ``Sq``; values are clamped to ``[0, Sq]``.

    Returns:
        int64 ``[B, Hm, Sk, 4]``; an absent interval is empty (``LTS = LTE = Sq`` or ``UTS = UTE = 0``).

    Raises:
        AttentionInputError: wrong rank or last dimension for the causal flag.
    """
    idx = startend_row_indices
    if idx.dim() != 4:
        raise AttentionInputError(
            f"startend_row_indices must be 4-D [batch, mask_heads, seqlen_k, n], got shape {tuple(idx.shape)}")
    n = idx.shape[-1]
    allowed = (1, 2) if causal else (2, 4)
    if n not in allowed:
        raise AttentionInputError(
            f"startend_row_indices last dim must be one of {allowed} when causal={causal}, got {n} "
            f"(shape {tuple(idx.shape)})")
    idx = idx.to(torch.int64).clamp(0, seqlen_q)
    full = torch.full_like(idx[..., 0], seqlen_q)
    zero = torch.zeros_like(idx[..., 0])
    if causal and n == 1:
        parts = [idx[..., 0], full, zero, zero]
    elif causal:
        parts = [idx[..., 0], idx[..., 1], zero, zero]
    elif n == 2:
        parts = [idx[..., 0], full, zero, idx[..., 1]]
    else:
        parts = [idx[..., 0], idx[..., 1], idx[..., 2], idx[..., 3]]
    return torch.stack(parts, dim=-1)


def block_bounds(canon: torch.Tensor, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per key block minimum and maximum of each canonical vector (``docs/flashmask.md`` section 3).

    Args:
        canon: int64 ``[B, Hm, Sk, 4]`` from :func:`canonicalize`.
        block_n: key block size ``BN``.

    Returns:
        ``(mins, maxs)``, each int64 ``[B, Hm, ceil(Sk / BN), 4]``; the tail block reduces over its valid
        columns only.
    """
    b, hm, sk, _ = canon.shape
    tc = -(-sk // block_n)
    pad = tc * block_n - sk
    if pad == 0:
        blocks = canon.transpose(-1, -2).reshape(b, hm, 4, tc, block_n)
        return blocks.amin(-1).transpose(-1, -2), blocks.amax(-1).transpose(-1, -2)
    # pad the tail block with its own first column so it reduces over valid columns only
    filler = canon[:, :, (tc - 1) * block_n:(tc - 1) * block_n + 1].expand(b, hm, pad, 4)
    blocks = torch.cat([canon, filler], 2).transpose(-1, -2).reshape(b, hm, 4, tc, block_n)
    return blocks.amin(-1).transpose(-1, -2), blocks.amax(-1).transpose(-1, -2)


def classify_tiles(canon: torch.Tensor, *, causal: bool, seqlen_q: int, block_m: int, block_n: int,
                   ragged_partial: bool = False) -> torch.Tensor:
    """Classify every (query block, key block) tile as skipped, partial or full (``docs/flashmask.md`` section 3).

    A tile is skipped when every element is masked, full when no element is masked (no element mask needed),
    partial otherwise (conservatively: a tile may be called partial although it is full). With
    ``ragged_partial`` the ragged tail row/column blocks are partial too (FlexAttention's convention).

    Args:
        canon: int64 ``[B, Hm, Sk, 4]`` from :func:`canonicalize`.

    Returns:
        int8 ``[B, Hm, Tr, Tc]`` with values :data:`TILE_SKIP`, :data:`TILE_PARTIAL`, :data:`TILE_FULL`,
        ``Tr = ceil(Sq / block_m)``, ``Tc = ceil(Sk / block_n)``.
    """
    sk = canon.shape[2]
    mins, maxs = block_bounds(canon, block_n)
    tr = -(-seqlen_q // block_m)
    tc = mins.shape[2]
    dev = canon.device
    r0 = (torch.arange(tr, device=dev) * block_m).view(1, 1, tr, 1)
    r1 = torch.clamp(r0 + block_m, max=seqlen_q)
    lts_min, lte_min, uts_min, ute_min = (mins[..., k].unsqueeze(2) for k in range(4))
    lts_max, lte_max, uts_max, ute_max = (maxs[..., k].unsqueeze(2) for k in range(4))
    dead = ((r0 >= lts_max) & (r1 <= lte_min)) | ((r0 >= uts_max) & (r1 <= ute_min))
    part = ((r1 > lts_min) & (r0 < lte_max)) | ((r1 > uts_min) & (r0 < ute_max))
    if causal:
        c0 = (torch.arange(tc, device=dev) * block_n).view(1, 1, 1, tc)
        c1 = torch.clamp(c0 + block_n, max=sk)
        off = sk - seqlen_q
        dead = dead | (c0 > r1 - 1 + off)  # the whole tile lies above the diagonal
        part = part | (c1 - 1 > r0 + off)  # the diagonal crosses the tile
    if ragged_partial:
        c1 = torch.arange(1, tc + 1, device=dev).view(1, 1, 1, tc) * block_n
        part = part | (c1 > sk) | (r0 + block_m > seqlen_q)
    cls = torch.full(dead.shape, TILE_FULL, dtype=torch.int8, device=dev)
    cls[part.expand_as(cls)] = TILE_PARTIAL
    cls[dead.expand_as(cls)] = TILE_SKIP
    return cls


def dense_keep_rows(canon: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor | slice | None, *,
                    causal: bool, seqlen_q: int) -> torch.Tensor:
    """Boolean "may attend" matrix for the given query rows and key columns.

    Args:
        canon: int64 ``[B, Hm, Sk, 4]``.
        rows: int64 ``[R]`` absolute query rows.
        cols: key columns (a slice, an index tensor, or None for all).

    Returns:
        bool ``[B, Hm, R, C]``, True where row ``rows[r]`` may attend column ``cols[c]``.
    """
    sk = canon.shape[2]
    sel = canon if cols is None else canon[:, :, cols]
    lts, lte, uts, ute = (sel[..., k].unsqueeze(2) for k in range(4))
    r = rows.view(1, 1, -1, 1)
    masked = ((r >= lts) & (r < lte)) | ((r >= uts) & (r < ute))
    if causal:
        if cols is None:
            c = torch.arange(sk, device=canon.device)
        elif isinstance(cols, slice):
            c = torch.arange(sk, device=canon.device)[cols]
        else:
            c = cols
        masked = masked | (c.view(1, 1, 1, -1) > r + (sk - seqlen_q))
    return ~masked


def to_dense_mask(startend_row_indices: torch.Tensor, *, causal: bool, seqlen_q: int | None = None) -> torch.Tensor:
    """The dense boolean mask of FlashMask indices (True = attend, as SDPA and FlexAttention use it).

    Args:
        startend_row_indices: integer ``[B, Hm, Sk, n]``.
        causal: the ``causal`` flag the indices are used with.
        seqlen_q: number of query rows (default ``Sk``).

    Returns:
        bool ``[B, Hm, Sq, Sk]`` (O(N^2) memory: for tests, SDPA and small pictures).
    """
    sk = startend_row_indices.shape[2]
    sq = sk if seqlen_q is None else seqlen_q
    canon = canonicalize(startend_row_indices, causal=causal, seqlen_q=sq)
    return dense_keep_rows(canon, torch.arange(sq, device=canon.device), None, causal=causal, seqlen_q=sq)


def mask_picture(startend_row_indices: torch.Tensor, *, causal: bool, seqlen_q: int | None = None) -> str:
    """The dense mask of batch 0, head 0 as text: one line per query row, ``#`` = attend, ``.`` = masked."""
    dense = to_dense_mask(startend_row_indices[:1, :1], causal=causal, seqlen_q=seqlen_q)[0, 0]
    return "\n".join("".join("#" if x else "." for x in row) for row in dense.tolist())


def from_dense_mask(mask: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """FlashMask indices equal to a dense boolean mask (``docs/flashmask.md`` section 1).

    Args:
        mask: bool ``[B, H, Sq, Sk]`` (or ``[Sq, Sk]``), True = attend.
        causal: produce indices for ``causal=True`` (everything above the bottom-right diagonal must be masked)
            or ``causal=False``.

    Returns:
        int32 ``[B, H, Sk, n]`` with the smallest ``n`` that represents every column
        (causal: 1 or 2; non-causal: 2 or 4), such that ``to_dense_mask(result, causal=causal, seqlen_q=Sq)``
        equals ``mask``.

    Raises:
        MaskNotRepresentableError: a column has more masked row runs than the form allows (naming the first such
            batch, head and column), or ``causal=True`` but a key above the diagonal is attended.
    """
    if mask.dim() == 2:
        mask = mask[None, None]
    if mask.dim() != 4 or mask.dtype != torch.bool:
        raise AttentionInputError(
            f"mask must be bool [batch, heads, seqlen_q, seqlen_k], got dtype {mask.dtype} shape {tuple(mask.shape)}")
    b, h, sq, sk = mask.shape
    dev = mask.device
    rows = torch.arange(sq, device=dev).view(1, 1, sq, 1)
    masked = ~mask
    if causal:
        above = torch.arange(sk, device=dev).view(1, 1, 1, sk) > rows + (sk - sq)
        bad = above & mask
        if bool(bad.any()):
            bi, hi, ri, ci = (int(x) for x in bad.nonzero()[0])
            raise MaskNotRepresentableError(
                f"mask is not representable with causal=True: row {ri} attends key {ci} above the (bottom-right) "
                f"diagonal (batch {bi}, head {hi}); use causal=False")
        masked = masked & ~above
    prev = torch.nn.functional.pad(masked, (0, 0, 1, 0))[:, :, :sq]
    starts = masked & ~prev
    runs = starts.sum(2)  # [B, H, Sk]
    limit = 1 if causal else 2
    if bool((runs > limit).any()):
        bi, hi, ci = (int(x) for x in (runs > limit).nonzero()[0])
        raise MaskNotRepresentableError(
            f"mask is not representable as FlashMask indices with causal={causal}: key column {ci} (batch {bi}, "
            f"head {hi}) has {int(runs[bi, hi, ci])} masked row runs, at most {limit} allowed")
    run_id = torch.cumsum(starts.to(torch.int32), dim=2)  # 1-based run number of each masked row
    big = sq + 1

    def run_bounds(k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inrun = masked & (run_id == k)
        present = inrun.any(2)
        start = torch.where(inrun, rows, big).amin(2)
        end = torch.where(inrun, rows + 1, -1).amax(2)
        return present, start, end

    p1, s1, e1 = run_bounds(1)
    full = torch.full_like(s1, sq)
    zero = torch.zeros_like(s1)
    if causal:
        lts = torch.where(p1, s1, full)
        lte = torch.where(p1, e1, full)
        if bool((lte == sq).all()):
            return lts.unsqueeze(-1).to(torch.int32)
        return torch.stack([lts, lte], -1).to(torch.int32)
    p2, s2, e2 = run_bounds(2)
    # n=2 form [LTS, UTE]: an optional run touching row 0 (upper) and an optional run reaching row Sq (lower).
    one_top = p1 & ~p2 & (s1 == 0)
    one_bottom = p1 & ~p2 & (e1 == sq) & ~one_top
    two_ok = p2 & (s1 == 0) & (e2 == sq)
    n2_ok = ~p1 | one_top | one_bottom | two_ok
    if bool(n2_ok.all()):
        lts = torch.where(one_bottom, s1, torch.where(two_ok, s2, full))
        lts = torch.where(one_top & (e1 == sq), zero, lts)
        ute = torch.where(one_top, e1, torch.where(two_ok, e1, zero))
        return torch.stack([lts, ute], -1).to(torch.int32)
    # n=4: UT = first run, LT = second run; a lone run goes into LT.
    lts = torch.where(p2, s2, torch.where(p1, s1, full))
    lte = torch.where(p2, e2, torch.where(p1, e1, full))
    uts = torch.where(p2, s1, zero)
    ute = torch.where(p2, e1, zero)
    return torch.stack([lts, lte, uts, ute], -1).to(torch.int32)


def window_to_indices(window_size: int | tuple[int, int], *, causal: bool, batch_size: int, seqlen_q: int,
                      seqlen_k: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Paddle's conversion of ``window_size`` into indices (``docs/flashmask.md`` section 2): query ``i`` sees keys
    ``[i - left, i + right]`` (``right`` ignored when causal). Returns int32 ``[batch_size, 1, Sk, 1 or 2]``."""
    if isinstance(window_size, int):
        left, right = window_size, window_size
    else:
        if len(window_size) != 2:
            raise AttentionInputError(f"window_size must be an int or (left, right), got {window_size!r}")
        left, right = int(window_size[0]), int(window_size[1])
    if left < 0 or right < 0:
        raise AttentionInputError(f"window_size must be non-negative, got {window_size!r}")
    j = torch.arange(seqlen_k, device=device)
    lts = torch.clamp(j + left + 1, 0, seqlen_q)
    if causal:
        idx = lts.view(1, 1, -1, 1)
    else:
        ute = torch.clamp(j - right, 0, seqlen_q)
        idx = torch.stack([lts, ute], -1).view(1, 1, -1, 2)
    return idx.to(torch.int32).expand(batch_size, 1, seqlen_k, idx.shape[-1]).contiguous()


# ----------------------------------------------------------------------------------------------------------
# FlexAttention conversions
# ----------------------------------------------------------------------------------------------------------

def _head_map(hm: int, num_heads: int | None) -> int:
    if hm == 1:
        return 0
    if num_heads is None or num_heads % hm:
        raise AttentionInputError(
            f"num_heads must be a multiple of the mask heads {hm} when mask heads > 1, got {num_heads}")
    return num_heads // hm


def to_mask_mod(startend_row_indices: torch.Tensor, *, causal: bool, seqlen_q: int | None = None,
                num_heads: int | None = None) -> Callable:
    """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = attend) equal to the FlashMask mask.

    ``num_heads`` (query heads) is needed when the mask has more than one head; head ``h`` then uses mask head
    ``h // (num_heads / Hm)``.
    """
    sk = startend_row_indices.shape[2]
    sq = sk if seqlen_q is None else seqlen_q
    canon = canonicalize(startend_row_indices, causal=causal, seqlen_q=sq)
    lts, lte, uts, ute = (canon[..., k].contiguous() for k in range(4))
    hm = canon.shape[1]
    group = _head_map(hm, num_heads)
    off = sk - sq

    def mask_mod(b, h, q_idx, kv_idx):
        mh = h // group if hm > 1 else 0
        lt = (q_idx >= lts[b, mh, kv_idx]) & (q_idx < lte[b, mh, kv_idx])
        ut = (q_idx >= uts[b, mh, kv_idx]) & (q_idx < ute[b, mh, kv_idx])
        keep = ~(lt | ut)
        if causal:
            keep = keep & (kv_idx <= q_idx + off)
        return keep

    return mask_mod


def to_flex_block_mask(startend_row_indices: torch.Tensor, *, causal: bool, seqlen_q: int | None = None,
                       num_heads: int | None = None, block_size: int = 128):
    """A FlexAttention ``BlockMask`` built from per-block min/max of the indices, without evaluating the mask on
    all ``Sq * Sk`` points (cost ``O(B * Hm * (Sk + Tr * Tc))``).

    Tiles are classified as in :func:`classify_tiles` with ragged tail blocks partial (FlexAttention's rule);
    the ``mask_mod`` of :func:`to_mask_mod` is attached for the partial tiles. With ``Hm > 1`` the result has
    ``num_heads`` heads (mask heads repeated for their query-head group).

    Returns:
        ``torch.nn.attention.flex_attention.BlockMask`` with ``BLOCK_SIZE = (block_size, block_size)``.
    """
    from torch.nn.attention.flex_attention import BlockMask

    sk = startend_row_indices.shape[2]
    sq = sk if seqlen_q is None else seqlen_q
    canon = canonicalize(startend_row_indices, causal=causal, seqlen_q=sq)
    cls = classify_tiles(canon, causal=causal, seqlen_q=sq, block_m=block_size, block_n=block_size,
                         ragged_partial=True)
    hm = canon.shape[1]
    if hm > 1:
        cls = cls.repeat_interleave(_head_map(hm, num_heads), dim=1)

    def lists(kind: int) -> tuple[torch.Tensor, torch.Tensor]:
        sel = cls == kind
        num = sel.sum(-1).to(torch.int32)
        order = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return num, order

    kv_num, kv_idx = lists(TILE_PARTIAL)
    full_num, full_idx = lists(TILE_FULL)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size,
                                    mask_mod=to_mask_mod(startend_row_indices, causal=causal, seqlen_q=sq,
                                                         num_heads=num_heads),
                                    seq_lengths=(sq, sk))


# ----------------------------------------------------------------------------------------------------------
# constructors
# ----------------------------------------------------------------------------------------------------------

def _finish(cols: list[torch.Tensor], batch_size: int) -> torch.Tensor:
    """Stack per-batch ``[Sk, n]`` columns into int32 ``[B, 1, Sk, n]``."""
    if len(cols) == 1 and batch_size > 1:
        cols = cols * batch_size
    return torch.stack(cols).unsqueeze(1).to(torch.int32).contiguous()


def _docs_per_batch(doc_lens, batch_size: int | None, per_row: bool | None = None) -> list[list]:
    """One entry of ``doc_lens`` per batch row: a list of per-row lists as given, or one flat description
    repeated ``batch_size`` times (default 1). ``per_row``: whether ``doc_lens`` is per row (default: its first
    element is a list or tuple).

    Raises:
        AttentionInputError: ``batch_size`` given and different from the number of per-row lists.
    """
    if per_row is None:
        per_row = bool(len(doc_lens)) and isinstance(doc_lens[0], (list, tuple))
    if not per_row:
        return [list(doc_lens)] * (1 if batch_size is None else int(batch_size))
    per = [list(d) for d in doc_lens]
    if batch_size is not None and len(per) != batch_size:
        raise AttentionInputError(f"doc_lens has {len(per)} batch rows (one list per row), batch_size is "
                                  f"{batch_size}: pass one list per row or batch_size={len(per)}")
    return per


def _doc_ids(lens: Sequence[int], seqlen: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(doc start, doc end, doc index) of every token; a tail beyond sum(lens) becomes its own document."""
    lens = [int(x) for x in lens]
    if any(x <= 0 for x in lens):
        raise AttentionInputError(f"document lengths must be positive, got {lens}")
    total = sum(lens)
    s = total if seqlen is None else seqlen
    if total > s:
        raise AttentionInputError(f"document lengths sum to {total} > seqlen {s}")
    if total < s:
        lens = lens + [s - total]
    ln = torch.tensor(lens)
    ends = torch.cumsum(ln, 0)
    starts = ends - ln
    doc = torch.repeat_interleave(torch.arange(len(lens)), ln)
    return starts[doc], ends[doc], doc, s


def causal_mask(seqlen: int, *, batch_size: int = 1) -> torch.Tensor:
    """Plain causal attention as indices (same as ``startend_row_indices=None, causal=True``). Use with
    ``causal=True``; ``LTS[j] = Sq``::

        #.....
        ##....
        ###...
        ####..
        #####.
        ######
    """
    return _finish([torch.full((seqlen, 1), seqlen)], batch_size)


def sliding_window_mask(seqlen: int, window: int, *, batch_size: int = 1) -> torch.Tensor:
    """Causal sliding window: query ``i`` sees keys ``[i - window, i]``. Use with ``causal=True``;
    ``LTS[j] = min(j + window + 1, Sq)``. ``window=2``::

        #.....
        ##....
        ###...
        .###..
        ..###.
        ...###
    """
    j = torch.arange(seqlen)
    return _finish([torch.clamp(j + window + 1, max=seqlen).view(-1, 1)], batch_size)


def bidirectional_sliding_window_mask(seqlen: int, left: int, right: int, *, batch_size: int = 1) -> torch.Tensor:
    """Bidirectional sliding window: query ``i`` sees keys ``[i - left, i + right]``. Use with ``causal=False``;
    ``LTS[j] = min(j + left + 1, Sq)``, ``UTE[j] = max(j - right, 0)``. ``left=2, right=1``::

        ##....
        ###...
        ####..
        .####.
        ..####
        ...###
    """
    j = torch.arange(seqlen)
    return _finish([torch.stack([torch.clamp(j + left + 1, max=seqlen), torch.clamp(j - right, min=0)], -1)],
                   batch_size)


def causal_document_mask(doc_lens, *, seqlen: int | None = None, batch_size: int | None = None) -> torch.Tensor:
    """Causal attention within each packed document (SFT sequence packing). Use with ``causal=True``;
    ``LTS[j] = end of doc(j)``.

    Args:
        doc_lens: document lengths, or one list per batch row; a tail up to ``seqlen`` is its own document.

    Documents ``[2, 3, 1]``::

        #.....
        ##....
        ..#...
        ..##..
        ..###.
        .....#
    """
    cols = []
    for lens in _docs_per_batch(doc_lens, batch_size):
        _, ends, _, _ = _doc_ids(lens, seqlen)
        cols.append(ends.view(-1, 1))
    return _finish(cols, len(cols))


def causal_document_mask_from_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """:func:`causal_document_mask` from per-token document ids instead of lengths (packed batches carry ids).

    Args:
        document_ids: integer ``[B, S]``, equal ids in contiguous runs (one run per document).

    Returns:
        int32 ``[B, 1, S, 1]``: for every key column ``j`` the end (exclusive) of ``j``'s document. Use with
        ``causal=True``.

    Raises:
        AttentionInputError: ``document_ids`` is not 2-D.
    """
    if document_ids.dim() != 2:
        raise AttentionInputError(f"document_ids must be [batch, seqlen], got shape {tuple(document_ids.shape)}")
    b, s = document_ids.shape
    pos = torch.arange(s, device=document_ids.device).expand(b, s)
    last = torch.ones_like(document_ids, dtype=torch.bool)
    last[:, :-1] = document_ids[:, 1:] != document_ids[:, :-1]
    # end[j] = (index of the last token of j's document) + 1 = suffix minimum over the per-token candidates
    cand = torch.where(last, pos + 1, torch.full_like(pos, s))
    end = torch.flip(torch.cummin(torch.flip(cand, [1]), dim=1).values, [1])
    return end.to(torch.int32).view(b, 1, s, 1)


def document_mask(doc_lens, *, seqlen: int | None = None, batch_size: int | None = None) -> torch.Tensor:
    """Bidirectional attention within each packed document (NaViT/BERT packing). Use with ``causal=False``;
    ``LTS[j] = end of doc(j)``, ``UTE[j] = start of doc(j)``. Documents ``[2, 3, 1]``::

        ##....
        ##....
        ..###.
        ..###.
        ..###.
        .....#
    """
    cols = []
    for lens in _docs_per_batch(doc_lens, batch_size):
        starts, ends, _, _ = _doc_ids(lens, seqlen)
        cols.append(torch.stack([ends, starts], -1))
    return _finish(cols, len(cols))


def shared_question_mask(docs, *, seqlen: int | None = None, batch_size: int | None = None) -> torch.Tensor:
    """Shared question (reward model / DPO): each document is a question followed by answers; every answer sees
    the question and itself, causally, never another answer. Use with ``causal=True``; question columns:
    ``LTS = end of document``, answer columns: ``LTS = end of the answer``.

    Args:
        docs: ``[(question_len, [answer_len, ...]), ...]`` (or one such list per batch row); a tail up to
            ``seqlen`` is its own document.

    ``[(2, [2, 2])]``::

        #.....
        ##....
        ###...
        ####..
        ##..#.
        ##..##
    """
    per = _docs_per_batch(docs, batch_size, per_row=bool(len(docs)) and isinstance(docs[0], list))
    cols = []
    for row in per:
        lts, pos = [], 0
        for q, answers in row:
            end = pos + q + sum(answers)
            lts += [end] * q
            a0 = pos + q
            for a in answers:
                lts += [a0 + a] * a
                a0 += a
            pos = end
        s = pos if seqlen is None else seqlen
        if pos > s:
            raise AttentionInputError(f"shared-question documents have {pos} tokens > seqlen {s}")
        lts += [s] * (s - pos)
        cols.append(torch.tensor(lts).view(-1, 1))
    return _finish(cols, len(cols))


def global_sliding_window_mask(seqlen: int, num_global: int, left: int, right: int, *,
                               batch_size: int = 1) -> torch.Tensor:
    """Global tokens + bidirectional sliding window (Longformer/BigBird style): the first ``num_global`` tokens see
    and are seen by everything; the rest see keys ``[i - left, i + right]``. Use with ``causal=False`` (n=4):
    ``LTS[j] = Sq if j < G else min(j + left + 1, Sq)``, ``LTE = Sq``, ``UTS = G`` and ``UTE = j - right`` for
    ``j > G + right`` (else empty). ``G=1, left=right=1``::

        ######
        ###...
        ####..
        #.###.
        #..###
        #...##
    """
    j = torch.arange(seqlen)
    g = num_global
    lts = torch.where(j < g, torch.full_like(j, seqlen), torch.clamp(j + left + 1, max=seqlen))
    lte = torch.full_like(j, seqlen)
    far = j > g + right
    uts = torch.where(far, torch.full_like(j, g), torch.zeros_like(j))
    ute = torch.where(far, j - right, torch.zeros_like(j))
    return _finish([torch.stack([lts, lte, uts, ute], -1)], batch_size)


def prefix_lm_causal_mask(seqlen: int, prefix_len: int, *, batch_size: int = 1) -> torch.Tensor:
    """Prefix LM: the first ``prefix_len`` tokens attend bidirectionally, the rest causally. Use with
    ``causal=False``; ``LTS = Sq``, ``UTE[j] = 0 if j < prefix else j``. ``prefix_len=3``::

        ###...
        ###...
        ###...
        ####..
        #####.
        ######
    """
    j = torch.arange(seqlen)
    ute = torch.where(j < prefix_len, torch.zeros_like(j), j)
    return _finish([torch.stack([torch.full_like(j, seqlen), ute], -1)], batch_size)


def prefix_lm_document_mask(docs, *, seqlen: int | None = None, batch_size: int | None = None) -> torch.Tensor:
    """Prefix LM per packed document. Use with ``causal=False``; ``LTS[j] = end of doc(j)``, ``UTE[j] = start of
    doc k`` for ``j`` in the prefix of doc k, else ``j``.

    Args:
        docs: ``[(prefix_len, doc_len), ...]`` (or one list per batch row).

    ``[(2, 3), (1, 3)]``::

        ##....
        ##....
        ###...
        ...#..
        ...##.
        ...###
    """
    per = _docs_per_batch(docs, batch_size, per_row=bool(len(docs)) and isinstance(docs[0], list))
    cols = []
    for row in per:
        starts, ends, doc, s = _doc_ids([d for _, d in row], seqlen)
        prefix = torch.tensor([p for p, _ in row] + [0] * (int(doc.max()) + 1 - len(row)))
        j = torch.arange(s)
        in_prefix = (j - starts) < prefix[doc]
        ute = torch.where(in_prefix, starts, j)
        cols.append(torch.stack([ends, ute], -1))
    return _finish(cols, len(cols))


def qk_sparse_mask(seqlen: int, blocks: Sequence[tuple[int, int]], *, batch_size: int = 1) -> torch.Tensor:
    """QK-sparse: for each key block ``[o, o + L)`` the queries inside the block see only keys before it (the
    block's keys are dropped for those queries); later queries see it again. Use with ``causal=True`` (n=2):
    columns in a block ``LTS = j``, ``LTE = o + L``; others ``LTS = LTE = Sq``. ``blocks=[(2, 3)]``::

        #.....
        ##....
        ##....
        ##....
        ##....
        ######
    """
    j = torch.arange(seqlen)
    lts = torch.full_like(j, seqlen)
    lte = torch.full_like(j, seqlen)
    for o, ln in blocks:
        sel = (j >= o) & (j < o + ln)
        lts = torch.where(sel, j, lts)
        lte = torch.where(sel, torch.full_like(j, min(o + ln, seqlen)), lte)
    return _finish([torch.stack([lts, lte], -1)], batch_size)


def random_eviction_mask(seqlen: int, *, start_row: int | None = None, batch_size: int = 1, num_heads: int = 1,
                         generator: torch.Generator | None = None) -> torch.Tensor:
    """Random KV-cache eviction: from row ``start_row`` (default ``seqlen // 2``) on, each row ``t`` evicts one more
    random earlier key ``j < t - 1`` for good. Use with ``causal=True``; ``LTS[j_t] = t``, other keys ``Sq``.
    Different per (batch, head): returns int32 ``[batch_size, num_heads, seqlen, 1]``. Example (start 3)::

        #.....
        ##....
        ###...
        .###..
        .#.##.
        .#..##
    """
    r0 = seqlen // 2 if start_row is None else start_row
    out = torch.full((batch_size, num_heads, seqlen, 1), seqlen, dtype=torch.int32)
    for b in range(batch_size):
        for h in range(num_heads):
            evicted = torch.zeros(seqlen, dtype=torch.bool)
            for t in range(max(r0, 2), seqlen):
                pick = -1
                for _ in range(16):  # rejection sampling: most earlier keys are still alive
                    j = int(torch.randint(t - 1, (1,), generator=generator))
                    if not evicted[j]:
                        pick = j
                        break
                if pick < 0:
                    cand = (~evicted[: t - 1]).nonzero().flatten()
                    if cand.numel() == 0:
                        continue
                    pick = int(cand[int(torch.randint(cand.numel(), (1,), generator=generator))])
                evicted[pick] = True
                out[b, h, pick, 0] = t
    return out


def causal_blockwise_mask(doc_lens, *, seqlen: int | None = None, batch_size: int | None = None) -> torch.Tensor:
    """Causal blockwise (in-context learning): each demonstration block sees only itself (causally), the last
    block sees everything before it. Use with ``causal=True`` (n=2): non-last docs ``LTS = end of doc(j)``,
    ``LTE = start of the last doc``; last doc ``LTS = LTE = Sq``. Documents ``[2, 2, 2]``::

        #.....
        ##....
        ..#...
        ..##..
        #####.
        ######
    """
    cols = []
    for lens in _docs_per_batch(doc_lens, batch_size):
        starts, ends, doc, s = _doc_ids(lens, seqlen)
        last = doc == doc.max()
        last_start = int(starts[last][0])
        lts = torch.where(last, torch.full_like(ends, s), ends)
        lte = torch.where(last, torch.full_like(ends, s), torch.full_like(ends, last_start))
        cols.append(torch.stack([lts, lte], -1))
    return _finish(cols, len(cols))
