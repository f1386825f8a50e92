"""Multi-rank scenarios of test_integrity.py (4 ranks) and test_manager.py (2 ranks), run by the multirank harness.

* 4 ranks, checksums: the parent saved ``ck`` (``ROWS x COLS`` float32) into ``ctx.shared`` and flipped one byte
  in rank 2's rows (``corrupt.json`` gives the file, offset and block); each rank loads its row shard of ``w``.
* 2 ranks, CheckpointManager: sharded rows + a per-rank RNG (sync and async saves, keep_last=2), then a fresh
  manager resumes each rank's own rows and RNG stream.
"""

from __future__ import annotations

import json
import random
import re

import torch
import torch.distributed as dist

from multirank import worlds
from oarlock.checkpoint import CheckpointManager, RNGState, ShardedWeight, load_state_dict
from oarlock.checkpoint.integrity import ChecksumError

ROWS, COLS = 2048, 4096  # float32: 8 MiB of rows per rank, two 4 MiB blocks


@worlds(4)
def scenario_one_rank_reads_the_corrupt_block_all_fail_alike(ctx):
    """Only rank 2 reads the corrupt block; every rank raises the same ChecksumError (the others prefixed
    "rank 2: "), naming the file, the key and the block; no rank's destination is written."""
    bad = json.loads((ctx.shared / "corrupt.json").read_text())
    n = ROWS // ctx.world
    local = torch.zeros(n, COLS)
    sw = ShardedWeight("w", local, (n, COLS), (ROWS, COLS), (ctx.rank * n, 0))
    try:
        load_state_dict({"w": sw}, ctx.shared / "ck")
        raise AssertionError("the flipped byte was not caught")
    except ChecksumError as e:
        msg = str(e)
    assert bool((local == 0).all()), "the destination was written"
    every = [None] * ctx.world
    dist.all_gather_object(every, msg)
    core = [re.sub(r"^rank 2: ", "", m) for m in every]
    assert len(set(core)) == 1, ("ranks raised different errors", every)
    assert every[2] == core[0], ("the rank that read the block must name it itself", every[2])
    assert bad["file"] in core[0] and "key 'w'" in core[0] and f"(block {bad['block']})" in core[0], core[0]
    return msg


@worlds(2)
def scenario_manager_sharded_rows_and_per_rank_rng(ctx):
    """Three saves (the third async) of rows + RNG + step, keep_last=2; a fresh manager resumes step 3, each
    rank's own rows, and each rank's torch and Python random streams where they were right after the last save."""
    n, world, rank = 4, ctx.world, ctx.rank
    torch.manual_seed(100 + rank)
    random.seed(100 + rank)
    m = CheckpointManager(ctx.root / "ck", keep_last=2)
    for step in (1, 2, 3):
        local = torch.full((n, 3), float(10 * step + rank))
        sw = ShardedWeight("w", local, (n, 3), (n * world, 3), (rank * n, 0))
        m.save(step, {"w": sw, "rng": RNGState(), "step": step}, async_save=step == 3)
    m.wait()
    expect_torch = torch.rand(3)  # the streams right after the last save
    expect_py = random.random()
    torch.manual_seed(0)
    random.seed(0)
    got = torch.zeros(n, 3)
    state = {"w": ShardedWeight("w", got, (n, 3), (n * world, 3), (rank * n, 0)), "rng": RNGState(), "step": None}
    assert CheckpointManager(ctx.root / "ck", keep_last=2).load_latest(state) == 3
    assert state["step"] == 3, state["step"]
    assert torch.equal(got, torch.full((n, 3), float(30 + rank))), got  # this rank's rows of the last save
    now_torch, now_py = torch.rand(3), random.random()
    assert torch.equal(now_torch, expect_torch), ("torch stream not resumed", now_torch, expect_torch)
    assert now_py == expect_py, ("python stream not resumed", now_py, expect_py)
    streams = [None] * world
    dist.all_gather_object(streams, now_torch.tolist())
    assert streams[0] != streams[1], "both ranks resumed the same torch stream"
    assert CheckpointManager(ctx.root / "ck").steps() == [2, 3]
