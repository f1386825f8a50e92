"""Mask-aware load balancing for context parallelism (FlashMask V3 / MARCO, spec section 3.7).

With context parallelism every rank owns some query chunks of the sequence and attends them to all keys.
Under a sparse mask the chunks cost very different amounts (a late chunk of a causal mask sees more keys;
a chunk inside a short document sees few), so a contiguous split is unbalanced. The planner:

1. splits the query rows into ``chunk_size`` chunks and weighs each by its number of live (not fully masked)
   ``block_size x block_size`` tiles, summed over batch and mask heads, using the same min/max tile
   classification as the kernels (:func:`oarlock.attention.masks.classify_tiles`);
2. assigns chunks to ranks with LPT (longest processing time first) under a cardinality constraint: chunks in
   decreasing weight go to the currently lightest rank that still has room, so every rank gets exactly
   ``num_chunks / world_size`` chunks (equal activation memory) and near-equal work.

It is a pure function of the mask: no processes, no communication. Executing a plan (permuting Q/K/V and the
indices with all-to-all) is up to the caller; :meth:`ContextParallelPlan.token_permutation` gives the order.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from oarlock.attention.errors import AttentionInputError
from oarlock.attention.masks import TILE_SKIP, canonicalize, classify_tiles

__all__ = ["ContextParallelPlan", "plan_context_parallel", "chunk_workloads", "dual_chunk_swap"]


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
        """int64 ``[seqlen]``: original token positions in rank order (rank 0's chunks first). ``x[:, perm]``
        lays a ``[batch, seqlen, ...]`` tensor out so that rank ``r`` owns the ``r``-th equal slice."""
        parts = [torch.arange(c * self.chunk_size, min((c + 1) * self.chunk_size, self.seqlen))
                 for chunks in self.assignment for c in chunks]
        return torch.cat(parts)


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
