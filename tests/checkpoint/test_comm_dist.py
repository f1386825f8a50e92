"""Distributed data movement on 4 gloo ranks (one launch): node-local files read once and shipped by grouped
send/recv or broadcast, a rank that sees no file, warm restart from replicas with no communication, async save.
The scenarios live in _comm_scenarios.py (one pytest test each, named after the scenario); the checks that need
no processes are here."""

import pytest
import torch

from multirank import each_scenario, launch_fixture
from oarlock.checkpoint import CheckpointError, load_state_dict, save_state_dict
from oarlock.checkpoint.lifecycle.async_save import AsyncSaveHandle

launched = launch_fixture("_comm_scenarios", worlds=(4,), timeout_s=300)


@pytest.mark.multiproc
@each_scenario("_comm_scenarios", worlds=(4,))
def test_four_ranks_node_local_warm_async(launched, world, scenario):
    launched.check(scenario, world)


def test_unknown_comm_method(tmp_path):
    save_state_dict({"a": torch.ones(3)}, tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"comm_method='ring'.*'auto', 'grouped_send_recv', 'broadcast'"):
        load_state_dict({"a": torch.zeros(3)}, tmp_path / "c", comm_method="ring")


def test_single_process_warm_and_async(tmp_path):
    sd = {"a": torch.arange(6.0).reshape(2, 3), "n": 5}
    h = save_state_dict(sd, tmp_path / "c", async_save=True)
    assert isinstance(h, AsyncSaveHandle)
    h.wait_staged()
    sd["a"].add_(100)  # after the snapshot: not in the checkpoint
    h.wait()
    got = {"a": torch.zeros(2, 3), "n": 0}
    rep = load_state_dict(got, tmp_path / "c")
    assert rep.comm_method == "warm" and rep.files_read == ["rank-00000.safetensors"]
    assert torch.equal(got["a"], torch.arange(6.0).reshape(2, 3)) and got["n"] == 5
    # a different request (a slice) is not a warm restart
    from oarlock.checkpoint import ShardedWeight

    part = ShardedWeight("a", torch.zeros(1, 3), (1, 3), (2, 3), (1, 0))
    rep = load_state_dict({"a": part, "n": 0}, tmp_path / "c")
    assert rep.comm_method == "direct" and torch.equal(part.local_tensor, torch.tensor([[3.0, 4.0, 5.0]]))
