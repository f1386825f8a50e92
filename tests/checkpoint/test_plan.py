"""The pure load planner: no files, no processes. Plans are executed on in-memory slices of a full tensor and
compared with plain torch slicing (or, for mapping programs, with mapping.execute_on_full_tensors)."""

import itertools
import random
from pathlib import Path

import pytest
import torch

from oarlock.checkpoint import CheckpointMismatchError, CheckpointTilingError, ShardDesc, plan_load
from oarlock.checkpoint.runtime.executor import destination_view, execute_items
from oarlock.checkpoint.model.mapping import box_slices, execute_on_full_tensors, full_box
from oarlock.checkpoint.model.metadata import CheckpointMetadata, ShardMeta, TensorMeta
from oarlock.checkpoint.formats.reader import CheckpointReader
from oarlock.checkpoint.model.sharded import flat_range_boxes
from oarlock.utils import torch_dtype
from testkit import TransposeSplit


def split_points(n, k, rng):
    """k pieces of [0, n) with random (possibly empty) sizes."""
    cuts = sorted(rng.randint(0, n) for _ in range(k - 1))
    pts = [0, *cuts, n]
    return list(zip(pts, pts[1:]))


def grid_meta(key, shape, parts, rng, dtype="float32", flatten=False):
    """Metadata for ``shape`` cut into a grid with ``parts[d]`` pieces per dim; optionally every box stored as
    two flattened halves (a non-grid layout)."""
    t = TensorMeta(key, tuple(shape), dtype)
    axes = [split_points(n, k, rng) for n, k in zip(shape, parts)]
    for i, cell in enumerate(itertools.product(*axes)):
        off = tuple(a for a, _ in cell)
        ext = tuple(b - a for a, b in cell)
        n = 1
        for e in ext:
            n *= e
        if flatten and n > 1:
            m = rng.randint(1, n - 1)
            t.shards.append(ShardMeta(off, ext, f"f{i}a", f"{key}@{i}a", (0, m)))
            t.shards.append(ShardMeta(off, ext, f"f{i}b", f"{key}@{i}b", (m, n)))
        else:
            t.shards.append(ShardMeta(off, ext, f"f{i}", f"{key}@{i}"))
    return t


def stored_arrays(meta, fulls):
    """What the files would hold: file -> 1-D or box-shaped tensor, from the full tensors."""
    out = {}
    for key, t in meta.tensors.items():
        for s in t.shards:
            box = fulls[key][tuple(slice(o, o + n) for o, n in zip(s.global_offset, s.local_shape))]
            out[(s.file, s.name)] = box.reshape(-1)[s.flattened_range[0]:s.flattened_range[1]] \
                if s.flattened_range else box
    return out


class ArrayReader(CheckpointReader):
    """Stored arrays in memory behind the reader protocol, so plans run through the production executor."""

    def __init__(self, meta, arrays):
        super().__init__(Path("."), meta)
        self.arrays = arrays

    def read_box(self, key, file, name, flat_start, shape, box, out=None):
        n = 1
        for s in shape:
            n *= s
        t = self.arrays[(file, name)].reshape(-1)[flat_start:flat_start + n].reshape(shape)[box_slices(box)]
        return t.clone() if out is None else out.copy_(t)


def execute(plan, meta, target, arrays):
    """Run a plan with the loader's executor on in-memory arrays; counts writes per target element."""
    execute_items(ArrayReader(meta, arrays), target, plan.items)
    hits = torch.zeros(target.shape, dtype=torch.int32)
    for it in plan.items:
        destination_view(it, hits).add_(1)
    return hits


@pytest.mark.parametrize("flatten_src", [False, True])
def test_random_layouts_match_torch_slicing(flatten_src):
    rng = random.Random(1234 + flatten_src)
    for trial in range(60):
        nd = rng.randint(0, 3)
        shape = tuple(rng.randint(0, 7) for _ in range(nd))
        meta = CheckpointMetadata("oarlock")
        meta.tensors["w"] = grid_meta("w", shape, [rng.randint(1, 3) for _ in shape], rng, flatten=flatten_src)
        full = torch.randn(shape)
        arrays = stored_arrays(meta, {"w": full})
        # requests: a random grid of target boxes, some of them flattened
        reqs = {}
        for r, cell in enumerate(itertools.product(*[split_points(n, rng.randint(1, 3), rng) for n in shape])):
            off = tuple(a for a, _ in cell)
            ext = tuple(b - a for a, b in cell)
            n = 1
            for e in ext:
                n *= e
            fr = None
            if n > 1 and rng.random() < 0.3:
                a = rng.randint(0, n - 1)
                fr = (a, rng.randint(a, n))
            reqs[r] = [ShardDesc("w", ext, shape, off, "float32", fr)]
        plans = plan_load(meta, reqs)
        for r, (req,) in reqs.items():
            expect = full[tuple(slice(o, o + n) for o, n in zip(req.global_offset, req.local_shape))]
            if req.flattened_range:
                expect = expect.reshape(-1)[req.flattened_range[0]:req.flattened_range[1]]
            got = torch.full_like(expect, float("nan"))
            hits = execute(plans[r], meta, got, arrays)
            assert torch.equal(got, expect), (trial, shape, req)
            assert bool((hits == 1).all()), (trial, "every element written exactly once")


def test_flat_range_boxes_cover_the_range_in_order():
    rng = random.Random(7)
    for _ in range(200):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 4)))
        n = int(torch.tensor(shape).prod()) if shape else 1
        a = rng.randint(0, n)
        b = rng.randint(a, n)
        idx = torch.arange(n).reshape(shape)
        pieces = flat_range_boxes(shape, a, b)
        assert len(pieces) <= max(1, 2 * len(shape) - 1)
        got = torch.cat([idx[tuple(slice(o, o + e) for o, e in zip(off, ext))].reshape(-1) for off, ext, _ in pieces]) \
            if pieces else torch.empty(0, dtype=torch.long)
        assert torch.equal(got, torch.arange(a, b)), (shape, a, b)
        assert [fs for _, _, fs in pieces] == [int(x) for x in torch.tensor(
            [0] + [int(torch.tensor(e).prod()) for _, e, _ in pieces[:-1]]).cumsum(0)] if pieces else True


def test_program_with_transpose_split_and_cast():
    rng = random.Random(3)
    meta = CheckpointMetadata("oarlock")
    meta.tensors["w"] = grid_meta("w", (4, 6), [2, 3], rng)
    full = torch.randn(4, 6)
    ref = execute_on_full_tensors(TransposeSplit(), {"w": full})
    arrays = stored_arrays(meta, {"w": full})
    reqs = {0: [ShardDesc("a", (2, 4), (3, 4), (0, 0), "float32"), ShardDesc("b", (4, 2), (4, 3), (0, 1), "float64")],
            1: [ShardDesc("a", (1, 3), (3, 4), (2, 1), "float32"), ShardDesc("b", (3, 1), (4, 3), (1, 0), "float64")]}
    plans = plan_load(meta, reqs, TransposeSplit())
    for r, rq in reqs.items():
        for req in rq:
            expect = ref[req.key][tuple(slice(o, o + n) for o, n in zip(req.global_offset, req.local_shape))]
            got = torch.zeros(req.local_shape, dtype=torch_dtype(req.dtype))
            items = [it for it in plans[r].items if it.dst_key == req.key]
            from oarlock.checkpoint.planning.load import LoadPlan
            hits = execute(LoadPlan(items), meta, got, arrays)
            assert torch.equal(got, expect) and bool((hits == 1).all())
    assert any(it.permute == (1, 0) for it in plans[0].items)
    assert all(it.dtype == "float64" for it in plans[0].items if it.dst_key == "b")


def _meta(*shards, shape=(10, 4)):
    meta = CheckpointMetadata("oarlock")
    meta.tensors["w"] = TensorMeta("w", shape, "float32", [ShardMeta(o, s, f"f{i}", "w") for i, (o, s) in
                                                           enumerate(shards)])
    return meta


@pytest.mark.parametrize("shards,needle", [
    ([((0, 0), (3, 4)), ((2, 0), (8, 4))], "overlap in box [2:3, 0:4]"),
    ([((0, 0), (3, 4)), ((4, 0), (6, 4))], "gap: box [3:4, 0:4]"),
    ([((0, 0), (10, 2))], "gap: box [0:10, 2:4]"),
    ([((0, 0), (10, 3)), ((0, 2), (5, 2)), ((5, 3), (5, 1))], "overlap in box [0:5, 2:3]"),  # not a grid
    ([((0, 0), (10, 3)), ((5, 3), (5, 1))], "gap: box [0:5, 3:4]"),
    ([((0, 0), (11, 4))], "outside the global shape [10, 4]"),
])
def test_tiling_errors_name_key_and_box(shards, needle):
    with pytest.raises(CheckpointTilingError) as e:
        plan_load(_meta(*shards), [ShardDesc("w", (10, 4), (10, 4), (0, 0), "float32")])
    assert "'w'" in str(e.value) and needle in str(e.value), str(e.value)


def test_shape_and_dtype_mismatch_messages():
    meta = _meta(((0, 0), (10, 4)))
    with pytest.raises(CheckpointMismatchError) as e:
        plan_load(meta, [ShardDesc("w", (4, 10), (4, 10), (0, 0), "float32")])
    msg = str(e.value)
    assert "'w'" in msg and "[4, 10]" in msg and "[10, 4]" in msg and "AOA" in msg
    with pytest.raises(CheckpointMismatchError) as e:
        plan_load(meta, [ShardDesc("w", (10, 4), (10, 4), (0, 0), "bfloat16")])
    msg = str(e.value)
    assert "'w'" in msg and "float32" in msg and "bfloat16" in msg and "dtype=" in msg


def test_missing_keys_zero_size_and_scalars():
    meta = _meta(((0, 0), (10, 4)))
    meta.tensors["s"] = TensorMeta("s", (), "int64", [ShardMeta((), (), "f9", "s")])
    meta.tensors["z"] = TensorMeta("z", (0, 3), "float32", [])
    plan = plan_load(meta, [ShardDesc("nope", (1,), (1,), (0,), "float32"),
                            ShardDesc("s", (), (), (), "int64"),
                            ShardDesc("z", (0, 3), (0, 3), (0, 0), "float32"),
                            ShardDesc("w", (0, 4), (10, 4), (3, 0), "float32")])
    assert plan.missing_keys == ["nope"]
    assert [(it.dst_key, it.src_box, it.dst_box) for it in plan.items] == [("s", (), ())]


def test_plan_scales_with_an_index():
    """20,000 stored row shards of one key against 256 requested row blocks: every block meets exactly its own
    shards (benchmarks/checkpoint_reshard.py times the 100,000-shard case)."""
    n = 20_000
    meta = CheckpointMetadata("oarlock")
    meta.tensors["w"] = TensorMeta("w", (n, 2), "float32", [ShardMeta((i, 0), (1, 2), f"f{i % 64}", f"w{i}")
                                                            for i in range(n)])
    rows = split_points(n, 256, random.Random(0))
    reqs = {r: [ShardDesc("w", (b - a, 2), (n, 2), (a, 0), "float32")] for r, (a, b) in enumerate(rows)}
    plans = plan_load(meta, reqs)
    assert sum(len(p.items) for p in plans.values()) == n
    a, b = rows[100]
    assert sorted(it.name for it in plans[100].items) == sorted(f"w{i}" for i in range(a, b))
