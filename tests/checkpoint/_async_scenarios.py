"""Scenarios of test_async_save.py on 2 gloo ranks (CPU): plan reuse across saves of DTensors and its
invalidation by a changed placement or process group, and asynchronous saves of DTensors whose snapshot is
checked against clones taken before the state changed. Expected values are plain torch tensors built from fixed
seeds (``testkit.seeded_tensor``) and clones, never read back through oarlock's own writer."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from oarlock.checkpoint import load_state_dict, save_state_dict
from oarlock.checkpoint.lifecycle.async_save import async_save
from oarlock.checkpoint.runtime.save import plan_cache
from testkit import seeded_tensor

warnings.filterwarnings("ignore")


def _dt(mesh, shape, seed, placement, dtype=torch.float32):
    return distribute_tensor(seeded_tensor(shape, dtype, seed), mesh, [placement])


def _full_equal(path, full: dict[str, torch.Tensor]) -> None:
    """Load ``path`` into whole tensors (every rank) and compare bit for bit with ``full``."""
    got = {k: torch.zeros_like(v) for k, v in full.items()}
    load_state_dict(got, path, ignore_unexpected=["step"])
    for k, v in full.items():
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


def scenario_plan_reuse_and_its_invalidation(ctx):
    """Saves of DTensors with equal keys/shapes/dtypes/placements/group reuse the plan (every rank); a changed
    placement, a new process group with the same ranks, and a sub-group each build a new one; every checkpoint
    loads bit-exact."""
    mesh = init_device_mesh("cpu", (2,))
    plan_cache.clear()
    hits, misses = plan_cache.hits, plan_cache.misses

    def save(sd, name, group=None):
        save_state_dict(sd, ctx.root / name, process_group=group)
        return plan_cache.hits - hits, plan_cache.misses - misses

    full = {"w": seeded_tensor((8, 6), torch.float32, 1), "b": seeded_tensor((5,), torch.bfloat16, 2)}
    sd = {"w": _dt(mesh, (8, 6), 1, Shard(0)), "b": _dt(mesh, (5,), 2, Replicate(), torch.bfloat16), "step": 1}
    assert save(sd, "a") == (0, 1)
    sd["step"] = 2  # a JSON value changes every save without changing the plan
    sd["w"].to_local().mul_(3)
    assert save(sd, "b") == (1, 1)
    _full_equal(ctx.root / "a", full)
    _full_equal(ctx.root / "b", {"w": full["w"] * 3, "b": full["b"]})
    got = {"step": 0}
    load_state_dict(got, ctx.root / "b", strict=False)
    assert got["step"] == 2
    # placement Shard(0) -> Shard(1): new plan, right values
    sd = {"w": _dt(mesh, (8, 6), 1, Shard(1)), "b": _dt(mesh, (5,), 2, Replicate(), torch.bfloat16), "step": 3}
    assert save(sd, "c") == (1, 2)
    _full_equal(ctx.root / "c", full)
    assert save(sd, "d") == (2, 2)
    # a new group of the same ranks: its own plan (not the default group's)
    g = dist.new_group([0, 1], backend="gloo")
    assert save(sd, "e", g) == (2, 3)
    assert save(sd, "f", g) == (3, 3)
    _full_equal(ctx.root / "f", full)
    # a one-rank sub-group: rank r saves its own local tensor alone
    sub = [dist.new_group([r], backend="gloo") for r in (0, 1)][dist.get_rank()]
    mine = {"x": seeded_tensor((4,), torch.float32, 10 + dist.get_rank())}
    before = plan_cache.misses
    save_state_dict(mine, ctx.root / f"sub{dist.get_rank()}", process_group=sub)
    assert plan_cache.misses == before + 1
    got = {"x": torch.zeros(4)}
    load_state_dict(got, ctx.root / f"sub{dist.get_rank()}", process_group=sub)
    assert torch.equal(got["x"], mine["x"])
    dist.barrier()


def scenario_async_dtensors_snapshot_at_wait_staged(ctx):
    """Three async saves of Shard(0) DTensors (the 2nd and 3rd reuse the plan and the staging buffers): the state is
    updated in place right after ``wait_staged()``; each checkpoint holds the clones taken before."""
    mesh = init_device_mesh("cpu", (2,))
    sd = {"w": _dt(mesh, (64, 32), 5, Shard(0)), "m": _dt(mesh, (16, 8), 6, Shard(0), torch.bfloat16)}
    reused = []
    for i in range(3):
        before = {k: v.full_tensor().clone() for k, v in sd.items()}
        h = async_save(sd, ctx.root / f"s{i}")
        reused.append(h.plan_reused)
        h.wait_staged()
        for v in sd.values():  # the optimizer step
            v.to_local().mul_(2).add_(1)
        t = torch.ones(1)
        dist.all_reduce(t)  # training collectives on the default group while the write runs
        h.wait()
        _full_equal(ctx.root / f"s{i}", before)
    assert reused == [False, True, True], reused
    dist.barrier()


def _wait_for_file(path, limit_s: float) -> None:
    """Return once ``path`` exists, or once ``limit_s`` has passed (only a guard against a hang: the caller
    asserts an order of events, never this time)."""
    import time

    end = time.monotonic() + limit_s
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.01)


def scenario_async_save_returns_without_waiting_for_the_other_ranks(ctx):
    """No collective runs on the caller's path: rank 0's ``async_save`` returns before rank 1 has even called it.
    Rank 1 calls only once rank 0's call has returned (or, so that a collective in the call cannot hang the test,
    after a generous wait), and announces its call first; rank 0 checks, on return, that no announcement exists:
    the order of the two events is what is asserted, not a time. The plan is then settled in the background on
    both ranks, and both checkpoints load bit-exact. (A group's first async save creates its side group, a
    collective by design: done first, with other keys, so that the scenario also holds when run alone.)"""
    import os

    mesh = init_device_mesh("cpu", (2,))
    async_save({"other": torch.zeros(2)}, ctx.root / "side-group").wait()
    sd = {"w": _dt(mesh, (32, 8), 11, Shard(0)), "step": 4}
    full = {"w": seeded_tensor((32, 8), torch.float32, 11)}
    for i in range(2):  # a fresh plan, then a reused one
        returned, called = ctx.root / f"rank0-returned-{i}", ctx.root / f"rank1-called-{i}"
        if ctx.rank == 0:
            h = async_save(sd, ctx.root / f"r{i}")
            early = called.exists()
            returned.touch()
            assert not early, f"save {i}: rank 0's async_save returned only after rank 1 had called it"
        else:
            _wait_for_file(returned, 120.0)
            called.touch()
            h = async_save(sd, ctx.root / f"r{i}")
        h.wait_staged()
        assert h.plan_reused == (i == 1)
        h.wait()
        _full_equal(ctx.root / f"r{i}", full)
    assert os.path.exists(ctx.root / "r1" / "metadata.json")
    dist.barrier()


def scenario_async_planning_errors_reach_every_rank(ctx):
    """Planning now runs in the background, so its errors come from ``wait_staged()`` (and ``wait()``), on every
    rank alike: a leaf that is not savable on rank 1 only, then global shapes that disagree between the ranks.
    Nothing is published, and the next save works."""
    from oarlock.checkpoint import CheckpointError, ShardedWeight

    good = seeded_tensor((4, 4), torch.float32, 3)
    bad_leaf = {"w": good, "extra": object() if ctx.rank == 1 else 1}
    h = async_save(bad_leaf, ctx.root / "bad-leaf")
    try:
        h.wait_staged()
        raise AssertionError("a bad leaf on rank 1 did not fail the save")
    except CheckpointError as e:
        assert "'extra'" in str(e) and "neither a tensor nor JSON data" in str(e), str(e)
    try:
        h.wait()
        raise AssertionError("wait() did not raise the planning error")
    except CheckpointError:
        pass
    rows = 4 if ctx.rank == 0 else 6  # rank 1 claims a different global shape
    sw = ShardedWeight("m", good[ctx.rank * 2:(ctx.rank + 1) * 2].clone(), (2, 4), (rows + 4, 4), (ctx.rank * 2, 0))
    h = async_save({"m": sw}, ctx.root / "bad-shape")
    try:
        h.wait_staged()
        raise AssertionError("disagreeing global shapes did not fail the save")
    except CheckpointError as e:
        assert "'m'" in str(e), str(e)
    assert not (ctx.root / "bad-leaf").exists() and not (ctx.root / "bad-shape").exists()
    h = async_save({"w": good}, ctx.root / "ok")
    h.wait()
    _full_equal(ctx.root / "ok", {"w": good})
    dist.barrier()
