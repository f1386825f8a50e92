"""Distributed data movement on 4 gloo ranks (one launch): node-local files read once and shipped by grouped
send/recv or broadcast, a rank that sees no file, warm restart from replicas with no communication, async save.
The rank body lives in _comm_worker.py; the checks that need no processes are here."""

import socket

import pytest
import torch
import torch.multiprocessing as mp

import _comm_worker as W
from oarlock.checkpoint import CheckpointError, load_state_dict, save_state_dict
from oarlock.checkpoint.async_save import AsyncSaveHandle


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiproc
def test_four_ranks_node_local_warm_async(tmp_path):
    """Every scenario of _comm_worker.py; reaching here means every rank passed its assertions."""
    mp.start_processes(W.run, args=(4, _free_port(), str(tmp_path)), nprocs=4, start_method="spawn", join=True)
    assert (tmp_path / "async2" / "metadata.json").is_file()


def test_unknown_comm_method(tmp_path):
    save_state_dict({"a": torch.ones(3)}, tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"comm_method='ring'.*'auto', 'grouped_send_recv', 'broadcast'"):
        load_state_dict({"a": torch.zeros(3)}, tmp_path / "c", comm_method="ring")


def test_single_process_warm_and_async(tmp_path):
    sd = {"a": torch.arange(6.0).reshape(2, 3), "n": 5}
    h = save_state_dict(sd, tmp_path / "c", async_save=True)
    assert isinstance(h, AsyncSaveHandle)
    sd["a"].add_(100)  # after the call: not in the checkpoint
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
