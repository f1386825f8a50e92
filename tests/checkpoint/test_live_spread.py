"""Live resharding from replicated sources: the sender is chosen per requested slice, balanced by bytes over the
holders (a big slice in row ranges, one per holder; a holder that is also a receiver copies its own), on 4 gloo
ranks in one launch (_live_spread_scenarios.py); the spreading helpers in one process."""

import pytest
import torch

from multirank import each_scenario, launch_fixture
from oarlock.checkpoint.planning.load import ReadItem
from oarlock.checkpoint.runtime.live_plan import split_rows

launched = launch_fixture("_live_spread_scenarios", worlds=(4,), timeout_s=300)


@pytest.mark.multiproc
@each_scenario("_live_spread_scenarios", worlds=(4,))
def test_live_spread_four_ranks(launched, world, scenario):
    launched.check(scenario, world)


def test_split_rows_cuts_source_and_destination_alike():
    it = ReadItem("t", 0, (8, 6), ((2, 8), (0, 5)), "s", "rank-00000.safetensors", "s", 0, (10, 6), ((1, 6), (0, 6)),
                  (1, 0), None)  # target dim 0 comes from source dim 1 (a transpose)
    parts = split_rows(it, 2)
    assert [p.src_box for p in parts] == [((1, 3), (0, 6)), ((3, 6), (0, 6))]
    assert [p.dst_box for p in parts] == [((2, 8), (0, 2)), ((2, 8), (2, 5))]
    assert sum(p.numel for p in parts) == it.numel
    assert split_rows(it, 7) is None  # no dim of 7 elements or more
    W = torch.arange(60.).reshape(10, 6)
    out = torch.zeros(8, 6)
    for p in parts:  # placing the parts gives the whole item's placement
        s = W[tuple(slice(a, b) for a, b in p.src_box)].permute(1, 0)
        out[tuple(slice(a, b) for a, b in p.dst_box)] = s
    assert torch.equal(out[2:8, 0:5], W[1:6, 0:6].t())
