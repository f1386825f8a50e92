"""Scenarios for tests/attention/test_cp_attention.py, run by the multirank harness on 2 and 4 gloo ranks.

Every rank runs each scenario (a mask, a plan) with context-parallel FlashMask and compares its rows of out / lse
and its dq, dk, dv with (a) single-process ``flashmask_attention`` on the whole sequence and (b) float64 dense
attention written here from the dense mask.
"""

import torch

from oarlock.attention import (context_parallel_flashmask_attention, flashmask_attention, gather_sequence,
                               plan_context_parallel, shard_sequence)
from oarlock.attention import masks as M
from oarlock.attention.context_parallel import dual_chunk_swap

S, B, H, HK, D = 256, 2, 4, 2, 16
CHUNK, BLOCK = 32, 32


def _per_head(*idx):
    return torch.cat(idx, 1)


def _four(idx, causal):
    """Any index tensor as the explicit non-causal 4-vector (only for causal=False inputs)."""
    return M.canonicalize(idx, causal=causal, seqlen_q=S).to(torch.int32)


def _fully_masked_rows():
    """Documents (non-causal 4-vector) plus rows 100..119 masked for every key: those rows see nothing."""
    c = M.canonicalize(M.document_mask([60, 100, 96]), causal=False, seqlen_q=S)
    c[..., 0], c[..., 1] = 100, 120
    return c.to(torch.int32).expand(B, 1, S, 4).contiguous()


SCENARIOS = {
    # name: (indices, causal, query heads H, plan kind)
    "causal_document": (M.causal_document_mask([[50, 90, 30, 86], [17, 200, 39]], batch_size=B), True, H, "mask"),
    "sliding_window": (M.sliding_window_mask(S, 40, batch_size=B), True, H, "mask"),
    "shared_question": (M.shared_question_mask([(40, [30, 20]), (30, [50, 40, 46])], batch_size=B), True, H,
                        "mask"),
    "prefix_lm_noncausal": (M.prefix_lm_document_mask([(20, 100), (45, 156)], batch_size=B), False, H, "mask"),
    "gqa_per_kv_head_4vec": (_per_head(M.global_sliding_window_mask(S, 8, 30, 20, batch_size=B),
                                       _four(M.bidirectional_sliding_window_mask(S, 10, 50, batch_size=B), False)),
                             False, H, "mask"),
    "fully_masked_rows": (_fully_masked_rows(), False, H, "mask"),
    "mask_per_query_head": (M.random_eviction_mask(S, batch_size=B, num_heads=H,
                                                   generator=torch.Generator().manual_seed(3)), True, H, "mask"),
    "causal_none_dual_chunk_swap": (None, True, H, "dcs"),
    "mha_causal_blockwise": (M.causal_blockwise_mask([70, 60, 126], batch_size=B), True, HK, "mask"),
}


def dense_keep(idx, causal, h):
    """bool ``[B or 1, H or 1, S, S]``: which keys each query row sees (mask heads spread over query heads)."""
    if idx is None:
        keep = torch.ones(1, 1, S, S, dtype=torch.bool).tril()
    else:
        keep = M.to_dense_mask(idx, causal=causal, seqlen_q=S)
    return keep.repeat_interleave(h // keep.shape[1], 1) if keep.shape[1] > 1 else keep


def dense64(q, k, v, idx, causal):
    """float64 softmax(QK^T/sqrt(D) + mask) V from the dense mask; fully masked rows give 0."""
    h, hk = q.shape[2], k.shape[2]
    keep = dense_keep(idx, causal, h)
    qq, kk, vv = (x.double().transpose(1, 2) for x in (q, k, v))
    kk, vv = kk.repeat_interleave(h // hk, 1), vv.repeat_interleave(h // hk, 1)
    s = (qq @ kk.transpose(-1, -2)) / D ** 0.5
    s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    p = e / e.sum(-1, keepdim=True).clamp_min(1e-300)
    return (p @ vv).transpose(1, 2)


def run(name, world, rank, method="allgather"):
    idx, causal, h, kind = SCENARIOS[name]
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, S, h, D, generator=g)
    k = torch.randn(B, S, HK, D, generator=g)
    v = torch.randn(B, S, HK, D, generator=g)
    dout = torch.randn(B, S, h, D, generator=g)
    dlse = torch.randn(B, h, S, generator=g)
    if kind == "mask":
        plan = plan_context_parallel(idx, causal=causal, world_size=world, chunk_size=CHUNK, block_size=BLOCK)
    else:
        plan = dual_chunk_swap(S, world_size=world)
    # single process: out, lse and gradients of <out, dout> + <finite lse, dlse>
    ref = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out1, lse1 = flashmask_attention(*ref, idx, causal=causal, return_softmax_lse=True)
    fin = torch.isfinite(lse1)
    ((out1 * dout).sum() + torch.where(fin, lse1, 0).mul(dlse).sum()).backward()
    # float64 dense: out and gradients of <out, dout>
    r64 = [x.double().requires_grad_(True) for x in (q, k, v)]
    out64 = dense64(*r64, idx, causal)
    (out64 * dout.double()).sum().backward()
    # context parallel on this rank's rows
    loc = [shard_sequence(plan, x, rank).requires_grad_(True) for x in (q, k, v)]
    out, lse = context_parallel_flashmask_attention(*loc, idx, plan=plan, causal=causal, return_softmax_lse=True,
                                                    method=method)
    lfin = torch.isfinite(lse)
    ((out * shard_sequence(plan, dout, rank)).sum()
     + torch.where(lfin, lse, 0).mul(shard_sequence(plan, dlse, rank, dim=2)).sum()).backward()
    tol = dict(rtol=1e-5, atol=1e-5)
    shard = lambda t, dim=1: shard_sequence(plan, t, rank, dim=dim)  # noqa: E731
    torch.testing.assert_close(out, shard(out1.detach()), **tol, msg=lambda m: f"out vs single process: {m}")
    torch.testing.assert_close(lse, shard(lse1.detach(), 2), **tol, msg=lambda m: f"lse vs single process: {m}")
    for nm, got, want in zip("qkv", loc, ref):
        torch.testing.assert_close(got.grad, shard(want.grad), **tol, msg=lambda m, n=nm: f"d{n} vs single: {m}")
    assert not torch.isnan(out).any(), "NaN in the context-parallel output"
    torch.testing.assert_close(out.double(), shard(out64.detach()), **tol, msg=lambda m: f"out vs float64: {m}")
    # the float64 gradients leave out the lse term: check them with a second, lse-free backward
    loc2 = [shard_sequence(plan, x, rank).requires_grad_(True) for x in (q, k, v)]
    out2 = context_parallel_flashmask_attention(*loc2, idx, plan=plan, causal=causal, method=method)
    (out2 * shard(dout)).sum().backward()
    for nm, got, want in zip("qkv", loc2, r64):
        torch.testing.assert_close(got.grad.double(), shard(want.grad), **tol,
                                   msg=lambda m, n=nm: f"d{n} vs float64 dense: {m}")
    full = gather_sequence(plan, out.detach())
    torch.testing.assert_close(full, out1.detach(), **tol, msg=lambda m: f"gathered output: {m}")
    # rows that see no key at all: output and dq exactly 0 (not merely close), as in the single-process call
    dead = ~dense_keep(idx, causal, h).any(-1).expand(B, h, S)  # [B, H, S]
    assert dead.any() == (name == "fully_masked_rows"), "only fully_masked_rows has rows that see nothing"
    dead = shard(dead.transpose(1, 2))  # [B, S / W, H]
    assert torch.count_nonzero(out.detach()[dead]) == 0, "fully masked rows must give exactly 0"
    assert torch.count_nonzero(loc2[0].grad[dead]) == 0, "fully masked rows must get dq exactly 0"


def run_nonfinite_key(world, rank, method="allgather"):
    """A NaN in one key and an Inf in one value, each visible to some rows (sliding window of 40, GQA): the rows
    that see them are NaN, every other row equals the single-process result, and the gradients of a loss over
    the clean rows equal the single-process ones (dq NaN on the poisoned rows, dk and dv finite): a non-finite
    key poisons only the rows that see it, also when those rows see finite keys of other ranks' blocks."""
    idx = M.sliding_window_mask(S, 40, batch_size=B)
    g = torch.Generator().manual_seed(13)
    q = torch.randn(B, S, H, D, generator=g)
    k = torch.randn(B, S, HK, D, generator=g)
    v = torch.randn(B, S, HK, D, generator=g)
    dout = torch.randn(B, S, H, D, generator=g)
    k[0, 150, 0, 3] = float("nan")  # seen by rows 150..190 of batch 0
    v[1, 30, 1, 5] = float("inf")  # seen by rows 30..70 of batch 1
    keep = dense_keep(idx, True, H)  # [B, 1, S, S]
    # the kernels mark a row NaN in every head when it sees a key position holding a non-finite value in any head
    sees = torch.stack([keep[0, 0, :, 150], keep[1, 0, :, 30]]).unsqueeze(-1).expand(B, S, H)  # [B, S, H]
    plan = plan_context_parallel(idx, causal=True, world_size=world, chunk_size=CHUNK, block_size=BLOCK)
    ref = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out1 = flashmask_attention(*ref, idx, causal=True)
    torch.where(sees.unsqueeze(-1), 0.0, out1 * dout).sum().backward()
    loc = [shard_sequence(plan, x, rank).requires_grad_(True) for x in (q, k, v)]
    out = context_parallel_flashmask_attention(*loc, idx, plan=plan, causal=True, method=method)
    shard = lambda t: shard_sequence(plan, t, rank)  # noqa: E731
    lsees = shard(sees)
    torch.where(lsees.unsqueeze(-1), 0.0, out * shard(dout)).sum().backward()
    assert torch.isnan(out[lsees]).all(), "rows that see a non-finite key must be NaN"
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[~lsees], shard(out1.detach())[~lsees], **tol,
                               msg=lambda m: f"clean rows vs single process: {m}")
    # single process: dq is NaN exactly on the rows that see a non-finite key, dk and dv are finite
    assert torch.equal(torch.isnan(ref[0].grad).any(-1), sees)
    assert torch.isfinite(ref[1].grad).all() and torch.isfinite(ref[2].grad).all()
    for nm, got, want in zip("qkv", loc, ref):
        torch.testing.assert_close(got.grad, shard(want.grad), **tol, equal_nan=True,
                                   msg=lambda m, n=nm: f"d{n} vs single: {m}")


def run_low_precision(world, rank, method="allgather", dtype=torch.bfloat16):
    """bfloat16 inputs (GQA, causal documents crossing chunk boundaries): out, dq, dk, dv of this rank equal
    single-process bfloat16 flashmask_attention to bfloat16 rounding (both round each kernel's result to the
    input dtype, in different places), and lie near float64 dense attention; the dtypes are the inputs'."""
    idx, causal, h, _ = SCENARIOS["causal_document"]
    g = torch.Generator().manual_seed(17)
    q, k, v = (torch.randn(B, S, n, D, generator=g).to(dtype) for n in (h, HK, HK))
    dout = torch.randn(B, S, h, D, generator=g).to(dtype)
    plan = plan_context_parallel(idx, causal=causal, world_size=world, chunk_size=CHUNK, block_size=BLOCK)
    ref = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out1 = flashmask_attention(*ref, idx, causal=causal)
    out1.backward(dout)
    loc = [shard_sequence(plan, x, rank).requires_grad_(True) for x in (q, k, v)]
    out = context_parallel_flashmask_attention(*loc, idx, plan=plan, causal=causal, method=method)
    out.backward(shard_sequence(plan, dout, rank))
    assert out.dtype == dtype and all(x.grad.dtype == dtype for x in loc)
    shard = lambda t: shard_sequence(plan, t, rank)  # noqa: E731
    tol = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, shard(out1.detach()), **tol, msg=lambda m: f"out vs single process: {m}")
    for nm, got, want in zip("qkv", loc, ref):
        torch.testing.assert_close(got.grad, shard(want.grad), **tol, msg=lambda m, n=nm: f"d{n} vs single: {m}")
    r64 = [x.double().requires_grad_(True) for x in (q, k, v)]
    torch.testing.assert_close(out.double(), shard(dense64(*r64, idx, causal).detach()), rtol=2e-2, atol=2e-2,
                               msg=lambda m: f"out vs float64: {m}")


def run_dropout(world, rank, method="allgather"):
    """Dropout 0.3 on CPU: the output is linear in V for fixed dropout masks (the same seed on every rank), so
    ``sum over ranks <dV, U>`` must equal ``sum over ranks <out(V + U) - out(V), dO>`` (no truncation error): the
    backward redraws exactly the forward's masks. Dropout must change the output, and the same seed repeat it."""
    import torch.distributed as dist

    idx, causal, h, _ = SCENARIOS["causal_document"]
    g = torch.Generator().manual_seed(19)
    q, k, v = (torch.randn(B, S, n, D, generator=g) for n in (h, HK, HK))
    u = torch.randn(B, S, HK, D, generator=g)
    dout = torch.randn(B, S, h, D, generator=g)
    plan = plan_context_parallel(idx, causal=causal, world_size=world, chunk_size=CHUNK, block_size=BLOCK)
    shard = lambda t: shard_sequence(plan, t, rank)  # noqa: E731
    lq, lk, lv, lu, ldo = (shard(x) for x in (q, k, v, u, dout))

    def attend(value, p=0.3):
        torch.manual_seed(1234)  # the seed the call draws: the same on every rank and in every call
        return context_parallel_flashmask_attention(lq, lk, value, idx, plan=plan, causal=causal, dropout=p,
                                                    method=method)

    vv = lv.clone().requires_grad_(True)
    out = attend(vv)
    out.backward(ldo)
    lhs = torch.stack([(vv.grad.double() * lu.double()).sum(),
                       ((attend(lv + lu) - out.detach()).double() * ldo.double()).sum()])
    dist.all_reduce(lhs)
    torch.testing.assert_close(lhs[0], lhs[1], rtol=1e-4, atol=1e-4, msg=lambda m: f"<dV, U> vs finite difference: {m}")
    assert torch.equal(attend(lv), out.detach()), "the same seed must give the same dropout masks"
    assert not torch.allclose(attend(lv, 0.0), out.detach(), atol=1e-3), "dropout changed nothing"


def _scenario(name):
    def scenario(ctx):
        torch.set_num_threads(1)  # ranks share the machine's cores
        run(name, ctx.world, ctx.rank)

    scenario.__name__ = f"scenario_{name}"
    return scenario


for _name in SCENARIOS:
    globals()[f"scenario_{_name}"] = _scenario(_name)


def scenario_nonfinite_key(ctx):
    torch.set_num_threads(1)
    run_nonfinite_key(ctx.world, ctx.rank)


def scenario_bfloat16(ctx):
    torch.set_num_threads(1)
    run_low_precision(ctx.world, ctx.rank)


def scenario_dropout(ctx):
    torch.set_num_threads(1)
    run_dropout(ctx.world, ctx.rank)
