"""Sharded save/load across layouts on 4 gloo ranks (one launch), against torch.distributed.checkpoint.

The rank body lives in _dist_worker.py. Here, in the parent process: world 1 -> 4 (the parent saves whole
tensors first) and 4 -> 1 (the parent loads what the 4 ranks saved), and `oarlock inspect` on the result.
"""

import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import _dist_worker as W
from multirank import run_scenarios
from oarlock.checkpoint import load_state_dict, open_checkpoint, save_state_dict
from oarlock.cli import main

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    plain = {name: (None, None) for name in W.TENSORS}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_state_dict(W.build(plain, 0, zeros=False), root / "oar_w1")
        dcp.save(W.build(plain, 0, zeros=False), checkpoint_id=str(root / "dcp_w1"))
    outcome = run_scenarios("_dist_worker", 4, root)
    return root, outcome


def test_four_ranks_all_layouts(launched):
    """Every scenario of _dist_worker.py (A->B, A->A, 1->4 against DCP; bytes read; uneven and flattened
    ShardedWeights; TP2 on a 2-rank subgroup -> TP4; a module with DTensor parameters; replica spreading;
    overlap/gap errors; one rank failing mid-save) passed on every rank."""
    launched[1].check()


def test_four_to_one(launched):
    plain = {name: (None, None) for name in W.TENSORS}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, ref = W.build(plain, 0, zeros=True), W.build(plain, 0, zeros=True)
        report = load_state_dict(got, launched[0] / "oar")
        dcp.load(ref, checkpoint_id=str(launched[0] / "dcp"))
    assert report.missing_keys == report.unexpected_keys == []
    assert W.check_same("4->1", got, ref) == len(W.TENSORS)
    assert got["epoch"] == 7


def test_saved_layout_and_inspect(launched, capsys):
    launched = launched[0]
    with open_checkpoint(launched / "oar") as r:
        meta = r.metadata
    # replicas written once: the stored shards of each key tile it exactly once
    for name, (shape, dtype, _) in W.TENSORS.items():
        t = meta.tensors[name]
        assert t.global_shape == shape and sum(s.numel for s in t.shards) == int(torch.tensor(shape).prod())
    w = meta.tensors["mesh22.w"]
    assert sorted(s.global_offset for s in w.shards) == [(0, 0), (0, 12), (16, 0), (16, 12)]
    assert main(["inspect", str(launched / "oar")]) == 0
    text = capsys.readouterr().out
    for s in w.shards:
        assert (f"shard offset={list(s.global_offset)} local_shape={list(s.local_shape)} file={s.file}") in text
    assert main(["inspect", str(launched / "oar"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["objects"]["epoch"] == 7
    u = next(t for t in out["tensors"] if t["key"] == "uneven.w")
    assert [s["local_shape"] for s in u["shards"]] == [[3, 7], [3, 7], [3, 7], [1, 7]]
