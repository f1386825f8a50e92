"""Grid records (issue 26): the same shards described by a grid rule and listed one by one give identical read
plans, over random meshes, placements, uneven extents, flat ranges and replicas; hostile records are refused.

The listed form is built independently of the grid code: boxes from torch's own DTensor box rule
(``compute_local_shape_and_global_offset`` on a fake mesh) or ``torch.chunk``, writers by brute force over the
mesh coordinates."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oarlock.checkpoint.errors import CheckpointError, CheckpointFormatError
from oarlock.checkpoint.model.grid import FlatGrid, GridLayout, compress_flat, compress_shards, data_file_name
from oarlock.checkpoint.model.metadata import CheckpointMetadata, ShardMeta, TensorMeta
from oarlock.checkpoint.planning.load import Planner
from oarlock.checkpoint.model.sharded import FlatPartition, ShardDesc, ShardedWeight


def chunk_extents(length: int, counts: list[int]) -> list[tuple[int, int]]:
    """Nested torch.chunk pieces of range(length), from torch itself (empty trailing pieces kept)."""
    pieces = [torch.arange(length)]
    out_ranges = [(0, length)]
    for n in counts:
        nxt = []
        for (a, b), t in zip(out_ranges, pieces):
            parts = list(t.chunk(n)) if t.numel() else []
            for i in range(n):
                if i < len(parts):
                    p = parts[i]
                    nxt.append(((int(p[0]), int(p[-1]) + 1), p))
                else:
                    nxt.append(((b, b), t[:0]))
        out_ranges = [r for r, _ in nxt]
        pieces = [p for _, p in nxt]
    return out_ranges


def listed_from_mesh(shape, mesh_shape, placements, rank_of, key):
    """Every holder's box by brute force over the mesh; the writer of each box is the holder the grid's rule
    must pick (checked separately): here every holder is returned."""
    holders: dict[tuple, list[int]] = {}
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        box = []
        for d, L in enumerate(shape):
            levels = [(k, mesh_shape[k]) for k, p in enumerate(placements) if p == ("S", d)]
            ext = chunk_extents(L, [n for _, n in levels])
            idx = 0
            for k, n in levels:
                idx = idx * n + coord[k]
            box.append(ext[idx])
        if all(b > a for a, b in box) or not box:
            holders.setdefault(tuple(box), []).append(rank_of(coord))
    return holders


@st.composite
def layouts(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 13)) for _ in range(ndim))
    mdim = draw(st.integers(1, 3))
    mesh_shape = tuple(draw(st.integers(1, 4)) for _ in range(mdim))
    placements = tuple(draw(st.one_of(st.just(("R",)), st.tuples(st.just("S"), st.integers(0, ndim - 1))))
                       for _ in range(mdim))
    return shape, mesh_shape, placements


def _plan_bytes(meta, requests, compact=False):
    planner = Planner(meta)
    items = planner.plan_rank(requests, compact=compact).all_items()
    return sorted((it.dst_key, it.dst_flat_start, it.dst_box, it.file, it.name, it.src_flat_start, it.src_shape,
                   it.src_box) for it in items)


def _requests(shape, boxes, key="w"):
    return [ShardDesc(key, tuple(b - a for a, b in box), tuple(shape), tuple(a for a, _ in box), "float32")
            for box in boxes]


@settings(max_examples=150, deadline=None)
@given(layouts(), layouts(), st.integers(0, 2**31))
def test_grid_and_listed_give_identical_reads(src, dst, seed):
    shape, mesh_shape, placements = src
    strides = [math.prod(mesh_shape[k + 1:]) for k in range(len(mesh_shape))]
    rank_of = lambda c: sum(a * s for a, s in zip(c, strides))  # noqa: E731
    grid = GridLayout.from_placements(shape, mesh_shape, placements, key="w")
    holders = listed_from_mesh(shape, mesh_shape, placements, rank_of, "w")
    # the grid's cells are exactly the non-empty boxes, each written by one of its holders
    cells = {tuple((o, o + n) for o, n in zip(off, ext)): grid.writer(c) for c, off, ext in grid.cells(shape)}
    assert set(cells) == set(holders)
    for box, w in cells.items():
        assert w in holders[box], (box, w, holders[box])
    listed = [ShardMeta(tuple(a for a, _ in box), tuple(b - a for a, b in box), data_file_name(w), "w")
              for box, w in cells.items()]
    meta_l = CheckpointMetadata("oarlock", {"w": TensorMeta("w", shape, "float32", listed)})
    meta_g = CheckpointMetadata("oarlock", {"w": TensorMeta("w", shape, "float32", grid=grid)})
    # the grid survives the JSON round trip, and the listed form materialised from it is the same list
    back = CheckpointMetadata.from_json(json.loads(meta_g.dumps()))
    assert back.tensors["w"].grid == grid
    assert sorted(back.tensors["w"].shards, key=lambda s: s.global_offset) == sorted(listed, key=lambda s: s.global_offset)
    # requests of another layout: every target box of the destination mesh
    dshape_mesh, dpl = dst[1], dst[2]
    dholders = listed_from_mesh(shape, dshape_mesh, [p if p == ("R",) or p[1] < len(shape) else ("R",) for p in dpl],
                                lambda c: 0, "w")
    reqs = _requests(shape, list(dholders))
    a, b = _plan_bytes(meta_l, reqs), _plan_bytes(meta_g, reqs)
    assert a == b
    # the compact plan (templates shared by keys, made file by file at scale) holds the same reads
    assert _plan_bytes(meta_g, reqs, compact=True) == a
    # every requested element is read exactly once
    assert sum(math.prod(y - x for x, y in it[7]) for it in b) == sum(math.prod(r.local_shape) for r in reqs)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=3), st.integers(1, 40), st.integers(0, 60),
       st.integers(1, 8))
def test_flat_ranges_of_an_even_split_compress_and_plan_alike(shape, part, offset, nranks_hint):
    """A parameter at ``offset`` in a flat buffer split into ``part``-element partitions (ZeRO): its per-rank
    flat ranges, listed, compress into one flat record that plans the same reads."""
    shape = tuple(shape)
    n = math.prod(shape)
    listed = []
    r0 = offset // part
    r = r0
    while r * part < offset + n:
        a, b = max(r * part, offset) - offset, min((r + 1) * part, offset + n) - offset
        if b > a:
            listed.append(ShardMeta((0,) * len(shape), shape, data_file_name(r), "w", (a, b)))
        r += 1
    g = compress_flat(shape, listed, "w")
    assert g is not None and g.count(n) == len(listed)
    # the rule a rank makes alone from its FlatPartition is the one compressed from every rank's ranges
    mine, j0 = FlatGrid.of_partition(n, offset, part)
    assert j0 == r0 and mine.count(n) == g.count(n)  # (one shard: any step describes it)
    assert all((mine.shard(n, i), mine.writer(i)) == (g.shard(n, i), g.writer(i)) for i in range(g.count(n)))
    for q in range(r0 + len(listed) + 2):
        got = FlatPartition(offset, part, q).span(n)
        want = next((s.flattened_range for s in listed if s.file == data_file_name(q)), None)
        assert (got if got[1] > got[0] else None) == want, (q, got, want)
    meta_l = CheckpointMetadata("oarlock", {"w": TensorMeta("w", shape, "float32", listed)})
    text = CheckpointMetadata("oarlock", {"w": TensorMeta("w", shape, "float32", listed)}).dumps()
    assert '"flat"' in text and '"shards"' not in text
    meta_g = CheckpointMetadata.from_json(json.loads(text))
    assert meta_g.tensors["w"].shards == listed
    reqs = _requests(shape, [tuple((0, s) for s in shape)])
    half = [tuple((0, s) if d else (0, max(1, s // 2)) for d, s in enumerate(shape))]
    for rq in (reqs, _requests(shape, half)):
        assert _plan_bytes(meta_l, rq) == _plan_bytes(meta_g, rq)


def test_a_flat_partition_that_disagrees_with_the_range_is_refused_naming_the_key():
    """Partition 1 of 10-element partitions holds elements [6, 16) of a tensor starting at element 4."""
    ok = ShardedWeight("m", torch.zeros(10), (4, 5), (4, 5), (0, 0), (6, 16), flat_partition=FlatPartition(4, 10, 1))
    assert ok.flat_partition.span(20) == (6, 16)
    with pytest.raises(CheckpointError, match=r"'m'.*flattened_range \(5, 15\) is not partition 1.*\(6, 16\)"):
        ShardedWeight("m", torch.zeros(10), (4, 5), (4, 5), (0, 0), (5, 15), flat_partition=FlatPartition(4, 10, 1))
    with pytest.raises(CheckpointError, match="'m'.*needs a flattened_range"):
        ShardedWeight("m", torch.zeros(4, 5), (4, 5), (4, 5), (0, 0), flat_partition=FlatPartition(4, 10, 1))
    with pytest.raises(CheckpointError, match="'m'.*partition_size >= 1"):
        ShardedWeight("m", torch.zeros(0), (4, 5), (4, 5), (0, 0), (0, 0), flat_partition=FlatPartition(4, 0, 1))


def test_compress_refuses_what_is_not_a_grid():
    w = lambda off, shape, r, name="w": ShardMeta(off, shape, data_file_name(r), name)  # noqa: E731
    # rows 0:3, 3:10 is not a torch.chunk split
    assert compress_shards((10, 4), [w((0, 0), (3, 4), 0), w((3, 0), (7, 4), 1)], "w") is None
    # another name in the file
    assert compress_shards((10, 4), [w((0, 0), (5, 4), 0, "w@0"), w((5, 0), (5, 4), 1)], "w") is None
    # writers 0, 5, 1: not affine
    sh = [w((0, 0), (4, 4), 0), w((4, 0), (4, 4), 5), w((8, 0), (2, 4), 1)]
    assert compress_shards((10, 4), sh, "w") is None
    # a regular one is
    sh = [w((0, 0), (4, 4), 3), w((4, 0), (4, 4), 5), w((8, 0), (2, 4), 7)]
    assert compress_shards((10, 4), sh, "w") == GridLayout(((3,), ()), 3, (2,))


@pytest.mark.parametrize("record,why", [
    ({"chunks": [[4]], "writers": {"base": 0, "strides": [1]}}, "entries for a 2-D tensor"),
    ({"chunks": [[0], []], "writers": {"base": 0, "strides": [1]}}, "positive integers"),
    ({"chunks": [[4], []], "writers": {"base": -1, "strides": [1]}}, "must be a rank"),
    ({"chunks": [[4], []], "writers": {"base": 2, "strides": [-1]}}, "outside"),
    ({"chunks": [[4], []], "writers": {"base": 0, "strides": [1, 2]}}, "one per chunk level"),
    ({"chunks": [[2 ** 21], []], "writers": {"base": 0, "strides": [1]}}, "cells in one dimension"),
    ({"chunks": [[2], []], "writers": {"base": 0, "strides": ["1"]}}, "one per chunk level"),
])
def test_hostile_grid_records_are_refused_naming_the_key(tmp_path, record, why):
    meta = {"format": "oarlock.flexcheckpoint", "version": 2,
            "tensors": {"w": {"global_shape": [8, 3], "dtype": "float32", "grid": record}}}
    with pytest.raises(CheckpointFormatError) as e:
        CheckpointMetadata.from_json(meta, source="ck/metadata.json")
    assert "key 'w'" in str(e.value) and why in str(e.value), str(e.value)


def test_hostile_flat_record_and_mixed_entry_are_refused():
    base = {"format": "oarlock.flexcheckpoint", "version": 2}
    bad = dict(base, tensors={"w": {"global_shape": [8], "dtype": "float32",
                                    "flat": {"first": 1, "step": 1, "base": 0, "stride": 0}}})
    with pytest.raises(CheckpointFormatError, match="key 'w'.*8 shards"):
        CheckpointMetadata.from_json(bad)
    both = dict(base, tensors={"w": {"global_shape": [8], "dtype": "float32", "shards": [],
                                     "grid": {"chunks": [[]], "writers": {"base": 0, "strides": []}}}})
    with pytest.raises(CheckpointFormatError, match="key 'w'.*exactly one of"):
        CheckpointMetadata.from_json(both)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.integers(1, 7), st.integers(4, 7), st.integers(0, 2**31))
def test_many_small_reads_of_one_file_equal_dense_slicing(rows, cols, nkeys, seed):
    """A load whose items share one data file is checked and located once, then read as one span and copied box
    by box (executor.prepare_work): every target equals dense slicing of the saved tensor, for listed row pieces
    of random extents, regular, flattened and non-contiguous targets."""
    import random
    import tempfile

    from oarlock.checkpoint import ShardedWeight, load_state_dict, save_state_dict

    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    full = {f"k{i}": torch.randn(rows, cols, generator=g) for i in range(nkeys)}
    state = {}
    for k, t in full.items():  # random row cuts: listed shards, all in rank-00000.safetensors
        cuts = sorted({0, rows, *(rnd.randrange(1, rows) for _ in range(rnd.randrange(0, 3)) if rows > 1)})
        state[k] = [ShardedWeight(k, t[a:b].clone(), (b - a, cols), (rows, cols), (a, 0))
                    for a, b in zip(cuts, cuts[1:])]
    with tempfile.TemporaryDirectory() as d:
        save_state_dict(state, d)
        targets, want = {}, {}
        for k, t in full.items():
            r0, r1 = sorted(rnd.sample(range(rows + 1), 2)) if rows > 1 else (0, 1)
            c0, c1 = sorted(rnd.sample(range(cols + 1), 2)) if cols > 1 else (0, 1)
            kind = rnd.choice(["regular", "strided", "flat"])
            if kind == "flat":  # a ZeRO-style flat range of the whole tensor
                a, b = sorted(rnd.sample(range(rows * cols + 1), 2))
                targets[k] = ShardedWeight(k, torch.zeros(b - a), (rows, cols), (rows, cols), (0, 0),
                                           flattened_range=(a, b))
                want[k] = t.reshape(-1)[a:b]
            else:
                buf = torch.zeros(r1 - r0, c1 - c0 + (3 if kind == "strided" else 0))
                local = buf[:, : c1 - c0]  # strided: a column slice of a wider buffer
                targets[k] = ShardedWeight(k, local, (r1 - r0, c1 - c0), (rows, cols), (r0, c0))
                want[k] = t[r0:r1, c0:c1]
        load_state_dict(targets, d)
    for k, sw in targets.items():
        assert torch.equal(sw.local_tensor, want[k]), k


def test_file_work_makes_each_files_reads_in_order_and_holds_templates_not_items():
    """A rank reading one column slab of 96 keys x 64 row shards (6,144 read items): the compact plan holds one
    template for the keys' common geometry; FileWork gives, file by file, exactly the items of the full plan of
    that file in read order; and building it plus making every file's pairs in turn peaks far below holding every
    item at once (tracemalloc)."""
    import tracemalloc

    from oarlock.checkpoint.runtime.executor import FileWork, read_order

    shape, n, keys = (256, 64), 64, [f"layers.{i}.w" for i in range(96)]
    grid = GridLayout.from_placements(shape, (n,), (("S", 0),), key="w")
    meta = CheckpointMetadata("oarlock", {k: TensorMeta(k, shape, "float32", grid=grid) for k in keys})
    reqs = [ShardDesc(k, (256, 16), shape, (0, 16), "float32") for k in keys]
    full = Planner(meta).plan_rank(reqs)
    assert len(full.items) == 96 * 64 and not full.groups
    compact = Planner(meta).plan_rank(reqs, compact=True)
    assert not compact.items and len(compact.groups) == 96 and compact.item_count() == len(full.items)
    assert len({id(tmpl) for _, tmpl in compact.groups}) == 1  # one geometry: one template shared by the keys
    target = torch.zeros(256, 16)
    work = FileWork([], [(label, tmpl, target) for label, tmpl in compact.groups])
    assert len(work) == len(full.items) and work.files == sorted({it.file for it in full.items})
    for f in work.files:
        want = sorted((it for it in full.items if it.file == f), key=read_order)
        got = [it for it, t in work.pairs_of(f)]
        assert got == want, f
    del full
    tracemalloc.start()
    tracemalloc.reset_peak()
    items = Planner(meta).plan_rank(reqs).items
    everything = tracemalloc.get_traced_memory()[1]
    del items
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    plan = Planner(meta).plan_rank(reqs, compact=True)
    work = FileWork([], [(label, tmpl, target) for label, tmpl in plan.groups])
    count = sum(len(work.pairs_of(f)) for f in work.files)
    streamed = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    assert count == 96 * 64
    assert streamed * 4 < everything, (streamed, everything)


def _flat_record(key: str, shape: tuple, grid: FlatGrid, rank: int):
    from oarlock.checkpoint.runtime.save import RankRecord

    rec = RankRecord()
    rec.tensors.append((key, shape, "float32", grid))
    return rec


def test_flat_rules_of_disjoint_groups_record_one_copy_and_disagreeing_ranks_are_named():
    """Two data-parallel groups ({0, 1} and {2, 3}) holding copies of one buffer cut alike: one group's rule is
    recorded and the other group's ranks are told not to write the key. Ranks of one group that disagree on the
    partition: an error naming both ranks and FlatPartition (it was a tiling error naming one file twice)."""
    from oarlock.checkpoint.errors import CheckpointMismatchError
    from oarlock.checkpoint.runtime.save import build_layout

    n, shape = 20, (4, 5)
    g01, _ = FlatGrid.of_partition(n, 3, 12, base=0)  # shards [0, 9), [9, 20) on ranks 0, 1
    g23, _ = FlatGrid.of_partition(n, 3, 12, base=2)  # the same cuts on ranks 2, 3
    layout = build_layout([(_flat_record("m", shape, g01, 0), [0, 1]), (_flat_record("m", shape, g23, 2), [2, 3])],
                          4)
    kept = layout.tensors["m"].grid
    assert kept in (g01, g23)
    others = [2, 3] if kept == g01 else [0, 1]
    assert layout.grid_skip == {r: ["m"] for r in others}
    assert [s.flattened_range for s in layout.tensors["m"].shards] == [(0, 9), (9, 20)]
    bad, _ = FlatGrid.of_partition(n, 0, 13, base=0)  # rank 1's view of the same group's buffer
    with pytest.raises(CheckpointMismatchError, match=r"'m': ranks 0 and 1 describe its flat buffer partition "
                                                      r"differently \(FlatPartition"):
        build_layout([(_flat_record("m", shape, g01, 0), [0]), (_flat_record("m", shape, bad, 1), [1])], 2)
