"""Scenarios for test_hostile.py, run on 4 gloo ranks by the ``multirank`` fixture (issue 21 item 7: one rank
fails, every rank raises). Every rank holds rows ``[2r, 2r + 2)`` of an ``8 x 8`` weight, so each rank writes
and, restarting in the same layout, reads only its own data file."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from multirank import raised

from oarlock.checkpoint import CheckpointError, ShardedWeight, load_state_dict, save_state_dict
from oarlock.checkpoint.storage.safetensors import SafetensorsFile

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


def _read_for_another_rank(ctx, damage) -> str:
    """Node-local disks (each rank's directory holds ``metadata.json`` and only its own data file): rank 0 loads
    the whole weight, ranks 1-3 only rows [0, 2) (rank 0's file), so rank 2 reads its file only to ship its rows
    to rank 0 and its own load checks nothing of it. ``damage`` spoils that file; every rank must raise naming it
    and leave its target as it was."""
    from multirank import link_files

    save_state_dict(_state(ctx.rank), ctx.root / "ck")
    dist.barrier()
    node = link_files(ctx.root / "ck", ctx.root / f"node{ctx.rank}", [f"rank-{ctx.rank:05d}.safetensors",
                                                                      "metadata.json"])
    if ctx.rank == 2:
        damage(node / "rank-00002.safetensors")
    dist.barrier()
    target = {"w": torch.full((8, 8), -1.0)} if ctx.rank == 0 else \
        {"w": ShardedWeight("w", torch.full((ROWS, 8), -1.0), (ROWS, 8), (8, 8), (0, 0))}
    before = {k: (v.local_tensor if isinstance(v, ShardedWeight) else v).clone() for k, v in target.items()}
    e = raised(lambda: load_state_dict(target, node))
    assert isinstance(e, CheckpointError), f"{type(e).__name__}: {e}"
    assert "rank-00002.safetensors" in str(e), str(e)
    assert str(e).startswith("rank 2: ") == (ctx.rank != 2), str(e)
    for k, v in target.items():  # nothing written on any rank (rank 0's rows of file 0 included)
        assert torch.equal(v.local_tensor if isinstance(v, ShardedWeight) else v, before[k]), k
    return str(e)


def scenario_truncated_file_read_for_another_rank_fails_before_any_write(ctx):
    msg = _read_for_another_rank(ctx, lambda f: os.truncate(f, os.path.getsize(f) - 10))
    assert "the file has only" in msg and "truncated" in msg, msg


def scenario_corrupt_file_read_for_another_rank_fails_its_checksum(ctx):
    def flip(f):  # one byte of the data section, the file's size unchanged
        with open(f, "r+b") as fh:
            fh.seek(-3, os.SEEK_END)
            b = fh.read(1)
            fh.seek(-3, os.SEEK_END)
            fh.write(bytes([b[0] ^ 0xFF]))

    msg = _read_for_another_rank(ctx, flip)
    assert "checksum mismatch" in msg and "nothing was loaded" in msg, msg
