"""Scenarios of test_live_errors.py on 2 gloo ranks (rank 0 the trainer, rank 1 the engine): a plan-time error is
a PlanError on both ranks and leaves the targets and torn alone; a transfer-time failure is not a PlanError, has
phase "transfer" and leaves the receiver torn; a plan-time error after it keeps it torn."""

from __future__ import annotations

import warnings

import torch

from oarlock.checkpoint import CheckpointError, CheckpointMismatchError, ShardedWeight, WeightSync
from oarlock.checkpoint.errors import PlanError
from oarlock.checkpoint.runtime import transfer
from testkit import seeded_tensor

warnings.filterwarnings("ignore")


def scenario_plan_error_on_every_rank_then_transfer_error_then_repair(ctx):
    W = seeded_tensor((64, 32), torch.float32, 1)
    src = {"w": W.clone()} if ctx.rank == 0 else {}
    good = ShardedWeight("w", torch.full((64, 32), 3.0), (64, 32), (64, 32), (0, 0))
    tgt = {"w": ShardedWeight("w", torch.full((64, 30), 3.0), (64, 30), (64, 30), (0, 0))} if ctx.rank else {}
    sync = WeightSync(src, tgt, verify=True, bucket_bytes=4096)
    try:  # 1. the engine's target is [64, 30]: every rank raises before any byte moves
        sync.run()
        raise AssertionError("no error")
    except PlanError as e:
        assert isinstance(e, CheckpointMismatchError) and e.phase == "plan"
        assert "'w'" in str(e) and "[64, 30] float32" in str(e) and "[64, 32] float32" in str(e), str(e)
    assert sync.torn is False
    if ctx.rank:
        assert bool((tgt["w"].local_tensor == 3).all())
        tgt["w"] = good
    # 2. a chunk corrupted on the wire: a transfer-time error, the receiver torn
    transfer._tamper = lambda s, r, k, buf: buf.__setitem__(0, buf[0] ^ 1) if k == 1 else None
    try:
        sync.run()
        raise AssertionError("no error")
    except CheckpointError as e:
        assert not isinstance(e, PlanError) and e.phase == "transfer", repr(e)
        assert "do not match the hash" in str(e), str(e)
    finally:
        transfer._tamper = None
    assert sync.torn is (ctx.rank == 1)
    # 3. a plan-time error now: the receiver stays torn (its targets are still a mix)
    if ctx.rank:
        tgt["w"] = ShardedWeight("w", torch.zeros(64, 31), (64, 31), (64, 31), (0, 0))
    try:
        sync.run()
        raise AssertionError("no error")
    except PlanError:
        pass
    assert sync.torn is (ctx.rank == 1)
    # 4. a good run repairs it
    if ctx.rank:
        tgt["w"] = good
    rep = sync.run()
    assert sync.torn is False
    if ctx.rank:
        assert torch.equal(good.local_tensor, W) and rep.bytes_received == 64 * 32 * 4
