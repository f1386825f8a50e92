"""Many-rank scenarios of test_scale_dist.py (16 gloo ranks): grid bookkeeping through the real collective paths.

Every tensor's global value is recomputed from a seed on each rank (``value``), so a loaded shard is checked
against an independent slice of the full tensor, never against what the save wrote.
"""

from __future__ import annotations

import json
import struct

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from multirank import worlds
from oarlock.checkpoint import ShardedWeight, load_state_dict, save_state_dict

SHAPES = [(64, 48), (37, 21), (16, 8), (5, 3)]  # (37, 21) and (5, 3): uneven torch.chunk extents, empty cells


def value(key: str, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, key)) * 7919 + len(key))
    return torch.randn(*shape, generator=g)


def expected_local(key, shape, mesh, placements) -> torch.Tensor:
    """This rank's box of the full value, from torch's own box rule."""
    lshape, off = compute_local_shape_and_global_offset(shape, mesh, placements)
    return value(key, shape)[tuple(slice(o, o + n) for o, n in zip(off, lshape))]


def target(shape, mesh, placements) -> DTensor:
    lshape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
    return DTensor.from_local(torch.zeros(lshape), mesh, placements, shape=torch.Size(shape),
                              stride=torch.empty(shape).stride())


def saved_state(world: int, rank: int) -> dict:
    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (4, world // 4))
    state = {}
    for i in range(24):
        shape = SHAPES[i % len(SHAPES)]
        key = f"layers.{i}.w"
        layout = i % 3
        if layout == 0:  # FSDP2
            state[key] = distribute_tensor(value(key, shape), mesh1, [Shard(0)])
        elif layout == 1:  # FSDP x TP
            state[key] = distribute_tensor(value(key, shape), mesh2, [Shard(0), Shard(1)])
        else:  # HSDP: replicated over the first mesh dim
            state[key] = distribute_tensor(value(key, shape), mesh2, [Replicate(), Shard(0)])
    state["norm.w"] = value("norm.w", (48,))  # a plain replicated tensor
    n = -(-48 // world)  # a TP split as ShardedWeights (torch.chunk extents): compressed to a grid at commit
    lo, hi = min(48, rank * n), min(48, (rank + 1) * n)
    state["tp.w"] = ShardedWeight("tp.w", value("tp.w", (16, 48))[:, lo:hi].clone(), (16, hi - lo), (16, 48),
                                  (0, lo))
    state["step"] = 7
    return state


@worlds(16)
def scenario_grid_save_then_reshard_loads_bit_exact(ctx):
    """16 ranks save FSDP, FSDP x TP and HSDP DTensors (uneven extents), a replicated tensor and a TP split; the
    metadata records every one of them as a grid; loads into a (2, 8) mesh with other placements and into whole
    tensors give exactly the seeded values."""
    ck = ctx.root / "ck"
    save_state_dict(saved_state(ctx.world, ctx.rank), ck)
    meta = json.loads((ck / "metadata.json").read_text())
    assert meta["version"] == 4
    listed = [k for k, t in meta["tensors"].items() if "grid" not in t]
    assert listed == [], f"keys still listed shard by shard: {listed}"
    assert meta["tensors"]["layers.0.w"]["grid"]["chunks"] == [[16], []], meta["tensors"]["layers.0.w"]
    assert meta["tensors"]["layers.2.w"]["grid"]["writers"]["replicas"] == [[4, 4]], meta["tensors"]["layers.2.w"]
    mesh = init_device_mesh("cpu", (2, 8))
    for placements in ([Shard(1), Replicate()], [Replicate(), Shard(0)], [Shard(0), Shard(1)]):
        tgt = {f"layers.{i}.w": target(SHAPES[i % len(SHAPES)], mesh, placements) for i in range(24)}
        tgt["norm.w"] = target((48,), mesh, [Replicate(), Replicate()])
        tgt["tp.w"] = target((16, 48), mesh, placements)
        tgt["step"] = 0
        report = load_state_dict(tgt, ck)
        for k, t in tgt.items():
            if k == "step":
                assert t == 7
                continue
            want = expected_local(k, tuple(t.shape), mesh, t.placements)
            assert torch.equal(t.to_local(), want), (k, placements)
        assert report.bytes_read == sum(t.to_local().numel() * 4 for k, t in tgt.items() if k != "step")
    whole = {f"layers.{i}.w": torch.zeros(SHAPES[i % len(SHAPES)]) for i in range(24)}
    load_state_dict(whole, ck, strict=False)
    for k, t in whole.items():
        assert torch.equal(t, value(k, tuple(t.shape))), k


@worlds(16)
def scenario_bookkeeping_does_not_grow_with_the_world(ctx):
    """The same state saved by 4 of the ranks (a sub-group with its own mesh) and by all 16: metadata.json's
    tensor records are the same size to within a few bytes per key, and the whole file grows by the
    per-file checksum entries only."""
    keys = [f"layers.{i}.w" for i in range(40)]
    sizes = {}
    sub = dist.new_group([0, 1, 2, 3])
    for world in (4, 16):
        if world == 4:
            if ctx.rank < 4:
                mesh = DeviceMesh("cpu", [0, 1, 2, 3])
                state = {k: distribute_tensor(value(k, (64, 48)), mesh, [Shard(0)]) for k in keys}
                save_state_dict(state, ctx.root / "w4", process_group=sub)
        else:
            mesh = init_device_mesh("cpu", (16,))
            state = {k: distribute_tensor(value(k, (64, 48)), mesh, [Shard(0)]) for k in keys}
            save_state_dict(state, ctx.root / "w16")
        dist.barrier()
    if ctx.rank == 0:
        for world in (4, 16):
            text = (ctx.root / f"w{world}" / "metadata.json").read_text()
            meta = json.loads(text)
            # the data files' safetensors headers (8-byte length + JSON), read without oarlock
            headers = [8 + struct.unpack("<Q", f.read_bytes()[:8])[0]
                       for f in sorted((ctx.root / f"w{world}").glob("rank-*.safetensors"))]
            assert len(headers) == world
            sizes[world] = (len(text), len(json.dumps(meta["tensors"])), sum(headers), max(headers))
        assert sizes[16][1] - sizes[4][1] <= len(keys), sizes  # '4' -> '16' in each record's chunk count
        assert sizes[16][0] <= 1.25 * sizes[4][0], sizes
        # packed data files: one entry per file whatever the number of tensors (40 named entries would take
        # about 4 KB), so the headers add a fixed amount per file, not per tensor x file
        assert max(sizes[4][3], sizes[16][3]) < 400, sizes
    # and the 16-rank save loads back on the 4-rank group (a reshard to fewer ranks), bit-exact
    if ctx.rank < 4:
        mesh = DeviceMesh("cpu", [0, 1, 2, 3])
        tgt = {k: target((64, 48), mesh, [Shard(1)]) for k in keys}
        load_state_dict(tgt, ctx.root / "w16", process_group=sub)
        for k, t in tgt.items():
            assert torch.equal(t.to_local(), expected_local(k, (64, 48), mesh, [Shard(1)])), k
    dist.barrier()
    return sizes if ctx.rank == 0 else None


@worlds(16)
def scenario_a_rank_that_requests_nothing_reads_nothing(ctx):
    """Ranks 0-7 load row shards of every key; ranks 8-15 request nothing of them. Those ranks open no data
    file and read no byte, while the others get exactly their rows."""
    keys = [f"layers.{i}.w" for i in range(12)]
    mesh = init_device_mesh("cpu", (16,))
    save_state_dict({k: distribute_tensor(value(k, (64, 48)), mesh, [Shard(0)]) for k in keys}, ctx.root / "ck")
    if ctx.rank < 8:
        tgt = {k: ShardedWeight(k, torch.zeros(8, 48), (8, 48), (64, 48), (8 * ctx.rank, 0)) for k in keys}
    else:
        tgt = {}
    report = load_state_dict(tgt, ctx.root / "ck", strict=False)
    if ctx.rank < 8:
        for k in keys:
            assert torch.equal(tgt[k].local_tensor, value(k, (64, 48))[8 * ctx.rank:8 * ctx.rank + 8]), k
        assert report.bytes_read == len(keys) * 8 * 48 * 4
    else:
        assert report.bytes_read == 0 and report.files_read == [], (report.bytes_read, report.files_read)


@worlds(16)
def scenario_streamed_load_reshards_bit_exact_and_fails_alike_on_a_flipped_byte(ctx):
    """The load path for millions of read items, forced on a small checkpoint (``STREAM_MIN_ITEMS`` 0, coalesced
    reads kept for 3 items only): every rank's pairs are made file by file from the planner's templates when they
    are checked (and their blocks to hash summed) and when they are read. A column reshard of an FSDP save is
    bit-exact; then a flipped byte in one data file fails every rank with the same ChecksumError naming that file,
    and no target is written. (One 1-D mesh: an earlier scenario made sub-groups on some ranks only.)"""
    from oarlock.checkpoint.runtime import executor
    from oarlock.checkpoint.integrity import ChecksumError

    saved = executor.STREAM_MIN_ITEMS, executor.RETAIN_ITEMS
    executor.STREAM_MIN_ITEMS, executor.RETAIN_ITEMS = 0, 3
    made: list[str] = []  # the files whose pairs were made on demand
    real = executor.FileWork.pairs_of
    executor.FileWork.pairs_of = lambda self, f, **kw: made.append(f) or real(self, f, **kw)
    try:
        keys = [f"layers.{i}.w" for i in range(16)]
        mesh = init_device_mesh("cpu", (16,))
        ck = ctx.root / "streamed"
        save_state_dict({k: distribute_tensor(value(k, (64, 48)), mesh, [Shard(0)]) for k in keys}, ck)
        tgt = {k: target((64, 48), mesh, [Shard(1)]) for k in keys}
        report = load_state_dict(tgt, ck)
        wrong = [k for k, t in tgt.items()
                 if not torch.equal(t.to_local(), expected_local(k, (64, 48), mesh, [Shard(1)]))]
        # every rank's outcome gathered before asserting: a failure cannot leave the other ranks waiting
        every = [None] * ctx.world
        dist.all_gather_object(every, (wrong, report.bytes_read, sorted(report.files_read), sorted(made)))
        files = sorted(f"rank-{r:05d}.safetensors" for r in range(16))
        for r, (wrong, nbytes, read, made_r) in enumerate(every):
            assert not wrong and nbytes == len(keys) * 64 * 3 * 4, (r, wrong, nbytes)
            # each file's pairs made twice: once to check it and sum the blocks to hash, once to read it
            assert read == files and made_r == sorted(files * 2), (r, read, made_r)
        victim = ck / "rank-00005.safetensors"
        if ctx.rank == 0:
            raw = bytearray(victim.read_bytes())
            raw[-5] ^= 0x10  # in the last tensor's data
            victim.write_bytes(bytes(raw))
        dist.barrier()
        tgt = {k: target((64, 48), mesh, [Shard(1)]) for k in keys}
        try:
            load_state_dict(tgt, ck)
            msg = "the flipped byte was not caught"
        except ChecksumError as e:
            msg = str(e)
        untouched = all(bool((t.to_local() == 0).all()) for t in tgt.values())
        every = [None] * ctx.world
        dist.all_gather_object(every, (msg, untouched))
        assert all(u for _, u in every), "a destination was written"
        core = min((m for m, _ in every), key=len)  # the owner's message; the others are "rank R: " + it
        assert str(victim) in core and all(m.endswith(core) for m, _ in every), every
    finally:  # the ranks run later scenarios in this process
        executor.FileWork.pairs_of = real
        executor.STREAM_MIN_ITEMS, executor.RETAIN_ITEMS = saved


FLAT_SHAPES = [(40, 12), (7,), (33, 5), (96,), (3, 4, 5)]  # 808 elements: 51 per rank at 16 (the last holds 43)


def flat_state(world: int, rank: int, partition: bool, key_suffix: str = ".exp_avg") -> dict:
    """ZeRO-1 style states: the tensors of FLAT_SHAPES concatenated into one flat buffer split evenly over
    ``world`` ranks (padded); this rank's piece of every tensor (empty when its partition misses it), with its
    :class:`FlatPartition` when ``partition``."""
    from oarlock.checkpoint import FlatPartition

    total = sum(torch.Size(s).numel() for s in FLAT_SHAPES)
    size = -(-total // world)
    state, off = {}, 0
    for i, shape in enumerate(FLAT_SHAPES):
        key, n = f"p{i}{key_suffix}", torch.Size(shape).numel()
        a, b = min(max(rank * size - off, 0), n), min(max((rank + 1) * size - off, 0), n)
        a, b = (a, b) if b > a else (0, 0)
        piece = value(key, shape).reshape(-1)[a:b].clone()
        fp = FlatPartition(off, size, rank) if partition else None
        state[key] = ShardedWeight(key, piece, shape, shape, (0,) * len(shape), (a, b), flat_partition=fp)
        off += n
    return state


@worlds(16)
def scenario_flat_partitions_coordinate_one_record_and_load_bit_exact(ctx):
    """ZeRO-1 flat states with their FlatPartition: every rank describes every state by the same flat rule, so the
    coordinator receives one record (against one per rank when the same ranges come without it), the metadata
    holds one flat record per key and each data file one packed entry; loads as whole tensors and as the flat
    ranges of a 10-rank partition give exactly the seeded values."""
    from oarlock.checkpoint.runtime.dist import DistWrapper
    from safetensors import safe_open

    senders: list[int] = []
    gathers: list[str] = []  # all-gathers of per-rank data (O(world) bytes received by every rank)
    real = DistWrapper.gather_from, dist.all_gather, dist.all_gather_object
    DistWrapper.gather_from = lambda self, obj, src: senders.append(len(src)) or real[0](self, obj, src)
    dist.all_gather = lambda *a, **k: gathers.append("all_gather") or real[1](*a, **k)
    dist.all_gather_object = lambda *a, **k: gathers.append("all_gather_object") or real[2](*a, **k)
    try:
        save_state_dict(flat_state(ctx.world, ctx.rank, partition=True), ctx.root / "flat")
        flat_gathers = list(gathers)
        save_state_dict(flat_state(ctx.world, ctx.rank, partition=False), ctx.root / "listed")
    finally:
        DistWrapper.gather_from, dist.all_gather, dist.all_gather_object = real
    assert senders == [1, ctx.world], senders  # one record with the rule; every rank's own ranges without
    # with the rule the ranks' fingerprints agree in one fixed-size all-reduce; without it they differ and are
    # all-gathered
    assert flat_gathers == [] and gathers == ["all_gather"], (flat_gathers, gathers)
    meta = json.loads((ctx.root / "flat" / "metadata.json").read_text())
    for i, shape in enumerate(FLAT_SHAPES):
        t = meta["tensors"][f"p{i}.exp_avg"]
        assert "flat" in t and t["flat"]["step"] == 51, t
    with safe_open(str(ctx.root / "flat" / f"rank-{ctx.rank:05d}.safetensors"), "pt") as f:
        assert list(f.keys()) == ["oarlock.packed"], list(f.keys())
    for name in ("flat", "listed"):
        whole = {f"p{i}.exp_avg": torch.zeros(s) for i, s in enumerate(FLAT_SHAPES)}
        load_state_dict(whole, ctx.root / name)
        for k, t in whole.items():
            assert torch.equal(t, value(k, tuple(t.shape))), (name, k)
    if ctx.rank < 10:  # another data-parallel degree: the flat ranges of a 10-way split
        sub = flat_state(10, ctx.rank, partition=False)
        tgt = {k: ShardedWeight(k, torch.zeros_like(sw.local_tensor), sw.local_shape, sw.global_shape,
                                sw.global_offset, sw.flattened_range) for k, sw in sub.items()}
    else:
        sub, tgt = {}, {}
    load_state_dict(tgt, ctx.root / "flat", strict=False)
    for k, sw in tgt.items():
        assert torch.equal(sw.local_tensor, sub[k].local_tensor), k
