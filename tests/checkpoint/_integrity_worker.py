"""Rank body of the 4-rank checksum test (launched by test_integrity.py with gloo on CPU): each rank loads its
row shard of ``w``; only rank 2's rows hold the corrupt block. Each rank records what it raised."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from oarlock.checkpoint import ShardedWeight, load_state_dict

ROWS, COLS = 2048, 4096  # float32: 8 MiB of rows per rank, two 4 MiB blocks


def run(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        n = ROWS // world
        local = torch.zeros(n, COLS)
        sw = ShardedWeight("w", local, (n, COLS), (ROWS, COLS), (rank * n, 0))
        out = {"rank": rank}
        try:
            load_state_dict({"w": sw}, Path(root) / "ck")
            out["error"] = None
        except Exception as e:  # recorded for the parent to compare across ranks
            out["error"] = [type(e).__name__, str(e)]
        out["untouched"] = bool((local == 0).all())
        (Path(root) / f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def manager_run(rank: int, world: int, port: int, root: str) -> None:
    """Two ranks: sharded rows + a per-rank RNG through CheckpointManager (sync and async saves, keep_last=2),
    then a fresh manager resumes each rank's own rows and RNG stream."""
    import random

    from oarlock.checkpoint import CheckpointManager, RNGState

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict = {"rank": rank}
    try:
        n = 4
        torch.manual_seed(100 + rank)
        random.seed(100 + rank)
        m = CheckpointManager(Path(root) / "ck", keep_last=2)
        for step in (1, 2, 3):
            local = torch.full((n, 3), float(10 * step + rank))
            sw = ShardedWeight("w", local, (n, 3), (n * world, 3), (rank * n, 0))
            m.save(step, {"w": sw, "rng": RNGState(), "step": step}, async_save=step == 3)
        m.wait()
        out["expect_torch"] = torch.rand(3).tolist()  # the streams right after the last save
        out["expect_py"] = random.random()
        torch.manual_seed(0)
        random.seed(0)
        got = torch.zeros(n, 3)
        state = {"w": ShardedWeight("w", got, (n, 3), (n * world, 3), (rank * n, 0)), "rng": RNGState(), "step": None}
        out["step"] = CheckpointManager(Path(root) / "ck", keep_last=2).load_latest(state)
        out["rows_ok"] = bool((got == float(30 + rank)).all())
        out["torch"] = torch.rand(3).tolist()
        out["py"] = random.random()
        out["loaded_step"] = state["step"]
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        (Path(root) / f"mgr{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()
