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
