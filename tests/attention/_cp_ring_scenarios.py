"""Ring scenarios for tests/attention/test_cp_attention.py (multirank harness, 2 and 4 gloo ranks).

Every case of ``_cp_scenarios`` again with ``method="ring"`` (out, lse, dq, dk, dv against single-process
``flashmask_attention`` and float64 dense attention), plus a check that the ring calls the kernel only for the
K/V blocks in which this rank's rows see at least one key (counted from the dense mask).
"""

import torch
from _cp_scenarios import B, D, H, HK, SCENARIOS, run, run_dropout, run_low_precision, run_nonfinite_key

import oarlock.attention.context_parallel as CP
from oarlock.attention import (ContextParallelPlan, context_parallel_flashmask_attention, flashmask_attention,
                               local_positions, shard_sequence, sliding_window_mask, to_dense_mask)


def _scenario(name):
    def scenario(ctx):
        torch.set_num_threads(1)  # ranks share the machine's cores
        run(name, ctx.world, ctx.rank, method="ring")

    scenario.__name__ = f"scenario_ring_{name}"
    return scenario


for _name in SCENARIOS:
    globals()[f"scenario_ring_{_name}"] = _scenario(_name)


def scenario_ring_nonfinite_key(ctx):
    torch.set_num_threads(1)
    run_nonfinite_key(ctx.world, ctx.rank, method="ring")


def scenario_ring_bfloat16(ctx):
    torch.set_num_threads(1)
    run_low_precision(ctx.world, ctx.rank, method="ring")


def scenario_ring_dropout(ctx):
    torch.set_num_threads(1)
    run_dropout(ctx.world, ctx.rank, method="ring")


def scenario_ring_skips_dead_blocks(ctx):
    """Sliding window of 40 under a contiguous split (blocks of 128 or 64 keys): rank r's rows see keys of
    blocks r - 1 and r only, so the ring runs the kernel (forward and backward) on those blocks alone, still
    forwarding the others, and the result equals the single-process one. The call names no method: the ring is
    the default (the all-gather would call the kernel once per pass on every rank)."""
    torch.set_num_threads(1)
    s, world, rank = 256, ctx.world, ctx.rank
    n = s // world
    idx = sliding_window_mask(s, 40, batch_size=B)
    plan = ContextParallelPlan(n, s, (0,) * world, tuple((r,) for r in range(world)))  # rank r owns block r
    g = torch.Generator().manual_seed(5)
    q, dout = torch.randn(B, s, H, D, generator=g), torch.randn(B, s, H, D, generator=g)
    k, v = torch.randn(B, s, HK, D, generator=g), torch.randn(B, s, HK, D, generator=g)
    rows = local_positions(plan, rank)
    keep = to_dense_mask(idx, causal=True, seqlen_q=s)[:, :, rows]
    want = sum(bool(keep[..., j * n:(j + 1) * n].any()) for j in range(world))
    assert want == (1 if rank == 0 else 2), want  # the mask itself: the counts below can be below world

    calls = {"forward": 0, "backward": 0}
    real_fwd, real_bwd = CP.kernel_forward, CP.kernel_backward

    def fwd(*a, **kw):
        calls["forward"] += 1
        return real_fwd(*a, **kw)

    def bwd(*a, **kw):
        calls["backward"] += 1
        return real_bwd(*a, **kw)

    CP.kernel_forward, CP.kernel_backward = fwd, bwd
    try:
        loc = [shard_sequence(plan, x, rank).requires_grad_(True) for x in (q, k, v)]
        out = context_parallel_flashmask_attention(*loc, idx, plan=plan, causal=True)
        out.backward(shard_sequence(plan, dout, rank))
    finally:
        CP.kernel_forward, CP.kernel_backward = real_fwd, real_bwd
    assert calls == {"forward": want, "backward": want}, calls

    ref = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out1 = flashmask_attention(*ref, idx, causal=True)
    out1.backward(dout)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, shard_sequence(plan, out1.detach(), rank), **tol)
    for got, ref_t in zip(loc, ref):
        torch.testing.assert_close(got.grad, shard_sequence(plan, ref_t.grad, rank), **tol)
