"""Scenarios for test_multirank.py: what the harness reports when a scenario passes, fails on one rank, skips,
runs past its time limit, or its rank process dies."""

import os
import time

import torch.distributed as dist

from multirank import needs, timeout, worlds


def scenario_passes_and_returns(ctx):
    got = [None] * ctx.world
    dist.all_gather_object(got, ctx.rank * 10)
    return {"rank": ctx.rank, "gathered": got, "shared": ctx.root.parent == ctx.shared}


def scenario_fails_on_rank_1(ctx):
    assert ctx.rank != 1, f"rank {ctx.rank} sees value {41 + ctx.rank}, wanted 41"


def scenario_skips(ctx):
    import pytest

    pytest.skip("nothing to check here")


@needs("passes_and_returns")
def scenario_after_a_failure_still_runs(ctx):
    return ctx.name


@worlds(3)
def scenario_only_at_world_3(ctx):
    raise AssertionError("must not run at world 2")


@timeout(3)
def scenario_hangs_on_rank_0(ctx):
    if ctx.rank == 0:
        time.sleep(600)


def scenario_never_reached(ctx):
    return "ran"


def scenario_rank_1_dies(ctx):
    if ctx.rank == 1:
        os._exit(3)
    dist.barrier()  # rank 0 waits for the dead rank until the parent stops it


def scenario_leaves_a_child_process(ctx):
    """A library's worker process that would outlive the rank (and hold the launcher's pipes open)."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
    child.start()
    return child.pid
