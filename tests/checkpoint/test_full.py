"""Online merge (full_state_dict) on 4 gloo ranks: DTensors on a 2x2 mesh, uneven and flattened shards,
replicas, rank0_only, and an AOA-style program; references are the full tensors built from the same seed."""

import pytest
import torch

from oarlock.checkpoint import ShardedWeight
from oarlock.checkpoint.convert.full import full_state_dict
from oarlock.checkpoint.model.mapping import SliceMapping, TensorSpec

WORLD = 4


def reference():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(8, 6, generator=g), "b": torch.randn(10, 7, generator=g).to(torch.bfloat16),
            "c": torch.arange(30, dtype=torch.int64).view(2, 3, 5), "s": torch.tensor(3.5)}


def _sharded(rank):
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
    return ref, {"a": a, "b": b, "c": c, "s": s}


def scenario_every_rank_gets_every_full_tensor(ctx):
    ref, sd = _sharded(ctx.rank)
    got = {k: v.clone() for k, v in full_state_dict(sd)}
    assert set(got) == {"a", "b", "c", "s"}, sorted(got)
    for k in got:
        assert torch.equal(got[k].view(-1), ref[k].view(-1)), k
    assert got["b"].dtype == torch.bfloat16 and got["a"].shape == (8, 6)


def scenario_rank0_only(ctx):
    ref, sd = _sharded(ctx.rank)
    got0 = {k: v.clone() for k, v in full_state_dict(sd, rank0_only=True)}
    assert set(got0) == ({"a", "b", "c", "s"} if ctx.rank == 0 else set()), sorted(got0)
    for k in got0:
        assert torch.equal(got0[k].view(-1), ref[k].view(-1)), k


@pytest.mark.multiproc
def test_full_state_dict_four_ranks(multirank):
    multirank("test_full", WORLD).check()


def test_single_process_identity_yields_live_tensors():
    w = torch.randn(3, 4)
    out = dict(full_state_dict({"model": {"w": w}, "b": ShardedWeight.replicated("b", torch.ones(2))}))
    assert out["model.w"].data_ptr() == w.data_ptr() and torch.equal(out["model.w"], w)  # no copy
    assert torch.equal(out["b"], torch.ones(2))
