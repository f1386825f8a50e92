"""Scenarios of the multi-process checkpoint tests, run on 4 gloo ranks by test_save_load_dist.py through the
``multirank`` harness (tests/multirank.py): a failure names the scenario and the rank, with its traceback.

Every scenario saves one layout and loads another, with oarlock and with torch.distributed.checkpoint (DCP) as
the independent reference; loaded local tensors must be bit-identical to DCP's and to the slice of the full
tensor. Tensors are generated from fixed seeds on every rank, so the parent process can rebuild them.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from oarlock.checkpoint import (CheckpointError, CheckpointTilingError, ShardedWeight, load_state_dict,
                                open_checkpoint, save_state_dict, sharded_state_dict)
from testkit import seeded_tensor

warnings.filterwarnings("ignore")

# name -> (shape, dtype, seed)
TENSORS = {
    "tp2_tp4.w": ((16, 12), torch.float32, 1),
    "tp2_tp4.b": ((16,), torch.bfloat16, 2),
    "tp4_tp1.w": ((8, 12), torch.float32, 3),
    "dp2tp2_tp4.w": ((12, 8), torch.float16, 4),
    "mesh22.w": ((32, 24), torch.float32, 5),
    "mesh22.idx": ((8, 6), torch.int64, 6),
    "uneven.w": ((10, 7), torch.float32, 7),
    "uneven2.w": ((10, 7), torch.bfloat16, 8),
    "scalar.f": ((), torch.float32, 9),
    "scalar.i": ((), torch.int64, 10),
    "optim.state.0.exp_avg": ((16, 12), torch.float32, 11),
    "optim.state.0.step": ((), torch.float32, 12),
}


def full(name: str) -> torch.Tensor:
    return seeded_tensor(*TENSORS[name])


def layouts(mesh4, mesh22):
    """name -> ((source mesh, placements), (target mesh, placements)); None = plain (replicated) tensor."""
    return {
        "tp2_tp4.w": ((mesh22, [Replicate(), Shard(0)]), (mesh4, [Shard(0)])),
        "tp2_tp4.b": ((mesh22, [Replicate(), Shard(0)]), (mesh4, [Shard(0)])),
        "tp4_tp1.w": ((mesh4, [Shard(1)]), (mesh4, [Replicate()])),
        "dp2tp2_tp4.w": ((mesh22, [Replicate(), Shard(1)]), (mesh4, [Shard(0)])),
        "mesh22.w": ((mesh22, [Shard(0), Shard(1)]), (mesh22, [Shard(1), Replicate()])),
        "mesh22.idx": ((mesh22, [Shard(0), Shard(1)]), (mesh22, [Shard(1), Replicate()])),
        "uneven.w": ((mesh4, [Shard(0)]), (mesh4, [Shard(1)])),  # rows 3,3,3,1 -> cols 2,2,2,1
        "uneven2.w": ((mesh22, [Shard(0), Shard(0)]), (mesh22, [Shard(1), Shard(0)])),  # 2 mesh dims on dim 0
        "scalar.f": (None, None),
        "scalar.i": (None, None),
        "optim.state.0.exp_avg": ((mesh22, [Shard(1), Shard(0)]), (mesh4, [Shard(1)])),
        "optim.state.0.step": (None, None),
    }


def make(name, layout, zeros=False):
    t = full(name)
    if zeros:
        t = torch.zeros_like(t)
    if layout is None:
        return t
    mesh, pl = layout
    return distribute_tensor(t, mesh, pl)


def build(lay, side, zeros):
    """Nested state dict: keys with dots become nested dicts (optim.state.0 uses an int key, like torch)."""
    sd: dict = {"param_groups": [{"lr": 0.0 if zeros else 0.1, "params": [0]}], "epoch": 0 if zeros else 7}
    for name in TENSORS:
        node = sd
        parts = name.split(".")
        for p in parts[:-1]:
            node = node.setdefault(int(p) if p.isdigit() else p, {})
        node[parts[-1]] = make(name, lay[name][side], zeros)
    return sd


def leaves(sd, prefix=""):
    for k, v in sd.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from leaves(v, key + ".")
        else:
            yield key, v


def local_of(v):
    return v.to_local() if isinstance(v, DTensor) else v


def expected_local(name, v):
    f = full(name)
    if not isinstance(v, DTensor):
        return f
    shape, off = compute_local_shape_and_global_offset(f.shape, v.device_mesh, v.placements)
    return f[tuple(slice(o, o + n) for o, n in zip(off, shape))]


def check_same(tag, got_sd, ref_sd):
    ref = dict(leaves(ref_sd))
    n = 0
    for key, v in leaves(got_sd):
        r = ref[key]
        if isinstance(v, torch.Tensor):
            a, b = local_of(v), local_of(r)
            assert a.dtype == b.dtype and a.shape == b.shape, (tag, key, a.dtype, b.dtype, a.shape, b.shape)
            assert torch.equal(a, b), (tag, key, "differs from DCP")
            assert torch.equal(a, expected_local(key, v)), (tag, key, "differs from the full tensor's slice")
            n += 1
        else:
            assert v == r, (tag, key, v, r)
    return n


_MESHES: dict = {}


def _meshes():
    if not _MESHES:  # one pair of meshes per rank process, shared by the scenarios
        _MESHES["mesh4"], _MESHES["mesh22"] = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
    return _MESHES["mesh4"], _MESHES["mesh22"]


def _layouts():
    return layouts(*_meshes())


def scenario_layout_a_to_b_matches_dcp(ctx):
    """Save layout A with oarlock and DCP into ctx.shared (the parent's tests read it too), load layout B, A
    again, and the parent's one-process save; each rank reads only the bytes of its own boxes."""
    lay, rank, root = _layouts(), ctx.rank, ctx.shared
    src = build(lay, 0, zeros=False)
    save_state_dict(src, root / "oar")
    dcp.save(src, checkpoint_id=str(root / "dcp"))
    dist.barrier()
    tgt_o, tgt_d = build(lay, 1, zeros=True), build(lay, 1, zeros=True)
    report = load_state_dict(tgt_o, root / "oar")
    dcp.load(tgt_d, checkpoint_id=str(root / "dcp"))
    assert report.missing_keys == [] and report.unexpected_keys == []
    assert tgt_o["epoch"] == 7 and tgt_o["param_groups"] == [{"lr": 0.1, "params": [0]}]
    assert check_same("A->B", tgt_o, tgt_d) == len(TENSORS)

    # same layout back (A -> A)
    tgt_o, tgt_d = build(lay, 0, zeros=True), build(lay, 0, zeros=True)
    load_state_dict(tgt_o, root / "oar")
    dcp.load(tgt_d, checkpoint_id=str(root / "dcp"))
    check_same("A->A", tgt_o, tgt_d)

    # world 1 -> 4: the parent saved whole tensors in one process (oarlock and DCP)
    tgt_o, tgt_d = build(lay, 1, zeros=True), build(lay, 1, zeros=True)
    load_state_dict(tgt_o, root / "oar_w1")
    dcp.load(tgt_d, checkpoint_id=str(root / "dcp_w1"))
    check_same("w1->w4", tgt_o, tgt_d)

    # each rank read only byte ranges of its own boxes: bytes read == bytes of its target shards
    tgt_o = build(lay, 1, zeros=True)
    report = load_state_dict(tgt_o, root / "oar")
    own = sum(local_of(v).numel() * local_of(v).element_size() for _, v in leaves(tgt_o) if isinstance(v, torch.Tensor))
    assert report.bytes_read == own, (report.bytes_read, own)


def scenario_uneven_and_flattened_shards(ctx):
    """Uneven ShardedWeights along an axis (sizes all-gathered) -> another uneven split, a flattened target,
    and flattened shards saved (ZeRO flat buffers) -> regular uneven rows."""
    rank, root = ctx.rank, ctx.root
    f = torch.arange(30, dtype=torch.float32).reshape(10, 3)
    sizes_a, sizes_b = [1, 2, 3, 4], [4, 3, 0, 3]  # rank 2 holds an empty shard on load
    a0 = sum(sizes_a[:rank])
    sw = ShardedWeight.shard_along_axis("sw", f[a0:a0 + sizes_a[rank]].clone(), 0)
    assert sw.global_shape == (10, 3) and sw.global_offset == (a0, 0)
    save_state_dict({"sw": sw}, root / "sw")
    b0 = sum(sizes_b[:rank])
    tw = ShardedWeight.shard_along_axis("sw", torch.zeros(sizes_b[rank], 3), 0, sizes=sizes_b)
    load_state_dict({"sw": tw}, root / "sw")
    assert torch.equal(tw.local_tensor, f[b0:b0 + sizes_b[rank]])
    bounds = [0, 7, 8, 21, 30]
    fl = ShardedWeight("sw", torch.zeros(bounds[rank + 1] - bounds[rank]), (10, 3), (10, 3), (0, 0),
                       flattened_range=slice(bounds[rank], bounds[rank + 1]))
    load_state_dict({"sw": fl}, root / "sw")
    assert torch.equal(fl.local_tensor, f.reshape(-1)[bounds[rank]:bounds[rank + 1]])
    fsave = ShardedWeight("flat", f.reshape(-1)[bounds[rank]:bounds[rank + 1]].clone(), (10, 3), (10, 3), (0, 0),
                          flattened_range=(bounds[rank], bounds[rank + 1]))
    save_state_dict({"flat": fsave}, root / "flat")
    tw = ShardedWeight.shard_along_axis("flat", torch.zeros(sizes_b[rank], 3), 0, sizes=sizes_b)
    load_state_dict({"flat": tw}, root / "flat")
    assert torch.equal(tw.local_tensor, f[b0:b0 + sizes_b[rank]])


def scenario_tp2_subgroup_to_tp4(ctx):
    """Pure TP2 on a 2-rank subgroup (ranks 0, 1 save alone) -> TP4 over the world."""
    rank, root = ctx.rank, ctx.root
    g01 = dist.new_group([0, 1])
    tp = torch.arange(8 * 6, dtype=torch.float64).reshape(8, 6)
    if rank < 2:
        sw = ShardedWeight.shard_along_axis("tp", tp[:, 3 * rank:3 * rank + 3].clone(), 1, process_group=g01)
        save_state_dict({"tp": sw, "step": 4}, root / "tp2", process_group=g01)
    dist.barrier()
    sw = ShardedWeight.shard_along_axis("tp", torch.zeros(2, 6, dtype=torch.float64), 0)
    got = {"tp": sw, "step": 0}
    load_state_dict(got, root / "tp2")
    assert torch.equal(sw.local_tensor, tp[2 * rank:2 * rank + 2]) and got["step"] == 4
    assert sorted(p.name for p in (root / "tp2").iterdir()) == [".oarlock-files", "metadata.json", "rank-00000.safetensors",
                                                                "rank-00000.safetensors.xxh3", "rank-00001.safetensors",
                                                                "rank-00001.safetensors.xxh3"]


def scenario_module_with_dtensor_parameters(ctx):
    """sharded_state_dict of a module with DTensor parameters, loaded into other placements."""
    rank, root = ctx.rank, ctx.root
    mesh4, mesh22 = _meshes()
    torch.manual_seed(0)
    lin = torch.nn.Linear(7, 10)  # same initial values on every rank
    ref_w, ref_b = lin.weight.detach().clone(), lin.bias.detach().clone()
    lin.weight = torch.nn.Parameter(distribute_tensor(ref_w.clone(), mesh4, [Shard(0)]))  # rows 3,3,3,1
    lin.bias = torch.nn.Parameter(distribute_tensor(ref_b.clone(), mesh4, [Replicate()]))
    ssd = sharded_state_dict(lin)
    assert ssd["weight"].local_shape == ((3, 7) if rank < 3 else (1, 7)) and ssd["weight"].global_offset == (3 * rank, 0)
    assert ssd["bias"].global_offset == (0,) and ssd["bias"].local_shape == (10,)
    save_state_dict(ssd, root / "mod")
    lin2 = torch.nn.Linear(7, 10)
    lin2.weight = torch.nn.Parameter(distribute_tensor(torch.zeros(10, 7), mesh22, [Shard(1), Replicate()]))
    lin2.bias = torch.nn.Parameter(distribute_tensor(torch.zeros(10), mesh22, [Shard(0), Shard(0)]))
    load_state_dict(sharded_state_dict(lin2), root / "mod")
    assert torch.equal(lin2.weight.full_tensor(), ref_w) and torch.equal(lin2.bias.full_tensor(), ref_b)


def scenario_replicas_written_once_and_spread(ctx):
    rep = {f"rep{i}": torch.full((64, 64), float(i)) for i in range(8)}
    save_state_dict(rep, ctx.root / "rep")
    with open_checkpoint(ctx.root / "rep") as r:
        per_file = {}
        for t in r.metadata.tensors.values():
            assert len(t.shards) == 1
            per_file[t.shards[0].file] = per_file.get(t.shards[0].file, 0) + 1
    assert sorted(per_file.values()) == [2, 2, 2, 2], per_file


def scenario_overlap_and_gap_raise_on_every_rank(ctx):
    """Validation on save: overlapping and gapped boxes name the key and the box, on every rank."""
    rank, root = ctx.rank, ctx.root
    rows = [(0, 3), (2, 5), (5, 8), (8, 10)]  # rank 0 and 1 overlap in rows 2:3
    a, b = rows[rank]
    bad = ShardedWeight("ov", torch.zeros(b - a, 4), (b - a, 4), (10, 4), (a, 0))
    try:
        save_state_dict({"ov": bad}, root / "bad")
        raise AssertionError("overlap not detected")
    except CheckpointTilingError as e:
        assert "'ov'" in str(e) and "overlap" in str(e) and "[2:3, 0:4]" in str(e), str(e)
    rows = [(0, 3), (3, 5), (6, 8), (8, 10)]  # row 5 is missing
    a, b = rows[rank]
    bad = ShardedWeight("gap", torch.zeros(b - a, 4), (b - a, 4), (10, 4), (a, 0))
    try:
        save_state_dict({"gap": bad}, root / "bad")
        raise AssertionError("gap not detected")
    except CheckpointTilingError as e:
        assert "'gap'" in str(e) and "gap" in str(e) and "[5:6, 0:4]" in str(e), str(e)
    assert not (root / "bad").exists()


def scenario_rank_failing_mid_write_publishes_nothing(ctx):
    """Rank 2 fails mid-write: every rank raises, nothing appears, the earlier 'oar' stays intact."""
    import oarlock.checkpoint.runtime.save as save_module  # the save pipeline writes through save.write_safetensors

    lay, rank, root = _layouts(), ctx.rank, ctx.root
    real = save_module.write_safetensors

    def failing(path, tensors, **kw):
        if rank == 2:
            Path(path).write_bytes(b"partial")
            raise OSError(28, "No space left on device")
        return real(path, tensors, **kw)

    save_module.write_safetensors = failing
    try:
        save_state_dict(build(lay, 0, zeros=False), root / "crash")
        raise AssertionError("failure not reported")
    except CheckpointError as e:
        assert "No space left on device" in str(e) and ("rank 2" in str(e) or rank == 2), str(e)
    finally:
        save_module.write_safetensors = real
    dist.barrier()
    assert not (root / "crash").exists()
    assert not [p for p in root.iterdir() if ".tmp-" in p.name], list(root.iterdir())
    tgt_o = build(lay, 1, zeros=True)
    load_state_dict(tgt_o, ctx.shared / "oar")
    check_same("after crash", tgt_o, build_ref(lay, ctx.shared))


def build_ref(lay, root):
    ref = build(lay, 1, zeros=True)
    dcp.load(ref, checkpoint_id=str(root / "dcp"))
    return ref
