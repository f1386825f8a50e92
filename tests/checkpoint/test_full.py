"""Online merge (full_state_dict) on 4 gloo ranks: DTensors on a 2x2 mesh, uneven and flattened shards,
replicas, rank0_only, and an AOA-style program; references are the full tensors built from the same seed."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from oarlock.checkpoint import ShardedWeight
from oarlock.checkpoint.full import full_state_dict
from oarlock.checkpoint.mapping import SliceMapping, TensorSpec

WORLD = 4


def reference():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(8, 6, generator=g), "b": torch.randn(10, 7, generator=g).to(torch.bfloat16),
            "c": torch.arange(30, dtype=torch.int64).view(2, 3, 5), "s": torch.tensor(3.5)}


def _worker(rank, port, q):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        ref = reference()
        mesh = init_device_mesh("cpu", (2, 2))
        a = distribute_tensor(ref["a"], mesh, [Shard(0), Shard(1)])
        # b: uneven rows over 4 ranks (3,3,3,1)
        rows = [3, 3, 3, 1]
        off = sum(rows[:rank])
        b = ShardedWeight("b", ref["b"][off:off + rows[rank]].clone(), (rows[rank], 7), (10, 7), (off, 0))
        # c: flattened ZeRO-style ranges of the row-major flattening (ranges cut rows mid-way)
        cuts = [0, 7, 8, 23, 30]
        flat = ref["c"].reshape(-1)[cuts[rank]:cuts[rank + 1]].clone()
        c = ShardedWeight("c", flat, (2, 3, 5), (2, 3, 5), (0, 0, 0), (cuts[rank], cuts[rank + 1]))
        s = distribute_tensor(ref["s"].view(1), mesh, [Replicate(), Replicate()])
        sd = {"a": a, "b": b, "c": c, "s": s}
        got = {k: v.clone() for k, v in full_state_dict(sd)}
        ok = set(got) == {"a", "b", "c", "s"} and all(torch.equal(got[k].view(-1), ref[k].view(-1)) for k in got)
        ok &= got["b"].dtype == torch.bfloat16 and got["a"].shape == (8, 6)
        got0 = {k: v.clone() for k, v in full_state_dict(sd, rank0_only=True)}
        ok &= (set(got0) == ({"a", "b", "c", "s"} if rank == 0 else set()))
        if rank == 0:
            ok &= all(torch.equal(got0[k].view(-1), ref[k].view(-1)) for k in got0)
        q.put((rank, bool(ok)))
    except Exception as e:  # report, don't hang the parent
        q.put((rank, repr(e)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.multiproc
def test_full_state_dict_four_ranks():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, q)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=300) for _ in range(WORLD))
    for p in procs:
        p.join(60)
    assert results == {r: True for r in range(WORLD)}


def test_single_process_identity_yields_live_tensors():
    w = torch.randn(3, 4)
    out = dict(full_state_dict({"model": {"w": w}, "b": ShardedWeight.replicated("b", torch.ones(2))}))
    assert out["model.w"].data_ptr() == w.data_ptr() and torch.equal(out["model.w"], w)  # no copy
    assert torch.equal(out["b"], torch.ones(2))
