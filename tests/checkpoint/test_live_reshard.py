"""Live resharding (reshard_state_dict / WeightSync) between the ranks of one job, on 4 gloo ranks in one launch:
20+ layout pairs checked against the dense reference and a load through a checkpoint, byte accounting, balance
of replicated senders, errors before any byte moves, verify, plan reuse. The scenarios live in
_live_scenarios.py; single-process checks are here."""

import pytest
import torch

from multirank import each_scenario, launch_fixture
from oarlock.checkpoint import (CheckpointError, CheckpointMismatchError, ShardedWeight, WeightSync,
                                reshard_state_dict)
from oarlock.checkpoint.runtime.transfer import Segment, cut_stream

launched = launch_fixture("_live_scenarios", worlds=(4,), timeout_s=300)


@pytest.mark.multiproc
@each_scenario("_live_scenarios", worlds=(4,))
def test_live_reshard_four_ranks(launched, world, scenario):
    launched.check(scenario, world)


def test_one_process_rename_transpose_cast():
    W = torch.randn(6, 4)
    tgt = {"b.weight": torch.zeros(4, 6, dtype=torch.bfloat16)}
    rep = reshard_state_dict({"a.weight": W}, tgt,
                             aoa_config=["a.weight -> t, permute='[1, 0]'", "t -> b.weight, dtype='bfloat16'"])
    assert torch.equal(tgt["b.weight"], W.t().bfloat16())
    assert rep.bytes_received == rep.bytes_local == 4 * 6 * 2 and rep.messages_sent == 0


def test_one_process_flat_range_target():
    W = torch.arange(20.).reshape(4, 5)
    flat = torch.zeros(7)
    tgt = {"w": ShardedWeight("w", flat, (4, 5), (4, 5), (0, 0), flattened_range=(6, 13))}
    reshard_state_dict({"w": W}, tgt)
    assert torch.equal(flat, W.reshape(-1)[6:13])


def test_dtype_mismatch_names_key_and_leaves_target():
    tgt = {"w": torch.full((3,), 5.0, dtype=torch.float16)}
    with pytest.raises(CheckpointMismatchError, match="'w'.*dtype="):
        reshard_state_dict({"w": torch.ones(3)}, tgt)
    assert bool((tgt["w"] == 5).all())


def test_bad_bucket_bytes():
    with pytest.raises(CheckpointError, match="bucket_bytes"):
        WeightSync({}, {}, bucket_bytes=0)
    for bad in ("65536", 65536.9, True):
        with pytest.raises(CheckpointError, match="bucket_bytes must be a positive int"):
            WeightSync({}, {}, bucket_bytes=bad)


def test_cut_stream_cuts_both_ends_alike():
    # slices of 5, 1 and 9 bytes in chunks of 4: the stream's bytes in order, slices straddling chunks
    chunks = cut_stream([5, 1, 9], 4)
    assert chunks == [[Segment(0, 0, 4, 0)], [Segment(0, 4, 5, 0), Segment(1, 0, 1, 1), Segment(2, 0, 2, 2)],
                      [Segment(2, 2, 6, 0)], [Segment(2, 6, 9, 0)]]
    assert sum(sg.stop - sg.start for c in chunks for sg in c) == 15


def test_cut_stream_big_slices_travel_alone():
    # a 10-byte slice (>= alone=8) gets chunks of its own; the small ones around it are packed
    chunks = cut_stream([2, 10, 3, 1], 4, alone=8)
    assert chunks == [[Segment(0, 0, 2, 0)], [Segment(1, 0, 4, 0)], [Segment(1, 4, 8, 0)], [Segment(1, 8, 10, 0)],
                      [Segment(2, 0, 3, 0), Segment(3, 0, 1, 3)]]
