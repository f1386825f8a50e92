"""Context-parallel load-balancing planner: pure function, checked against brute force."""

from __future__ import annotations

import itertools

import pytest
import torch

from oarlock.attention import causal_document_mask, to_dense_mask
from oarlock.attention.context_parallel import chunk_workloads, dual_chunk_swap, plan_context_parallel
from oarlock.attention.errors import AttentionInputError
from oarlock.attention.masks import causal_mask, shared_question_mask


def brute_live_tiles(idx, causal, s, chunk, block):
    keep = to_dense_mask(idx, causal=causal, seqlen_q=s)
    out = []
    for c0 in range(0, s, chunk):
        n = 0
        for r0 in range(c0, min(c0 + chunk, s), block):
            for k0 in range(0, s, block):
                n += int(keep[:, :, r0:r0 + block, k0:k0 + block].any((2, 3)).sum())
        out.append(n)
    return out


def test_workloads_count_live_tiles():
    s = 1024
    assert chunk_workloads(causal_mask(s), causal=True, seqlen_q=s, seqlen_k=s, chunk_size=256, block_size=64) == \
        brute_live_tiles(causal_mask(s), True, s, 256, 64)
    idx = causal_document_mask([[128, 320, 64, 512], [512, 512]], batch_size=2)
    got = chunk_workloads(idx, causal=True, seqlen_q=s, seqlen_k=s, chunk_size=256, block_size=64)
    assert got == brute_live_tiles(idx, True, s, 256, 64)  # document ends on tile borders: exact


def test_plan_is_a_balanced_partition_with_equal_counts():
    s = 16384
    docs = [3000, 500, 700, 5000, 1200, 2600, 384, 3000]
    idx = causal_document_mask(docs)
    plan = plan_context_parallel(idx, causal=True, world_size=4, chunk_size=1024)
    assert sorted(c for r in plan.assignment for c in r) == list(range(16))
    assert all(len(r) == 4 for r in plan.assignment)
    perm = plan.token_permutation()
    assert sorted(perm.tolist()) == list(range(s))
    assert perm[:1024].tolist() == list(range(plan.assignment[0][0] * 1024, plan.assignment[0][0] * 1024 + 1024))
    # better than a contiguous split and than the mask-agnostic DualChunkSwap on the same work estimate
    w = plan.chunk_weights
    contiguous = [sum(w[r * 4:(r + 1) * 4]) for r in range(4)]
    w8 = chunk_workloads(idx, causal=True, seqlen_q=s, seqlen_k=s, chunk_size=2048)
    dcs = dual_chunk_swap(s, world_size=4, weights=w8)
    assert plan.imbalance < max(contiguous) / (sum(contiguous) / 4)
    assert plan.imbalance <= dcs.imbalance
    assert plan.imbalance < 1.05
    assert sum(plan.rank_work) == sum(w)


def test_lpt_is_close_to_the_optimum_on_small_cases():
    g = torch.Generator().manual_seed(0)
    for trial in range(5):
        lens = (torch.randint(1, 6, (6,), generator=g) * 128).tolist()
        s = 4096
        idx = shared_question_mask([(lens[0], lens[1:3]), (lens[3], lens[4:6])], seqlen=s)
        plan = plan_context_parallel(idx, causal=True, world_size=2, chunk_size=512)
        w = plan.chunk_weights
        best = min(max(sum(w[c] for c in half), sum(w) - sum(w[c] for c in half))
                   for half in itertools.combinations(range(8), 4))
        assert max(plan.rank_work) <= 4 / 3 * best, (trial, w, plan.assignment)


def test_plan_errors():
    with pytest.raises(AttentionInputError, match="gives 3 chunks .* not a multiple of world_size=2"):
        plan_context_parallel(causal_mask(3 * 256), causal=True, world_size=2, chunk_size=256)
    with pytest.raises(AttentionInputError, match="multiple of block_size=128, got 100"):
        plan_context_parallel(causal_mask(1024), causal=True, world_size=2, chunk_size=100)
    plan = plan_context_parallel(None, causal=True, world_size=2, chunk_size=256, seqlen_q=1024)
    assert plan.assignment == ((0, 3), (1, 2))  # plain causal: LPT rediscovers DualChunkSwap
