"""Smoke test of the scale simulator (benchmarks/scale.py): its ``--quick`` logic in-process on a tiny model (2
layers, D=16), with real values checked: oarlock's planned read items cover every requested element exactly once
and select the same bytes as DCP's planner for the same request."""

from __future__ import annotations

import json
import math
import pickle

import pytest

from testkit import load_benchmark

pytest.importorskip("torch.distributed.checkpoint")


@pytest.fixture(scope="module")
def scale():
    return load_benchmark("scale")


def _covered_once(items, reqs) -> bool:
    """Every requested element is the destination of exactly one read item (checked element by element)."""
    seen: dict[tuple, list[int]] = {}
    for r in reqs:
        n = r.numel
        seen[(r.key, r.global_offset, r.flattened_range)] = [0] * n
    from oarlock.checkpoint.model.sharded import flat_range_boxes

    for it in items:
        for r in reqs:
            if r.key != it.dst_key:
                continue
            if r.flattened_range is None:
                if tuple(it.dst_shape) != tuple(r.local_shape):
                    continue
                shape, base = r.local_shape, 0
            else:
                pieces = {fs: ext for _, ext, fs in flat_range_boxes(r.local_shape, *r.flattened_range)}
                if pieces.get(it.dst_flat_start) != tuple(it.dst_shape):
                    continue
                shape, base = it.dst_shape, it.dst_flat_start - r.flattened_range[0]
            marks = seen[(r.key, r.global_offset, r.flattened_range)]
            import itertools

            for idx in itertools.product(*(range(a, b) for a, b in it.dst_box)):
                marks[base + scale_flat(idx, shape)] += 1
            break
        else:
            return False
    return all(all(m == 1 for m in marks) for marks in seen.values())


def scale_flat(idx, shape) -> int:
    f = 0
    for i, n in zip(idx, shape):
        f = f * n + i
    return f


@pytest.mark.parametrize("kind,reshard,world", [("fsdp2", "lost", 16), ("fsdp2", "fsdp_to_tp8", 16),
                                                ("fsdp_tp", "tp8_to_tp4", 16), ("zero1", "lost", 16)])
def test_plans_cover_requests_and_match_dcp(scale, kind, reshard, world):
    params = scale.with_moments(scale.MODELS["tiny"][1](2))
    rs = scale.make_reshard(reshard, kind, world)
    libs = [scale.OarlockV1] + ([scale.OarlockGrid] if scale.has_grid_api() else [])
    metas = {}
    for cls in libs:
        sim = cls(params, rs.source)
        sim.coordinate()
        metas[cls.name] = scale.oarlock_parse(sim.metadata_text())
    dcp = scale.DCP(params, rs.source)
    dcp.coordinate()
    md = pickle.loads(dcp.metadata_blob())
    for r in scale.sample_ranks(rs.target.world):
        reqs = scale.requests_of(rs.target, params, r)
        want = sum(q.numel for q in reqs)
        assert want > 0
        dcp_items = scale.dcp_plan(md, reqs)
        dcp_vol = sum(math.prod(it.lengths) for it in dcp_items)
        for name, meta in metas.items():
            work, row = scale.oarlock_plan(meta, reqs)
            items = list(scale.work_items(work))
            assert row["items"] == len(items) and row["files"] == len({it.file for it in items}), (name, r)
            vol = sum(math.prod(b - a for a, b in it.src_box) for it in items)
            assert vol == want == dcp_vol, (name, r)
            assert _covered_once(items, reqs), (name, r)


def _parsed_metadata(scale, lib: str, kind: str) -> tuple[bytes, dict]:
    """The metadata a cell of :func:`test_quick_cell_in_process` parses (its save simulated again: the simulator
    is deterministic), and ``{key: (global shape, dtype name)}`` read from it by the library's own format:
    torch's ``Metadata`` unpickled for DCP, oarlock's JSON for the others."""
    params = scale.with_moments(scale.MODELS["tiny"][1](2))
    source = scale.make_reshard("lost", kind, 16).source
    if lib == "dcp":
        sim = scale.DCP(params, source)
        sim.coordinate()
        blob = sim.metadata_blob()
        md = pickle.loads(blob).state_dict_metadata
        return blob, {k: (tuple(m.size), str(m.properties.dtype).removeprefix("torch.")) for k, m in md.items()}
    sim = (scale.OarlockGrid if lib == "oarlock" else scale.OarlockV1)(params, source)
    sim.coordinate()
    text = sim.metadata_text()
    tensors = json.loads(text)["tensors"]
    return text.encode(), {k: (tuple(t["global_shape"]), t["dtype"]) for k, t in tensors.items()}


@pytest.mark.parametrize("kind", ["fsdp2", "zero1"])
def test_quick_cell_in_process(scale, kind):
    """The --quick cell's logic (run_cell) on the tiny model: real figures for every library (zero1: flat-range
    grid records, whose data files the hashing model lays out from the rule)."""
    libs = ["oarlock-v1", "dcp"] + (["oarlock"] if scale.has_grid_api() else [])
    res = {lib: scale.run_cell("tiny", 2, kind, "lost", 16, lib) for lib in libs}
    read = {lib: r["worst"]["bytes"] for lib, r in res.items()}
    assert len(set(read.values())) == 1 and next(iter(read.values())) > 0
    for lib, r in res.items():
        assert r["worst"]["items"] > 0
        # what the timed "read + parse" step reads and yields: metadata of meta_bytes bytes naming every saved key
        # with its global shape and dtype (the time itself is not checked: tests never time anything)
        blob, stored = _parsed_metadata(scale, lib, kind)
        assert r["meta_bytes"] == len(blob), (lib, r["meta_bytes"], len(blob))
        params = scale.with_moments(scale.MODELS["tiny"][1](2))
        assert stored == {p.key: (p.shape, "float32") for p in params}, lib
    # version 1 hashes every block it touches; a rank touching only blocks below 4 MiB hashes whole files
    assert res["oarlock-v1"]["worst"]["hashed"] == res["oarlock-v1"]["worst"]["touched"] >= read["oarlock-v1"]
    if "oarlock" in res:
        new, old = res["oarlock"], res["oarlock-v1"]
        assert new["meta_bytes"] < old["meta_bytes"]  # one grid record per key instead of 16 shard records
        assert new["recv_other"] < old["recv_other"]  # no rank receives every rank's shard list
        assert new["recv_coord"] < old["recv_coord"]  # nor the coordinator (ZeRO-1: one flat rule per moment)
        assert new["worst"]["hashed"] <= new["worst"]["touched"]
    text = scale.table("tiny", res, libs)
    assert "| bookkeeping on disk |" in text and "skipped" not in text


def test_cap_is_reported_not_dropped(scale, capsys):
    scale.main(["--models", "tiny", "--layers", "2", "--layouts", "fsdp2", "--reshards", "lost", "--worlds", "16",
                "--libs", "oarlock-v1,dcp", "--max-ranks-v1", "8", "--max-ranks-dcp", "8"])
    out = capsys.readouterr().out
    assert out.count("skipped (cap)") >= 2
