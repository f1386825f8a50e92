"""Scenarios for test_hostile.py, run on 4 gloo ranks by the ``multirank`` fixture (issue 21 item 7: one rank
fails, every rank raises). Every rank holds rows ``[2r, 2r + 2)`` of an ``8 x 8`` weight, so each rank writes
and, restarting in the same layout, reads only its own data file."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from multirank import raised

from oarlock.checkpoint import CheckpointError, ShardedWeight, load_state_dict, save_state_dict
from oarlock.checkpoint.safetensors_io import SafetensorsFile

ROWS = 2


def _state(rank: int, zeros: bool = False) -> dict:
    full = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    local = torch.zeros(ROWS, 8) if zeros else full[ROWS * rank:ROWS * rank + ROWS].clone()
    return {"w": ShardedWeight("w", local, (ROWS, 8), (8, 8), (ROWS * rank, 0))}


def scenario_one_truncated_file_fails_every_rank(ctx):
    save_state_dict(_state(ctx.rank), ctx.root / "ck")
    dist.barrier()
    bad = ctx.root / "ck" / "rank-00002.safetensors"
    if ctx.rank == 0:
        os.truncate(bad, os.path.getsize(bad) - 8)
    dist.barrier()
    target = _state(ctx.rank, zeros=True)
    e = raised(lambda: load_state_dict(target, ctx.root / "ck"))
    assert isinstance(e, CheckpointError), f"{type(e).__name__}: {e}"
    assert "rank-00002.safetensors" in str(e), str(e)
    assert torch.equal(target["w"].local_tensor, torch.zeros(ROWS, 8))  # nothing written on any rank
    return str(e)


def scenario_one_rank_read_error_fails_every_rank(ctx):
    save_state_dict(_state(ctx.rank), ctx.root / "ck")
    if ctx.rank == 2:  # the disk fails under this rank's read only, after every check passed
        def failing(self, *a, **k):
            raise OSError(5, "Input/output error", str(self.path))
        SafetensorsFile.read_box = failing
    target = _state(ctx.rank, zeros=True)
    e = raised(lambda: load_state_dict(target, ctx.root / "ck"))
    assert isinstance(e, CheckpointError), f"{type(e).__name__}: {e}"
    assert "Input/output error" in str(e) and (ctx.rank == 2 or str(e).startswith("rank 2: ")), str(e)
    return str(e)
