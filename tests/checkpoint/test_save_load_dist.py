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


_RELEASE_SCRIPT = '''
import gc, importlib, os, sys, weakref
import torch, torch.distributed as dist, torch.multiprocessing as mp


def worker(rank, port, root):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from oarlock.checkpoint import ShardedWeight, load_state_dict, save_state_dict
    # the module (the package's attribute async_save is the function)
    asy = importlib.import_module("oarlock.checkpoint.lifecycle.async_save")
    full = torch.arange(24.0).reshape(6, 4)
    sd = {"w": ShardedWeight("w", full[rank * 3:rank * 3 + 3].clone(), (3, 4), (6, 4), (rank * 3, 0)), "step": 7}
    save_state_dict(sd, root + "/async", async_save=True).wait()
    save_state_dict(sd, root + "/sync")
    save_state_dict(sd, root + "/sync", overwrite=True)  # the plan cache's second save
    out = {"w": ShardedWeight("w", torch.zeros(3, 4), (3, 4), (6, 4), (rank * 3, 0)), "step": 0}
    load_state_dict(out, root + "/sync")
    assert torch.equal(out["w"].local_tensor, full[rank * 3:rank * 3 + 3]) and out["step"] == 7
    world = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    print(f"rank {rank}: world freed {world() is None}, side groups {len(asy._side_groups)}, "
          f"torch.distributed.nn imported {'torch.distributed.nn' in sys.modules}", flush=True)


if __name__ == "__main__":
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(worker, args=(port, sys.argv[1]), nprocs=2)
'''


def test_destroy_process_group_frees_the_group_after_saves_and_loads(tmp_path):
    """After oarlock's saves (sync, async, a reused plan) and a load, ``destroy_process_group()`` frees the default
    group: nothing of oarlock keeps it (or the async side group) alive. A kept gloo group runs its threads into
    interpreter finalization, where freeing a finished collective's tensor needs the GIL and aborts the process
    ("terminate called without an active exception"): a user's 2-rank script died so about 1 run in 5, because
    checking for torch's ShardedTensor imported ``torch.distributed.nn`` (default arguments ``group=group.WORLD``)."""
    import subprocess
    import sys

    script = tmp_path / "release.py"
    script.write_text(_RELEASE_SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    for rank in (0, 1):
        assert (f"rank {rank}: world freed True, side groups 0, torch.distributed.nn imported False"
                in r.stdout), r.stdout


_DESTROY_DURING_SAVE = '''
import importlib, os, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp


def worker(rank, port, root):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from oarlock.checkpoint import ShardedWeight, save_state_dict
    asy = importlib.import_module("oarlock.checkpoint.lifecycle.async_save")
    real = asy.write_and_commit

    def late(*a, **k):  # the write starts after the script destroyed the group (a slow disk, a big state)
        time.sleep(1.0)
        return real(*a, **k)

    asy.write_and_commit = late
    full = torch.arange(24.0).reshape(6, 4)
    sd = {"w": ShardedWeight("w", full[rank * 3:rank * 3 + 3].clone(), (3, 4), (6, 4), (rank * 3, 0))}
    h = save_state_dict(sd, root + "/ckpt", async_save=True)
    h.wait_staged()
    dist.destroy_process_group()  # no h.wait(): the script's mistake
    try:
        h.wait()
        print(f"rank {rank}: committed", flush=True)
    except Exception as e:
        print(f"rank {rank}: failed {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(worker, args=(port, sys.argv[1]), nprocs=2)
'''


def test_an_async_save_outliving_its_group_fails_and_commits_nothing(tmp_path):
    """An async save whose process group is destroyed before its write runs fails on every rank, naming the cause,
    and publishes nothing: it must never carry on as a one-rank save (a fresh user's script committed a
    metadata.json naming rank 1's file, which rank 0's writer, alone, never waited for)."""
    import subprocess
    import sys

    from oarlock.checkpoint import CheckpointError

    script = tmp_path / "destroy.py"
    script.write_text(_DESTROY_DURING_SAVE)
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: failed" in r.stdout and "process group" in r.stdout, r.stdout
    with pytest.raises(CheckpointError):
        load_state_dict({"w": torch.zeros(6, 4)}, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / "metadata.json").exists()
