"""Context-parallel FlashMask (2 and 4 gloo ranks) and the FlashMask gaps of issue 19: SDPA-layout detection,
mask heads equal to query heads, a differentiable log-sum-exp, the small-sequence dense path, and non-finite
keys isolated by the mask."""

import math

import pytest
import torch

from oarlock.attention import (AttentionInputError, causal_document_mask, context_parallel_flashmask_attention,
                               flashmask_attention, local_positions, plan_context_parallel, shard_sequence,
                               sliding_window_mask, to_dense_mask)
from oarlock.attention import flashmask as F
from oarlock.attention.context_parallel import dual_chunk_swap, local_mask
from oarlock.attention.masks import random_eviction_mask


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_matches_single_process_and_float64(world, multirank):
    """One launch per world size runs every scenario of _cp_scenarios (causal documents crossing chunk
    boundaries, sliding window, shared question, non-causal prefix LM, GQA with per-KV-head 4-vector masks,
    fully masked rows, a mask per query head, plain causal under DualChunkSwap, MHA causal blockwise): every
    rank's out, lse, dq, dk, dv equal single-process flashmask_attention and float64 dense attention
    (atol 1e-5), rows that see no key give out and dq exactly 0, and gather_sequence restores the full output.
    Plus a NaN key and an Inf value seen by some rows: those rows NaN, everything else (dk, dv included) equal
    to the single-process result; bfloat16 inputs near the single-process bfloat16 result; dropout whose dV is
    the exact derivative of the forward (output linear in V)."""
    outcome = multirank("_cp_scenarios", world)
    outcome.check()
    assert len(outcome.names) == 12 and len(outcome.ranks) == world


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ring_context_parallel_matches_single_process_and_float64(world, multirank):
    """method="ring" on every scenario of the all-gather test (same checks: out, lse, dq, dk, dv against
    single-process flashmask_attention and float64 dense attention, atol 1e-5; fully masked rows exactly 0;
    a non-finite key poisons only the rows that see it, not the dK/dV of other ranks' keys those rows see;
    bfloat16; dropout), plus: the ring, the default method, runs the kernel only on the K/V blocks a rank's rows
    see (counted from the dense mask)."""
    outcome = multirank("_cp_ring_scenarios", world)
    outcome.check()
    assert len(outcome.names) == 13 and len(outcome.ranks) == world


@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_group_of_one_is_flashmask_attention(method):
    """world_size 1 (no process group): either method returns exactly flashmask_attention's out, lse and
    gradients (GQA, causal documents, return_softmax_lse)."""
    g = torch.Generator().manual_seed(8)
    s = 384
    idx = causal_document_mask([100, 200, 84])
    plan = plan_context_parallel(idx, causal=True, world_size=1, chunk_size=128)
    q = torch.randn(1, s, 4, 16, generator=g)
    k, v = torch.randn(1, s, 2, 16, generator=g), torch.randn(1, s, 2, 16, generator=g)
    dout, dlse = torch.randn(1, s, 4, 16, generator=g), torch.randn(1, 4, s, generator=g)
    results = []
    for fn in (lambda *x: flashmask_attention(*x, idx, causal=True, return_softmax_lse=True),
               lambda *x: context_parallel_flashmask_attention(*x, idx, plan=plan, causal=True,
                                                               return_softmax_lse=True, method=method)):
        xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, lse = fn(*xs)
        ((out * dout).sum() + (lse * dlse).sum()).backward()
        results.append((out.detach(), lse.detach(), *(x.grad for x in xs)))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), name


def test_unknown_cp_method_is_named():
    plan = plan_context_parallel(None, causal=True, world_size=1, chunk_size=128, seqlen_q=256)
    x = torch.randn(1, 256, 2, 8)
    with pytest.raises(AttentionInputError, match=r"method must be one of \('allgather', 'ring'\), got 'tree'"):
        context_parallel_flashmask_attention(x, x, x, None, plan=plan, causal=True, method="tree")


def test_shard_helpers_follow_the_plan_permutation():
    idx = causal_document_mask([300, 200, 524])
    plan = plan_context_parallel(idx, causal=True, world_size=4, chunk_size=128)
    perm = plan.token_permutation()
    x = torch.arange(2 * 1024).view(2, 1024) * 10
    for r in range(4):
        pos = local_positions(plan, r)
        assert sorted(pos.tolist()) == sorted(perm[r * 256:(r + 1) * 256].tolist())
        assert pos.tolist() == sorted(pos.tolist())
        assert torch.equal(shard_sequence(plan, x, r), x[:, pos])
        assert torch.equal(plan.shard(x, r), x[:, pos])
    with pytest.raises(AttentionInputError, match="1000 positions along dim 1, the plan covers seqlen=1024"):
        shard_sequence(plan, x[:, :1000], 0)


def test_local_mask_is_the_global_mask_on_local_rows():
    """The re-indexed mask of rank r, expanded densely, equals the global dense mask restricted to r's rows and
    with columns in the plan's order (causal folded in)."""
    s = 256
    idx = sliding_window_mask(s, 50)
    plan = dual_chunk_swap(s, world_size=2)
    dense = to_dense_mask(idx, causal=True)[0, 0]
    perm = plan.token_permutation()
    for r in range(2):
        canon = local_mask(plan, idx, r, causal=True)
        rows = local_positions(plan, r)
        n = rows.numel()
        i = torch.arange(n).view(-1, 1)
        lts, lte, uts, ute = (canon[0, 0, :, c].view(1, -1) for c in range(4))
        keep = ~(((i >= lts) & (i < lte)) | ((i >= uts) & (i < ute)))
        assert torch.equal(keep, dense[rows][:, perm])


def test_sdpa_layout_is_detected_and_named():
    q = torch.randn(1, 4, 300, 16)  # SDPA layout [B, H, S, D]
    idx = causal_document_mask([100, 200])
    with pytest.raises(AttentionInputError, match=r"SDPA layout \[batch, heads, seqlen, head_dim\].*"
                                                   r"\[batch, seqlen, heads, head_dim\].*transpose\(1, 2\)"):
        flashmask_attention(q, q, q, idx, causal=True)
    long = torch.randn(1, 8, 2048, 16)
    with pytest.raises(AttentionInputError, match="2048 'heads' and 8 'positions'.*SDPA layout"):
        flashmask_attention(long, long, long, causal=True)


def _dense_reference(q, k, v, keep):
    """float64 attention with a dense [B, H, S, S] keep mask; rows seeing nothing give 0."""
    h, hk = q.shape[2], k.shape[2]
    qq, kk, vv = (x.double().transpose(1, 2) for x in (q, k, v))
    kk, vv = kk.repeat_interleave(h // hk, 1), vv.repeat_interleave(h // hk, 1)
    sc = (qq @ kk.transpose(-1, -2)) / q.shape[-1] ** 0.5
    sc = sc.masked_fill(~keep, float("-inf"))
    m = sc.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(sc - m)
    l = e.sum(-1, keepdim=True)
    lse = (m + torch.log(l)).squeeze(-1)
    return (e / l.clamp_min(1e-300) @ vv).transpose(1, 2), lse


@pytest.mark.parametrize("s", [200, 1500])  # dense SDPA path and tiled kernel
def test_mask_heads_equal_query_heads(s):
    """Paddle #77469: one mask per query head (H=4 over Hk=2), forward and gradients."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, s, 4, 16, generator=g, requires_grad=True)
    k = torch.randn(1, s, 2, 16, generator=g, requires_grad=True)
    v = torch.randn(1, s, 2, 16, generator=g, requires_grad=True)
    idx = random_eviction_mask(s, num_heads=4, generator=g)
    out = flashmask_attention(q, k, v, idx, causal=True)
    dout = torch.randn(out.shape, generator=g)
    (out * dout).sum().backward()
    qq, kk, vv = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    want, _ = _dense_reference(qq, kk, vv, to_dense_mask(idx, causal=True))
    (want * dout.double()).sum().backward()
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    for got, ref in ((q, qq), (k, kk), (v, vv)):
        torch.testing.assert_close(got.grad.double(), ref.grad, atol=1e-5, rtol=1e-5)


def test_softmax_lse_is_differentiable():
    """d<lse, w>/d(q, k) equals float64 autograd of the dense log-sum-exp (v gets no gradient from lse)."""
    g = torch.Generator().manual_seed(1)
    s = 300
    q = torch.randn(2, s, 4, 16, generator=g, requires_grad=True)
    k = torch.randn(2, s, 2, 16, generator=g, requires_grad=True)
    v = torch.randn(2, s, 2, 16, generator=g, requires_grad=True)
    idx = causal_document_mask([[100, 200], [50, 250]], batch_size=2)
    out, lse = flashmask_attention(q, k, v, idx, causal=True, return_softmax_lse=True)
    w = torch.randn(lse.shape, generator=g)
    (lse * w).sum().backward()
    qq, kk, vv = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    _, want = _dense_reference(qq, kk, vv, to_dense_mask(idx, causal=True))
    torch.testing.assert_close(lse.double(), want.detach(), atol=1e-5, rtol=1e-5)
    (want * w.double()).sum().backward()
    torch.testing.assert_close(q.grad.double(), qq.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k.grad.double(), kk.grad, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(v.grad) == 0


@pytest.mark.parametrize("causal", [True, False])
def test_small_sequences_take_the_dense_path_with_the_same_result(causal, monkeypatch):
    """Below DENSE_DISPATCH_MAX_SCORES the CPU path is SDPA with the dense mask: same out and grads as the
    tiled kernel (forced by setting the threshold to 0), fully masked rows exactly 0 with zero gradient."""
    g = torch.Generator().manual_seed(2)
    s = 160
    if causal:
        idx = causal_document_mask([40, 70, 50])
    else:
        # non-causal [LTS, UTE] = [60 + j % 7, 0]: rows >= 66 see nothing
        j = torch.arange(s)
        idx = torch.stack([60 + j % 7, torch.zeros_like(j)], -1).view(1, 1, s, 2).int()
    q = torch.randn(1, s, 4, 8, generator=g)
    k = torch.randn(1, s, 2, 8, generator=g)
    v = torch.randn(1, s, 2, 8, generator=g)
    dout = torch.randn(1, s, 4, 8, generator=g)
    called = []
    real = F.dense_attention
    monkeypatch.setattr(F, "dense_attention", lambda *a, **kw: called.append(1) or real(*a, **kw))
    results = []
    for limit in (F.DENSE_DISPATCH_MAX_SCORES, 0):
        monkeypatch.setattr(F, "DENSE_DISPATCH_MAX_SCORES", limit)
        xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out = flashmask_attention(*xs, idx, causal=causal)
        (out * dout).sum().backward()
        results.append((out.detach(), *(x.grad for x in xs)))
    assert called == [1]  # the first run took the dense path, the second the kernel
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    if not causal:
        assert torch.count_nonzero(results[0][0][:, 66:]) == 0
        assert torch.count_nonzero(results[0][1][:, 66:]) == 0
        assert torch.count_nonzero(results[0][0][:, :60]) > 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_key_hidden_by_the_mask_does_not_leak(bad):
    """A NaN/Inf in key/value j that the causal mask hides from rows < j: those rows (in the same tile) are
    exactly the result without that key; rows that see j are NaN. Gradients of the clean rows stay finite."""
    g = torch.Generator().manual_seed(4)
    s, j = 1200, 700  # above the dense-path size: the tiled kernel
    q = torch.randn(1, s, 2, 16, generator=g)
    k = torch.randn(1, s, 2, 16, generator=g)
    v = torch.randn(1, s, 2, 16, generator=g)
    idx = sliding_window_mask(s, 300)
    clean = flashmask_attention(q, k, v, idx, causal=True)
    for tensor in ("key", "value"):
        kk, vv = k.clone(), v.clone()
        (kk if tensor == "key" else vv)[0, j, 0, 3] = bad
        qg = q.clone().requires_grad_(True)
        out = flashmask_attention(qg, kk, vv, idx, causal=True)
        sees = to_dense_mask(idx, causal=True)[0, 0, :, j]  # rows j .. j + 300
        torch.testing.assert_close(out[:, ~sees], clean[:, ~sees], atol=0, rtol=0)
        assert torch.isnan(out[:, sees]).all()
        out[:, ~sees].sum().backward()
        assert torch.isfinite(qg.grad[:, ~sees]).all()


def _dense_float64(q, k, v, keep):
    """Plain float64 attention with a dense bool mask [B, 1, Sq, Sk]; rows that see nothing give 0."""
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    kd = kd.repeat_interleave(qd.shape[1] // kd.shape[1], dim=1)
    vd = vd.repeat_interleave(qd.shape[1] // vd.shape[1], dim=1)
    s = (qd @ kd.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ vd).transpose(1, 2)


def test_dense_path_mask_cache_follows_in_place_changes_of_the_indices():
    """The dense path caches the mask built from one index tensor (the layers of a model share it). An in-place
    change of that tensor must rebuild it; a new tensor with other values must not reuse the old mask."""
    g = torch.Generator().manual_seed(5)
    s = 96
    q, k, v = (torch.randn(1, s, 2, 8, generator=g) for _ in range(3))
    rows = torch.arange(s).view(-1, 1)
    cols = torch.arange(s).view(1, -1)

    def keep_for(doc_starts):  # causal documents: key j visible to rows in [j, end of j's document)
        ends = torch.tensor([next(e for e in doc_starts[1:] + [s] if e > j) for j in range(s)])
        return ((rows >= cols) & (rows < ends.view(1, -1))).view(1, 1, s, s), ends

    keep_a, ends_a = keep_for([0, 30, 60])
    idx = ends_a.view(1, 1, s, 1).int().clone()
    out_a = flashmask_attention(q, k, v, idx, causal=True)
    torch.testing.assert_close(out_a.double(), _dense_float64(q, k, v, keep_a), atol=1e-5, rtol=1e-5)
    again = flashmask_attention(q, k, v, idx, causal=True)
    assert torch.equal(again, out_a)
    keep_b, ends_b = keep_for([0, 50])
    idx.copy_(ends_b.view(1, 1, s, 1))  # in place: same tensor object, new values
    out_b = flashmask_attention(q, k, v, idx, causal=True)
    torch.testing.assert_close(out_b.double(), _dense_float64(q, k, v, keep_b), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out_a, out_b)
    fresh = ends_a.view(1, 1, s, 1).int()  # another tensor: its own mask
    torch.testing.assert_close(flashmask_attention(q, k, v, fresh, causal=True), out_a, atol=0, rtol=0)
    with torch.inference_mode():  # inference tensors have no version counter: not cached, still right
        inf_idx = ends_b.view(1, 1, s, 1).int()
        torch.testing.assert_close(flashmask_attention(q, k, v, inf_idx, causal=True).double(),
                                   _dense_float64(q, k, v, keep_b), atol=1e-5, rtol=1e-5)


def test_dense_path_sends_non_finite_keys_to_the_tiled_kernel():
    """A NaN in a masked-out key must not reach the output (SDPA's dense mask would let it through)."""
    g = torch.Generator().manual_seed(6)
    s = 64
    q, k, v = (torch.randn(1, s, 2, 8, generator=g) for _ in range(3))
    idx = causal_document_mask([32, 32])
    k[:, 40] = float("nan")  # in the second document: invisible to rows 0..31
    out = flashmask_attention(q, k, v, idx, causal=True)
    assert torch.isfinite(out[:, :32]).all()
    keep = (torch.arange(s).view(-1, 1) >= torch.arange(s).view(1, -1)) & \
           ((torch.arange(s).view(-1, 1) < 32) == (torch.arange(s).view(1, -1) < 32))
    torch.testing.assert_close(out[:, :32].double(), _dense_float64(q, k, v, keep.view(1, 1, s, s))[:, :32],
                               atol=1e-5, rtol=1e-5)
