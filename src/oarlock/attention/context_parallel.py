"""Context parallelism for FlashMask: mask-aware load balancing and its execution (FlashMask V3 / MARCO).

With context parallelism every rank owns some query chunks of the sequence and attends them to all keys.
Under a sparse mask the chunks cost very different amounts (a late chunk of a causal mask sees more keys;
a chunk inside a short document sees few), so a contiguous split is unbalanced. The planner:

1. splits the query rows into ``chunk_size`` chunks and weighs each by its number of live (not fully masked)
   ``block_size x block_size`` tiles, summed over batch and mask heads, using the same min/max tile
   classification as the kernels (:func:`oarlock.attention.masks.classify_tiles`);
2. assigns chunks to ranks with LPT (longest processing time first) under a cardinality constraint: chunks in
   decreasing weight go to the currently lightest rank that still has room, so every rank gets exactly
   ``num_chunks / world_size`` chunks (equal activation memory) and near-equal work.

Planning is a pure function of the mask: no processes, no communication. Executing a plan:
:func:`shard_sequence` / :func:`local_positions` cut a rank's tokens (and RoPE positions) out of ``[B, S, ...]``
tensors, :func:`context_parallel_flashmask_attention` runs attention across the ranks (autograd included) and
:func:`gather_sequence` puts local outputs back in sequence order. See ``docs/flashmask.md``.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from oarlock.attention.errors import AttentionInputError
from oarlock.attention.flashmask import (expand_kv_for_mask_heads, flashmask_attention, kernel_backward,
                                         kernel_forward)
from oarlock.attention.masks import TILE_SKIP, canonicalize, classify_tiles

__all__ = ["ContextParallelPlan", "plan_context_parallel", "chunk_workloads", "dual_chunk_swap",
           "context_parallel_flashmask_attention", "local_positions", "shard_sequence", "gather_sequence", "local_mask",
           "CP_METHODS", "DEFAULT_CP_METHOD"]


@dataclass(frozen=True)
class ContextParallelPlan:
    """Which query chunks each rank owns.

    Attributes:
        chunk_size: tokens per chunk.
        seqlen: total query tokens.
        chunk_weights: live tiles per chunk (the work estimate).
        assignment: per rank, its chunk ids in increasing order (equal counts).
    """

    chunk_size: int
    seqlen: int
    chunk_weights: tuple[int, ...]
    assignment: tuple[tuple[int, ...], ...]

    @property
    def world_size(self) -> int:
        return len(self.assignment)

    @property
    def rank_work(self) -> tuple[int, ...]:
        """Live tiles per rank."""
        return tuple(sum(self.chunk_weights[c] for c in chunks) for chunks in self.assignment)

    @property
    def imbalance(self) -> float:
        """``max(rank work) / mean(rank work)`` (1.0 = perfect)."""
        work = self.rank_work
        mean = sum(work) / len(work)
        return max(work) / mean if mean else 1.0

    def token_permutation(self) -> torch.Tensor:
        """int64 ``[seqlen]``: original token positions in rank order (rank 0's chunks first, each rank's chunks
        in increasing order). ``x[:, perm]`` lays a ``[batch, seqlen, ...]`` tensor out so that rank ``r`` owns the
        ``r``-th equal slice."""
        parts = [torch.arange(c * self.chunk_size, min((c + 1) * self.chunk_size, self.seqlen))
                 for chunks in self.assignment for c in sorted(chunks)]
        return torch.cat(parts)

    def local_positions(self, rank: int) -> torch.Tensor:
        """Global positions owned by ``rank``, increasing (:func:`local_positions`)."""
        return local_positions(self, rank)

    def shard(self, x: torch.Tensor, rank: int, *, dim: int = 1) -> torch.Tensor:
        """Rank ``rank``'s tokens of a ``[B, S, ...]`` tensor (:func:`shard_sequence`)."""
        return shard_sequence(self, x, rank, dim=dim)

    def gather(self, local: torch.Tensor, *, group=None, dim: int = 1) -> torch.Tensor:
        """Every rank's local rows back in sequence order (:func:`gather_sequence`, collective)."""
        return gather_sequence(self, local, group=group, dim=dim)


def chunk_workloads(startend_row_indices: torch.Tensor | None, *, causal: bool, seqlen_q: int, seqlen_k: int,
                    chunk_size: int, block_size: int = 128) -> list[int]:
    """Live ``block_size`` tiles in each query chunk of ``chunk_size`` rows (summed over batch and mask heads).

    Raises:
        AttentionInputError: ``chunk_size`` is not a positive multiple of ``block_size``.
    """
    if chunk_size <= 0 or chunk_size % block_size:
        raise AttentionInputError(f"chunk_size must be a positive multiple of block_size={block_size}, "
                                  f"got {chunk_size}")
    if startend_row_indices is None:
        canon = torch.zeros(1, 1, seqlen_k, 4, dtype=torch.int64)
        canon[..., :2] = seqlen_q
    else:
        canon = canonicalize(startend_row_indices, causal=causal, seqlen_q=seqlen_q)
    cls = classify_tiles(canon, causal=causal, seqlen_q=seqlen_q, block_m=block_size, block_n=block_size)
    per_row_block = (cls != TILE_SKIP).sum((0, 1, 3))  # [Tr]
    per = chunk_size // block_size
    n_chunks = -(-seqlen_q // chunk_size)
    padded = torch.zeros(n_chunks * per, dtype=torch.int64)
    padded[:per_row_block.numel()] = per_row_block
    return padded.view(n_chunks, per).sum(1).tolist()


def plan_context_parallel(startend_row_indices: torch.Tensor | None, *, causal: bool, world_size: int,
                          chunk_size: int = 2048, block_size: int = 128, seqlen_q: int | None = None,
                          ) -> ContextParallelPlan:
    """Balance query chunks over ``world_size`` ranks by live-tile count (LPT with equal chunk counts).

    Args:
        startend_row_indices: int32 ``[B, Hm, Sk, n]`` FlashMask indices (None: no mask besides ``causal``,
            then ``seqlen_q`` is required).
        causal: the flag the indices are used with.
        world_size: number of context-parallel ranks.
        chunk_size: tokens per balance chunk (FlashMask V3 default 2048), a multiple of ``block_size``.
        seqlen_q: query length (default ``Sk``).

    Returns:
        :class:`ContextParallelPlan`.

    Raises:
        AttentionInputError: the number of chunks is not a multiple of ``world_size``, or bad sizes.
    """
    if startend_row_indices is None and seqlen_q is None:
        raise AttentionInputError("seqlen_q is required when startend_row_indices is None")
    sk = startend_row_indices.shape[2] if startend_row_indices is not None else seqlen_q
    sq = sk if seqlen_q is None else seqlen_q
    if world_size <= 0:
        raise AttentionInputError(f"world_size must be positive, got {world_size}")
    weights = chunk_workloads(startend_row_indices, causal=causal, seqlen_q=sq, seqlen_k=sk,
                              chunk_size=chunk_size, block_size=block_size)
    n = len(weights)
    if n % world_size:
        raise AttentionInputError(
            f"seqlen_q={sq} gives {n} chunks of chunk_size={chunk_size}, not a multiple of world_size={world_size}")
    per_rank = n // world_size
    heap = [(0, r) for r in range(world_size)]  # (work, rank) of ranks with room
    owned: list[list[int]] = [[] for _ in range(world_size)]
    for c in sorted(range(n), key=lambda c: (-weights[c], c)):
        work, r = heapq.heappop(heap)
        owned[r].append(c)
        if len(owned[r]) < per_rank:
            heapq.heappush(heap, (work + weights[c], r))
    return ContextParallelPlan(chunk_size, sq, tuple(weights), tuple(tuple(sorted(o)) for o in owned))


def dual_chunk_swap(seqlen: int, *, world_size: int, chunk_size: int | None = None,
                    weights: list[int] | None = None) -> ContextParallelPlan:
    """The mask-agnostic baseline (DualChunkSwap): ``2 * world_size`` chunks, rank ``r`` gets chunks ``r`` and
    ``2 * world_size - 1 - r`` (balances a plain causal mask only). ``weights`` (optional) fills
    ``chunk_weights`` for comparison."""
    n = 2 * world_size
    cs = chunk_size or -(-seqlen // n)
    w = tuple(weights) if weights is not None else tuple([0] * n)
    return ContextParallelPlan(cs, seqlen, w, tuple((r, n - 1 - r) for r in range(world_size)))


# ----------------------------------------------------------------------------------------------------------
# Executing a plan: sharding helpers and the context-parallel attention.

def _plan_rows(plan: ContextParallelPlan, rank: int) -> torch.Tensor:
    """Sorted global positions owned by ``rank`` (its chunks in increasing order)."""
    if not 0 <= rank < plan.world_size:
        raise AttentionInputError(f"rank {rank} is outside the plan's world_size={plan.world_size}")
    sizes = [sum(min(plan.chunk_size, plan.seqlen - c * plan.chunk_size) for c in chunks)
             for chunks in plan.assignment]
    if len(set(sizes)) != 1:
        raise AttentionInputError(f"plan gives ranks {sizes} tokens: context parallelism needs equal slices "
                                  f"(seqlen={plan.seqlen} must split into equal chunks per rank)")
    rows = torch.cat([torch.arange(c * plan.chunk_size, min((c + 1) * plan.chunk_size, plan.seqlen))
                      for c in sorted(plan.assignment[rank])])
    return rows


def local_positions(plan: ContextParallelPlan, rank: int) -> torch.Tensor:
    """int64 ``[seqlen / world_size]``: the global sequence positions rank ``rank`` owns, increasing (its slice of
    :meth:`ContextParallelPlan.token_permutation`). Use them as ``position_ids`` (RoPE) of the local tokens."""
    return _plan_rows(plan, rank)


def shard_sequence(plan: ContextParallelPlan, x: torch.Tensor, rank: int, *, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s tokens of a ``[B, S, ...]`` tensor (input ids, labels, position ids, hidden states):
    ``x`` indexed along ``dim`` (default 1) by :func:`local_positions`. Labels shifted for next-token prediction
    *before* sharding stay right (the shift is positional).

    Raises:
        AttentionInputError: ``x.shape[dim]`` is not the plan's ``seqlen``.
    """
    if x.shape[dim] != plan.seqlen:
        raise AttentionInputError(f"tensor to shard has {x.shape[dim]} positions along dim {dim}, the plan covers "
                                  f"seqlen={plan.seqlen}")
    return x.index_select(dim, local_positions(plan, rank).to(x.device))


def gather_sequence(plan: ContextParallelPlan, local: torch.Tensor, *, group=None, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_sequence` over ``group``: every rank passes its ``[B, S / W, ...]`` rows and gets
    the whole ``[B, S, ...]`` tensor in sequence order (collective; not differentiable)."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world != plan.world_size:
        raise AttentionInputError(f"the process group has {world} ranks, the plan {plan.world_size}")
    moved = local.movedim(dim, 0).contiguous()
    out = torch.empty((world * moved.shape[0],) + tuple(moved.shape[1:]), dtype=moved.dtype, device=moved.device)
    if world == 1:
        out.copy_(moved)
    else:
        _all_gather(out, moved, group)
    perm = torch.cat([local_positions(plan, r) for r in range(world)]).to(out.device)
    full = torch.empty_like(out)
    full[perm] = out
    return full.movedim(0, dim)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """Concatenate every rank's ``inp`` along dim 0 into ``out`` (all_gather_single on torch >= 2.13)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def _gather_kv(k: torch.Tensor, v: torch.Tensor, group, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather the local ``[B, S/W, Hk, D]`` keys and values in one collective; returns ``[B, S, Hk, D]`` in
    rank order (the plan's token permutation)."""
    b, s, hk, d = k.shape
    dv = v.shape[3]
    flat = torch.cat([k.transpose(0, 1).reshape(s, -1), v.transpose(0, 1).reshape(s, -1)], 1).contiguous()
    out = torch.empty(world * s, flat.shape[1], dtype=flat.dtype, device=flat.device)
    _all_gather(out, flat, group)
    kk = out[:, :b * hk * d].view(world * s, b, hk, d).transpose(0, 1)
    vv = out[:, b * hk * d:].view(world * s, b, hk, dv).transpose(0, 1)
    return kk, vv


def _reduce_scatter_kv(dk: torch.Tensor, dv: torch.Tensor, group, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the full-sequence ``dK``/``dV`` ``[B, S, Hk, D]`` of every rank and give each rank its own slice (in
    fp32, one collective)."""
    b, s, hk, d = dk.shape
    dvd = dv.shape[3]
    flat = torch.cat([dk.float().transpose(0, 1).reshape(s, -1), dv.float().transpose(0, 1).reshape(s, -1)], 1)
    out = torch.empty(s // world, flat.shape[1], dtype=flat.dtype, device=flat.device)
    # torch >= 2.13 names it reduce_scatter_single (reduce_scatter_tensor is deprecated there)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(out, flat.contiguous(), group=group)
    n = s // world
    gk = out[:, :b * hk * d].reshape(n, b, hk, d).transpose(0, 1).to(dk.dtype).contiguous()
    gv = out[:, b * hk * d:].reshape(n, b, hk, dvd).transpose(0, 1).to(dv.dtype).contiguous()
    return gk, gv


class _ContextParallelAttention(torch.autograd.Function):
    """Forward: all-gather K/V (rank order), one kernel call of the local rows against every key with the mask
    re-indexed to local rows (tiles the mask kills are skipped as usual). Backward: gather K/V again (not kept
    between passes: activation memory stays O(S / W) per layer), the kernel backward gives dQ for the local rows
    and dK/dV for every key, reduce-scattered onto the ranks owning those keys. Autograd never sees the
    collectives, so they run in the same order on every rank."""

    @staticmethod
    def forward(ctx, q, k, v, canon, group, world, scale, dropout, seed):  # type: ignore[override]
        kk, vv = _gather_kv(k, v, group, world)
        out, lse = kernel_forward(q, kk, vv, canon, causal=False, scale=scale, dropout=dropout, seed=seed)
        ctx.save_for_backward(q, k, v, out, lse, canon, seed)
        ctx.group, ctx.world, ctx.scale, ctx.dropout = group, world, scale, dropout
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):  # type: ignore[override]
        q, k, v, out, lse, canon, seed = ctx.saved_tensors
        kk, vv = _gather_kv(k, v, ctx.group, ctx.world)
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk_all, dv_all = kernel_backward(grad_out, grad_lse, q, kk, vv, out, lse, canon, causal=False,
                                             scale=ctx.scale, dropout=ctx.dropout, seed=seed)
        dk, dv = _reduce_scatter_kv(dk_all, dv_all, ctx.group, ctx.world)
        return dq, dk, dv, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------------------
# The ring variant: K/V blocks travel round the ranks while each rank computes on the block it holds.

#: Key tile edge used to decide that a peer's K/V block is dead for this rank's rows (both kernels tile keys by
#: 64; a block is skipped only when every 64 x 64 tile of it is, so the kernel would have done nothing).
_RING_TILE = 64
_TAG_KV, _TAG_GRAD = 7, 8  # gloo matches messages per tag; NCCL ignores tags (every rank posts the same order)

#: The ``method`` values of :func:`context_parallel_flashmask_attention`: ``"allgather"`` (every rank gathers all
#: keys and values) or ``"ring"`` (K/V blocks passed around the ranks, dead blocks skipped).
CP_METHODS = ("allgather", "ring")
#: ``method`` of :func:`context_parallel_flashmask_attention` when none is given (and of the models' ``cp``
#: degree): the ring, measured faster and never holding all ``S`` keys (docs/flashmask.md, "Context parallelism").
DEFAULT_CP_METHOD = "ring"


def _ring_exchange(send: torch.Tensor, recv: torch.Tensor, group, rank: int, world: int, tag: int) -> list:
    """Post ``send`` to the next rank and ``recv`` from the previous one (one batched pair, so NCCL cannot
    deadlock on the ring's cycle); returns the requests to wait on."""
    ops = [dist.P2POp(dist.isend, send, group=group, group_peer=(rank + 1) % world, tag=tag),
           dist.P2POp(dist.irecv, recv, group=group, group_peer=(rank - 1) % world, tag=tag)]
    return dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _pack(tensors, dtype=None) -> torch.Tensor:
    """One flat contiguous buffer (one message per hop instead of two)."""
    return torch.cat([t.reshape(-1).to(dtype or t.dtype) for t in tensors])


def _unpack(flat: torch.Tensor, shapes) -> list[torch.Tensor]:
    out, off = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[off:off + n].view(shape))
        off += n
    return out


def _ring_blocks(canon: torch.Tensor, world: int) -> tuple[list[torch.Tensor], list[bool]]:
    """The local mask cut into the ``world`` key blocks (block ``j`` = rank ``j``'s keys) and, per block, whether
    any tile of it is live for this rank's rows (the kernels' tile classification on the re-indexed mask)."""
    n = canon.shape[2] // world  # keys per block = local rows (equal slices, Sq = Sk)
    blocks, live = [], []
    for j in range(world):
        c = canon[:, :, j * n:(j + 1) * n].contiguous()
        blocks.append(c)
        cls = classify_tiles(c, causal=False, seqlen_q=n, block_m=_RING_TILE, block_n=_RING_TILE)
        live.append(bool((cls != TILE_SKIP).any()))
    return blocks, live


def _merge_partial(out, lse, o, l):
    """Log-sum-exp combination of two normalised partial attentions over disjoint key sets (fp32 ``out``
    ``[B, Sq, H, Dv]``, ``lse`` ``[B, H, Sq]``): ``lse = logaddexp(lse, l)``, ``out = out e^(lse_old - lse) +
    o e^(l - lse)``. Rows no key has reached yet keep ``lse = -inf`` and output 0 (no ``-inf - -inf``)."""
    o = o.float()
    if out is None:
        return o, l
    new = torch.logaddexp(lse, l)
    ref = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    w_old = torch.exp(lse - ref).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(l - ref).transpose(1, 2).unsqueeze(-1)
    return out * w_old + o * w_new, new


def _leave_out_poisoned_rows(q, grad_out, out, lse, grad_lse):
    """Rows that saw a non-finite key or value (finite query, NaN ``lse``) carry NaN ``out``/``lse``. A single
    kernel call over all keys leaves them out of its backward (dQ NaN, nothing into dK/dV); each ring block's
    call only knows about its own keys, so without this the blocks where such a row sees finite keys would spread
    its NaN into their dK/dV. Zeroing its ``grad_out`` and ``out`` and setting ``lse = -inf`` gives it weight 0
    in every block; the block holding the non-finite key still marks its dQ NaN, as the single call does."""
    poisoned = torch.isnan(lse) & torch.isfinite(q).all(-1).transpose(1, 2)  # [B, H, Sq]
    if not bool(poisoned.any()):
        return grad_out, out, lse, grad_lse
    rows = poisoned.transpose(1, 2).unsqueeze(-1)  # [B, Sq, H, 1]
    grad_out = grad_out.masked_fill(rows, 0.0)
    out = out.masked_fill(rows, 0.0)
    lse = lse.masked_fill(poisoned, float("-inf"))
    if grad_lse is not None:
        grad_lse = grad_lse.masked_fill(poisoned, 0.0)
    return grad_out, out, lse, grad_lse


class _RingContextParallelAttention(torch.autograd.Function):
    """Ring attention over the plan's rank order (Liu et al., "Ring Attention with Blockwise Transformers",
    arXiv 2310.01889; docs/flashmask.md, "Context parallelism"). Forward, ``W`` steps: at step ``i`` rank ``r``
    holds the K/V block of rank ``r - i``, posts its transfer to rank ``r + 1`` (and the receive of the next
    block), runs the kernel of its rows against the held block unless the mask kills every tile of it, merges
    the partial result by log-sum-exp, then waits for the transfer. Backward: the same ring with the final
    ``out``/``lse`` (so each block's kernel backward gives that block's exact share of dQ, dK, dV); dQ adds up
    locally, and an fp32 dK/dV accumulator follows each K/V block one step behind, arriving at the block's
    owner after a full cycle. Nothing of size ``S`` is held: two K/V blocks and two accumulators at a time."""

    @staticmethod
    def forward(ctx, q, k, v, canon, group, world, scale, dropout, seed):  # type: ignore[override]
        rank = dist.get_rank(group)
        blocks, live = _ring_blocks(canon, world)
        shapes = (k.shape, v.shape)
        cur = _pack((k, v))
        out = lse = None
        for i in range(world):
            src = (rank - i) % world
            works, nxt = [], None
            if i < world - 1:  # dead blocks are still forwarded: the next rank may need them
                nxt = torch.empty_like(cur)
                works = _ring_exchange(cur, nxt, group, rank, world, _TAG_KV)
            if live[src]:
                kb, vb = _unpack(cur, shapes)
                o, l = kernel_forward(q, kb, vb, blocks[src], causal=False, scale=scale, dropout=dropout,
                                      seed=seed + src)
                out, lse = _merge_partial(out, lse, o, l)
            _wait(works)
            cur = nxt
        b, sq, h, _ = q.shape
        if out is None:  # every key is masked for every local row
            out = q.new_zeros(b, sq, h, v.shape[3], dtype=torch.float32)
            lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, canon, seed)
        ctx.group, ctx.world, ctx.scale, ctx.dropout, ctx.live = group, world, scale, dropout, live
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):  # type: ignore[override]
        q, k, v, out, lse, canon, seed = ctx.saved_tensors
        group, world, live = ctx.group, ctx.world, ctx.live
        rank = dist.get_rank(group)
        blocks, _ = _ring_blocks(canon, world)
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        grad_out, out, lse, grad_lse = _leave_out_poisoned_rows(q, grad_out, out, lse, grad_lse)
        shapes = (k.shape, v.shape)
        cur = _pack((k, v))
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        acc = acc_in = None
        acc_works: list = []
        for i in range(world):
            src = (rank - i) % world
            works, nxt = [], None
            if i < world - 1:
                nxt = torch.empty_like(cur)
                works = _ring_exchange(cur, nxt, group, rank, world, _TAG_KV)
            contrib = None
            if live[src]:
                kb, vb = _unpack(cur, shapes)
                dqi, dki, dvi = kernel_backward(grad_out, grad_lse, q, kb, vb, out, lse, blocks[src], causal=False,
                                                scale=ctx.scale, dropout=ctx.dropout, seed=seed + src)
                dq += dqi
                contrib = _pack((dki, dvi), torch.float32)
            if i == 0:
                acc = contrib if contrib is not None else \
                    torch.zeros(k.numel() + v.numel(), dtype=torch.float32, device=k.device)
            else:  # block src's accumulator, sent by the previous rank at the end of its step i - 1
                _wait(acc_works)
                acc = acc_in if contrib is None else acc_in.add_(contrib)
            acc_in = torch.empty_like(acc)
            # at the last step this hop takes every block's accumulator home: rank r receives its own block's
            acc_works = _ring_exchange(acc, acc_in, group, rank, world, _TAG_GRAD)
            _wait(works)
            cur = nxt
        _wait(acc_works)
        dk, dv = _unpack(acc_in, shapes)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None)


def local_mask(plan: ContextParallelPlan, startend_row_indices: torch.Tensor | None, rank: int, *, causal: bool,
               batch_size: int = 1) -> torch.Tensor:
    """The canonical (int64 ``[B, Hm, S, 4]``, non-causal form) mask of rank ``rank``'s rows against every key
    in rank order (the plan's token permutation): the global indices with the causal constraint folded into the
    upper interval (``UT = [0, j)``, causal masks never use it), columns permuted, and every row bound mapped
    to a local row (``#`` owned rows below it), which keeps intervals intervals because a rank's rows increase."""
    s = plan.seqlen
    if startend_row_indices is None:
        canon = torch.zeros(batch_size, 1, s, 4, dtype=torch.int64)
        canon[..., :2] = s
    else:
        canon = canonicalize(startend_row_indices, causal=causal, seqlen_q=s)
    if causal:
        canon = canon.clone()
        canon[..., 2] = 0
        canon[..., 3] = torch.arange(s, device=canon.device)
    perm = plan.token_permutation().to(canon.device)
    rows = local_positions(plan, rank).to(canon.device)
    return torch.searchsorted(rows, canon[:, :, perm].contiguous())


def context_parallel_flashmask_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                         startend_row_indices: torch.Tensor | None, *, plan: ContextParallelPlan,
                                         group=None, causal: bool = False, softmax_scale: float | None = None,
                                         dropout: float = 0.0, return_softmax_lse: bool = False,
                                         method: str = DEFAULT_CP_METHOD):
    """FlashMask attention with the sequence split over the ranks of ``group`` (context parallelism).

    Rank ``r`` owns the ``r``-th equal slice of ``plan.token_permutation()`` (:func:`shard_sequence` cuts it
    out of a ``[B, S, ...]`` tensor; :func:`local_positions` gives its RoPE positions). The local rows attend
    every key with the mask re-indexed to them (:func:`local_mask`), so fully masked tiles are skipped as in
    :func:`~oarlock.attention.flashmask_attention`; the backward returns dQ for the local rows and dK/dV summed
    onto the ranks that own those keys. Two ways to move K/V (``method``):

    * ``"ring"`` (default): ``W`` steps; at each the rank computes against the K/V block it holds while that
      block moves on to the next rank (``batch_isend_irecv``), partial results merge by log-sum-exp; blocks whose
      tiles the mask kills entirely cost no kernel call. Backward: the same ring, fp32 dK/dV accumulators
      travelling with their blocks. Holds two ``S / W`` blocks at a time; costs ``W`` kernel calls per pass and
      one more hop of gradients.
    * ``"allgather"``: one all-gather of K/V per pass, one kernel call against all ``S`` keys, dK/dV
      reduce-scattered in fp32. Holds ``S`` keys (and their fp32 gradients in the backward) at once.

    The ring is the default because it gives the same results for every input the all-gather takes (the same
    tests run both) and was measured faster: 0.77x-1.00x the all-gather's forward+backward time on 4 gloo
    ranks at S = 8k-16k (``benchmarks/context_parallel.py --methods-only``, benchmarks/RESULTS.md), with half
    the K/V communication buffers. Neither has been timed on NCCL yet; on a fast GPU link with very sparse masks
    the all-gather's single kernel call may win (docs/flashmask.md, "Context parallelism").

    Works with GQA, masks per KV head or per query head, causal 1/2-vector and non-causal 2/4-vector indices;
    rows that see no key give exactly 0 (no NaN). Algorithm: FlashMask V3 context parallelism, the ring after
    Ring Attention (arXiv 2310.01889); docs/flashmask.md, "Context parallelism".

    Args:
        query: this rank's rows ``[B, S / W, H, D]`` (float32/float16/bfloat16; CPU or CUDA).
        key, value: this rank's rows ``[B, S / W, Hk, D]`` / ``[B, S / W, Hk, Dv]``.
        startend_row_indices: the **global** int32 mask ``[B, Hm, S, n]`` in sequence order, the same on every
            rank (None: no mask besides ``causal``).
        plan: a :class:`ContextParallelPlan` with ``world_size == W`` (:func:`plan_context_parallel`).
        group: the context-parallel process group (default: the world).
        causal: as in ``flashmask_attention`` (``Sq == Sk``).
        softmax_scale: default ``1 / sqrt(D)``.
        dropout: CPU only (the masks differ from a single-process run).
        return_softmax_lse: also return this rank's float32 ``[B, H, S / W]`` log-sum-exp (differentiable).
        method: ``"ring"`` (default, :data:`DEFAULT_CP_METHOD`) or ``"allgather"`` (same results up to float32
            rounding; with float16/bfloat16 inputs the ring merges partial outputs rounded to the input dtype;
            with dropout the two draw different masks). A group of one rank runs ``flashmask_attention``
            either way.

    Returns:
        ``out`` ``[B, S / W, H, Dv]`` for this rank's rows (and ``lse`` when asked).

    Raises:
        AttentionInputError: shapes that do not match the plan or the group, naming both; an unknown
            ``method``.
    """
    if method not in CP_METHODS:
        raise AttentionInputError(f"method must be one of {CP_METHODS}, got {method!r}")
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    if plan.world_size != world:
        raise AttentionInputError(f"plan is for world_size={plan.world_size}, the process group has {world} ranks")
    s = plan.seqlen
    n_local = local_positions(plan, rank).numel()
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[1] != n_local:
            raise AttentionInputError(f"{name} must be this rank's rows [batch, seqlen/world={n_local}, heads, "
                                      f"head_dim], got shape {tuple(getattr(t, 'shape', ()))}")
    b, _, h, d = query.shape
    hk = key.shape[2]
    if startend_row_indices is not None:
        idx = startend_row_indices
        allowed = (1, 2) if causal else (2, 4)
        heads = tuple(sorted({1, hk, h}))
        if idx.dim() != 4 or idx.shape[0] != b or idx.shape[1] not in heads or idx.shape[2] != s \
                or idx.shape[3] not in allowed or idx.dtype != torch.int32:
            raise AttentionInputError(
                f"startend_row_indices must be the global int32 mask [batch={b}, mask_heads in {heads}, "
                f"seqlen={s}, n in {allowed}] for causal={causal}, got {idx.dtype} {tuple(idx.shape)}")
    if dropout > 0.0 and query.device.type != "cpu":
        raise AttentionInputError("context-parallel dropout runs on CPU only (the Triton kernels have none)")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    canon = local_mask(plan, startend_row_indices, rank, causal=causal, batch_size=b).to(query.device)
    key, value = expand_kv_for_mask_heads(key, value, canon, h)
    if world == 1:
        full_idx = None if startend_row_indices is None else startend_row_indices
        return flashmask_attention(query, key, value, full_idx, causal=causal, softmax_scale=scale,
                                   dropout=dropout, return_softmax_lse=return_softmax_lse)
    seed = torch.randint(0, 2 ** 62, (1,)) if dropout > 0.0 else torch.zeros(1, dtype=torch.int64)
    fn = _RingContextParallelAttention if method == "ring" else _ContextParallelAttention
    out, lse = fn.apply(query, key, value, canon, group, world, scale, float(dropout), seed)
    return (out, lse) if return_softmax_lse else out
