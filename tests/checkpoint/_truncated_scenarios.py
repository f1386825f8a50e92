"""Scenarios for test_truncated_load.py (issue 48 item 6), on 2 gloo ranks: a checkpoint saved by both ranks (one
data file each, rank r holding rows ``[8r, 8r + 8)`` of a ``16 x 16`` weight ``w`` and half of a 16-element bias
``b``), whose second data file is then truncated by 10 bytes. Every load, in any layout, must raise on every rank
naming ``rank-00001.safetensors`` with both byte counts and leave every target element as it was."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from multirank import raised, worlds

from oarlock.checkpoint import CheckpointError, ShardedWeight, load_state_dict, save_state_dict

N = 16
HALF = N // 2
SENTINEL = -7.0
CUT = 10


def source() -> dict[str, torch.Tensor]:
    """The saved values: distinct in every element, so that any element written into a target shows."""
    return {"w": torch.arange(N * N, dtype=torch.float32).reshape(N, N), "b": torch.arange(N, dtype=torch.float32)}


def rank_state(rank: int) -> dict[str, ShardedWeight]:
    """Rank ``rank``'s shards as saved: its row block of ``w`` and its half of ``b``."""
    src = source()
    rows = slice(HALF * rank, HALF * rank + HALF)
    return {"w": ShardedWeight("w", src["w"][rows].clone(), (HALF, N), (N, N), (HALF * rank, 0)),
            "b": ShardedWeight("b", src["b"][rows].clone(), (HALF,), (N,), (HALF * rank,))}


def targets(layout: str, rank: int, world: int) -> dict:
    """Targets filled with :data:`SENTINEL`: ``"same"`` the saved layout (each rank reads its own file only),
    ``"columns"`` column blocks of ``w`` (every rank reads both files), ``"whole"`` whole tensors on every rank."""
    if layout == "whole":
        return {"w": torch.full((N, N), SENTINEL), "b": torch.full((N,), SENTINEL)}
    if layout == "same":
        rows = (HALF, N)
        return {"w": ShardedWeight("w", torch.full(rows, SENTINEL), rows, (N, N), (HALF * rank, 0)),
                "b": ShardedWeight("b", torch.full((HALF,), SENTINEL), (HALF,), (N,), (HALF * rank,))}
    cols = N // world
    return {"w": ShardedWeight("w", torch.full((N, cols), SENTINEL), (N, cols), (N, N), (0, cols * rank)),
            "b": torch.full((N,), SENTINEL)}


def target_tensors(state: dict) -> dict[str, torch.Tensor]:
    return {k: v.local_tensor if isinstance(v, ShardedWeight) else v for k, v in state.items()}


def truncate_second_file(ck) -> int:
    """Cut :data:`CUT` bytes off ``rank-00001.safetensors``; returns its size before."""
    f = ck / "rank-00001.safetensors"
    size = os.path.getsize(f)
    os.truncate(f, size - CUT)
    return size


def check_refused(e: BaseException, ck, size: int) -> str:
    """``e`` is a CheckpointError naming the truncated file with the size its header says and the size it has."""
    assert isinstance(e, CheckpointError), f"{type(e).__name__}: {e}"
    msg = str(e)
    assert str(ck / "rank-00001.safetensors") in msg, msg
    assert f"run to byte {size}," in msg and f"has only {size - CUT} bytes" in msg and "truncated" in msg, msg
    return msg


@worlds(2)
def scenario_save_two_files(ctx):
    """The checkpoint the one-process test loads (``ctx.shared / "two"``), left whole."""
    save_state_dict(rank_state(ctx.rank), ctx.shared / "two")


@worlds(2)
def scenario_truncated_second_file_fails_every_rank_before_any_write(ctx):
    ck = ctx.root / "ck"
    save_state_dict(rank_state(ctx.rank), ck)
    dist.barrier()
    size = truncate_second_file(ck) if ctx.rank == 0 else 0
    size = [size]
    dist.broadcast_object_list(size, 0)
    messages = []
    for layout in ("same", "columns", "whole"):
        for verify in (True, False, "overlap"):
            state = targets(layout, ctx.rank, ctx.world)
            e = raised(lambda: load_state_dict(state, ck, verify_checksums=verify))
            messages.append(check_refused(e, ck, size[0]))
            for k, t in target_tensors(state).items():  # nothing written on any rank
                assert bool((t == SENTINEL).all()), (layout, verify, k, t)
    return messages
