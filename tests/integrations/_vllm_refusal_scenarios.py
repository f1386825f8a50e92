"""Scenarios of test_vllm_refusal.py on 2 gloo ranks (the trainer ranks of a sync; the default group is the
trainer's own, as under torchrun), without vLLM: how a refusal reaches every trainer rank at once."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from oarlock.checkpoint import CheckpointError, join_group
from oarlock.integrations.vllm import _join_watching, _recv_go, _send_go, _trainer_side_channel


def shared_port(ctx) -> int:
    port = [None]
    if ctx.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    dist.broadcast_object_list(port, src=0)
    return port[0]


def scenario_engine_fails_before_its_workers_join(ctx):
    """Rank 0's init request to the engine fails (say the engine was built without weight_transfer_config) while
    both trainer ranks wait in the rendezvous for the engine's worker (rank 2 of 3, who never comes): both ranks
    raise that error within seconds, rank 1 through the trainer's default group, not at the 60 s timeout."""
    port = shared_port(ctx)

    def engine_init():
        time.sleep(0.5)
        raise RuntimeError("Weight transfer not configured. Please set weight_transfer_config to enable weight "
                           "transfer.")

    side = _trainer_side_channel(2, ctx.rank)
    assert side is not None
    exe = ThreadPoolExecutor(max_workers=1)
    init = exe.submit(engine_init) if ctx.rank == 0 else None
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="init_weight_transfer_engine failed before its workers joined the "
                                              "sync group: RuntimeError: Weight transfer not configured"):
        _join_watching(lambda: join_group("127.0.0.1", port, 3, ctx.rank, timeout=60), init, side, 60)
    assert time.monotonic() - t0 < 20
    exe.shutdown(wait=False)


def scenario_rank_zero_tells_the_others_a_round_was_refused(ctx):
    """Before each round rank 0 tells the other trainer ranks whether the engine started it, or why not."""
    port = shared_port(ctx)
    group = join_group("127.0.0.1", port, 2, ctx.rank, timeout=60)
    try:
        for word in ["", "RuntimeError: start_weight_update called while a weight update is already active", ""]:
            if ctx.rank == 0:
                _send_go(group, 2, word)
            else:
                assert _recv_go(group) == word
    finally:
        group.close()
