"""Multi-rank scenarios of test_integrity.py (4 ranks) and test_manager.py (2 ranks), run by the multirank harness.

* 4 ranks, checksums: the parent saved ``ck`` (``ROWS x COLS`` float32) into ``ctx.shared`` and flipped one byte
  in rank 2's rows (``corrupt.json`` gives the file, offset and block); each rank loads its row shard of ``w``.
* 4 ranks, verification shared by the group: the ranks save ``rows`` (row shards of ``w`` and ``v``, one file per
  rank, 3 blocks each) and load it as column shards, so every rank reads part of every block: each block is
  hashed by exactly one rank; a flipped byte fails every rank alike; a same-layout restart hashes its own file; a
  rank that requests nothing hashes nothing.
* 2 ranks, CheckpointManager: sharded rows + a per-rank RNG (sync and async saves, keep_last=2), then a fresh
  manager resumes each rank's own rows and RNG stream.
"""

from __future__ import annotations

import json
import random
import re
import shutil

import torch
import torch.distributed as dist

from multirank import needs, worlds
from oarlock.checkpoint import CheckpointManager, RNGState, ShardedWeight, load_state_dict, save_state_dict
from oarlock.checkpoint.integrity import ChecksumError
from testkit import seeded_tensor

ROWS, COLS = 2048, 4096  # float32: 8 MiB of rows per rank, two 4 MiB blocks
BS = 4 * 1024 * 1024  # the block size oarlock records (integrity.BLOCK_SIZE), restated as the test's reference
# the group-verification checkpoint: w rows of 16 KiB (a block holds whole rows), v rows of 12000 bytes (it does not)
SHAPES = {"w": (2048, 4096), "v": (1024, 3000)}


@worlds(4)
def scenario_one_rank_reads_the_corrupt_block_all_fail_alike(ctx):
    """Only rank 2 reads the corrupt block; every rank raises the same ChecksumError (the others prefixed
    "rank 2: "), naming the file, the key and the block; no rank's destination is written."""
    bad = json.loads((ctx.shared / "corrupt.json").read_text())
    n = ROWS // ctx.world
    local = torch.zeros(n, COLS)
    sw = ShardedWeight("w", local, (n, COLS), (ROWS, COLS), (ctx.rank * n, 0))
    try:
        load_state_dict({"w": sw}, ctx.shared / "ck")
        raise AssertionError("the flipped byte was not caught")
    except ChecksumError as e:
        msg = str(e)
    assert bool((local == 0).all()), "the destination was written"
    every = [None] * ctx.world
    dist.all_gather_object(every, msg)
    core = [re.sub(r"^rank 2: ", "", m) for m in every]
    assert len(set(core)) == 1, ("ranks raised different errors", every)
    assert every[2] == core[0], ("the rank that read the block must name it itself", every[2])
    assert bad["file"] in core[0] and "key 'w'" in core[0] and f"(block {bad['block']})" in core[0], core[0]
    return msg


@worlds(2)
def scenario_manager_sharded_rows_and_per_rank_rng(ctx):
    """Three saves (the third async) of rows + RNG + step, keep_last=2; a fresh manager resumes step 3, each
    rank's own rows, and each rank's torch and Python random streams where they were right after the last save."""
    n, world, rank = 4, ctx.world, ctx.rank
    torch.manual_seed(100 + rank)
    random.seed(100 + rank)
    m = CheckpointManager(ctx.root / "ck", keep_last=2)
    for step in (1, 2, 3):
        local = torch.full((n, 3), float(10 * step + rank))
        sw = ShardedWeight("w", local, (n, 3), (n * world, 3), (rank * n, 0))
        m.save(step, {"w": sw, "rng": RNGState(), "step": step}, async_save=step == 3)
    m.wait()
    expect_torch = torch.rand(3)  # the streams right after the last save
    expect_py = random.random()
    torch.manual_seed(0)
    random.seed(0)
    got = torch.zeros(n, 3)
    state = {"w": ShardedWeight("w", got, (n, 3), (n * world, 3), (rank * n, 0)), "rng": RNGState(), "step": None}
    assert CheckpointManager(ctx.root / "ck", keep_last=2).load_latest(state) == 3
    assert state["step"] == 3, state["step"]
    assert torch.equal(got, torch.full((n, 3), float(30 + rank))), got  # this rank's rows of the last save
    now_torch, now_py = torch.rand(3), random.random()
    assert torch.equal(now_torch, expect_torch), ("torch stream not resumed", now_torch, expect_torch)
    assert now_py == expect_py, ("python stream not resumed", now_py, expect_py)
    streams = [None] * world
    dist.all_gather_object(streams, now_torch.tolist())
    assert streams[0] != streams[1], "both ranks resumed the same torch stream"
    assert CheckpointManager(ctx.root / "ck").steps() == [2, 3]


# ---------------------------------------------------------------- verification shared by the group

def _full(key):
    return seeded_tensor(SHAPES[key], torch.float32, {"w": 21, "v": 22}[key])


def _rows(key, rank, world, t=None):
    """This rank's row shard of ``key`` (the saved layout), over ``t`` (default: its slice of the full tensor)."""
    rows, cols = SHAPES[key]
    n = rows // world
    t = _full(key)[rank * n:(rank + 1) * n].clone() if t is None else t
    return ShardedWeight(key, t, (n, cols), (rows, cols), (rank * n, 0))


def _cols(key, lo, hi):
    """A column shard ``[lo, hi)`` of ``key`` over zeros."""
    rows, cols = SHAPES[key]
    return ShardedWeight(key, torch.zeros(rows, hi - lo), (rows, hi - lo), (rows, cols), (0, lo))


def _col_split(key, rank, world):
    cols = SHAPES[key][1]
    return cols * rank // world, cols * (rank + 1) // world


def _layout(path):
    """``(data start, {key: (begin, end)})`` of a safetensors file, parsed here from its 8-byte length and JSON
    header (independently of oarlock's reader)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8:8 + n])
    return 8 + n, {k: tuple(v["data_offsets"]) for k, v in head.items() if k != "__metadata__"}


def _blocks_of(size, lo, hi):
    """``{block: length}`` of the blocks of a ``size``-byte file holding any byte of ``[lo, hi)``."""
    return {b: min(size, (b + 1) * BS) - b * BS for b in range(lo // BS, (hi - 1) // BS + 1)} if hi > lo else {}


def _files(ctx):
    return [ctx.shared / "rows" / f"rank-{r:05d}.safetensors" for r in range(ctx.world)]


def _touched_total(ctx):
    """Bytes of the blocks holding any tensor byte of the ``rows`` files (what a load reading every tensor of
    every file touches)."""
    total = 0
    for f in _files(ctx):
        start, entries = _layout(f)
        blocks = {}
        for begin, end in entries.values():
            blocks.update(_blocks_of(f.stat().st_size, start + begin, start + end))
        total += sum(blocks.values())
    return total


def _gather(ctx, obj):
    every = [None] * ctx.world
    dist.all_gather_object(every, obj)
    return every


@worlds(4)
def scenario_column_load_of_row_shards_hashes_each_block_once(ctx):
    """Row shards saved (one file per rank), loaded as column shards: every rank reads a quarter of every block
    of every file, yet the group hashes each of those blocks exactly once (the sum of bytes_hashed is the size of
    the touched blocks, where one hash per rank would be four times that), and no rank hashes much more than it
    reads."""
    save_state_dict({k: _rows(k, ctx.rank, ctx.world) for k in SHAPES}, ctx.shared / "rows")
    sd = {k: _cols(k, *_col_split(k, ctx.rank, ctx.world)) for k in SHAPES}
    rep = load_state_dict(sd, ctx.shared / "rows")
    for k, sw in sd.items():
        lo, hi = _col_split(k, ctx.rank, ctx.world)
        assert torch.equal(sw.local_tensor, _full(k)[:, lo:hi]), k
    assert rep.comm_method == "direct" and len(rep.files_read) == ctx.world, rep
    every = _gather(ctx, (rep.bytes_hashed, rep.bytes_read, len(rep.files_read)))
    touched = _touched_total(ctx)  # the column shards together read every byte of every tensor in every file
    hashed = [h for h, _, _ in every]
    assert sum(hashed) == touched, (hashed, touched)
    for r, (h, nread, nfiles) in enumerate(every):
        assert nread == sum(SHAPES[k][0] * (_col_split(k, r, ctx.world)[1] - _col_split(k, r, ctx.world)[0]) * 4
                            for k in SHAPES), (r, nread)
        assert 0 < h <= nread * 1.1 + BS * nfiles, (r, h, nread, nfiles)
    return hashed


@worlds(4)
@needs("column_load_of_row_shards_hashes_each_block_once")
def scenario_flipped_byte_in_a_shared_block_fails_every_rank_alike(ctx):
    """A flipped byte in rank 2's file, in the block where one tensor ends and the next begins (every rank reads
    part of it, one rank hashes it): every rank raises the same ChecksumError (prefixed "rank R: " on all but the
    rank that hashed the block) naming the file, the block, its byte range and both keys stored there, although
    the byte lies in the second one; no rank's target is written."""
    ck = ctx.root / "ck"
    victim = ck / "rank-00002.safetensors"
    start, entries = _layout(_files(ctx)[2])
    (k1, (_, end1)), (k2, _) = sorted(entries.items(), key=lambda kv: kv[1])
    blk = (start + end1) // BS  # holds the end of k1 and the start of k2
    off = start + end1 + 8  # inside k2
    assert off // BS == blk
    lo, hi = blk * BS, min(_files(ctx)[2].stat().st_size, (blk + 1) * BS)
    _flip_copy(ctx, "ck", 2, off)
    sd = {k: _cols(k, *_col_split(k, ctx.rank, ctx.world)) for k in SHAPES}
    try:
        load_state_dict(sd, ck)
        raise AssertionError("the flipped byte was not caught")
    except ChecksumError as e:
        msg = str(e)
    assert all(bool((sw.local_tensor == 0).all()) for sw in sd.values()), "a destination was written"
    every = _gather(ctx, msg)
    plain = [r for r, m in enumerate(every) if not m.startswith("rank ")]
    assert len(plain) == 1, ("exactly one rank hashed the block and names it itself", every)
    owner = plain[0]
    assert all(m == every[owner] or m == f"rank {owner}: {every[owner]}" for m in every), every
    core = every[owner]
    for part in (str(victim), f"(block {blk})", f"bytes [{lo}, {hi})", f"key {k1!r}", f"key {k2!r}"):
        assert part in core, (part, core)
    return every


@worlds(4)
@needs("column_load_of_row_shards_hashes_each_block_once")
def scenario_same_layout_restart_hashes_only_its_own_file(ctx):
    """The saved row shards loaded as saved: the warm path, each rank hashing all of its own file and nothing
    else."""
    sd = {k: _rows(k, ctx.rank, ctx.world, torch.zeros(SHAPES[k][0] // ctx.world, SHAPES[k][1])) for k in SHAPES}
    rep = load_state_dict(sd, ctx.shared / "rows")
    assert rep.comm_method == "warm", rep.comm_method
    for k, sw in sd.items():
        assert torch.equal(sw.local_tensor, _rows(k, ctx.rank, ctx.world).local_tensor), k
    own = _files(ctx)[ctx.rank]
    assert rep.files_read == [own.name] and rep.bytes_hashed == own.stat().st_size, (rep, own.stat().st_size)


@worlds(4)
@needs("column_load_of_row_shards_hashes_each_block_once")
def scenario_rank_that_requests_nothing_hashes_nothing(ctx):
    """Ranks 0 and 1 load column halves (every block), rank 2 requests nothing, rank 3 only 8 rows of w (rank 0's
    file): rank 2 hashes nothing, rank 3 at most the blocks its rows lie in, and the group still hashes every
    touched block exactly once."""
    if ctx.rank < 2:
        sd = {k: _cols(k, *_col_split(k, ctx.rank, 2)) for k in SHAPES}
    elif ctx.rank == 2:
        sd = {}
    else:
        sd = {"w": ShardedWeight("w", torch.zeros(8, SHAPES["w"][1]), (8, SHAPES["w"][1]), SHAPES["w"], (0, 0))}
    rep = load_state_dict(sd, ctx.shared / "rows")
    if ctx.rank < 2:
        for k, sw in sd.items():
            lo, hi = _col_split(k, ctx.rank, 2)
            assert torch.equal(sw.local_tensor, _full(k)[:, lo:hi]), k
    elif ctx.rank == 3:
        assert torch.equal(sd["w"].local_tensor, _full("w")[:8]), "rank 3's rows"
    every = _gather(ctx, (rep.bytes_hashed, rep.bytes_read))
    assert every[2] == (0, 0), every
    f0 = _files(ctx)[0]
    start, entries = _layout(f0)
    w0 = start + entries["w"][0]
    mine3 = _blocks_of(f0.stat().st_size, w0, w0 + 8 * SHAPES["w"][1] * 4)
    assert every[3][0] <= sum(mine3.values()), (every, mine3)
    assert sum(h for h, _ in every) == _touched_total(ctx), (every, _touched_total(ctx))
    return [h for h, _ in every]


def _flip_copy(ctx, name, victim_rank, off=None):
    """A copy of the ``rows`` checkpoint under ``name`` with the byte at ``off`` (default: inside the first tensor)
    of rank ``victim_rank``'s file flipped; returns the copy."""
    ck = ctx.root / name
    if ctx.rank == 0:
        shutil.copytree(ctx.shared / "rows", ck)
        f = ck / f"rank-{victim_rank:05d}.safetensors"
        if off is None:
            start, entries = _layout(f)
            off = start + min(b for b, _ in entries.values()) + 12
        with open(f, "r+b") as fh:
            fh.seek(off)
            b = fh.read(1)
            fh.seek(off)
            fh.write(bytes([b[0] ^ 0x40]))
    dist.barrier()
    return ck


@worlds(4)
@needs("column_load_of_row_shards_hashes_each_block_once")
def scenario_overlap_column_load_hashes_each_block_once(ctx):
    """verify_checksums="overlap": the column load of row shards gives the same values, the group still hashes
    each touched block exactly once, and the phases are reported with the reads first."""
    sd = {k: _cols(k, *_col_split(k, ctx.rank, ctx.world)) for k in SHAPES}
    rep = load_state_dict(sd, ctx.shared / "rows", verify_checksums="overlap")
    for k, sw in sd.items():
        lo, hi = _col_split(k, ctx.rank, ctx.world)
        assert torch.equal(sw.local_tensor, _full(k)[:, lo:hi]), k
    hashed = _gather(ctx, rep.bytes_hashed)
    assert sum(hashed) == _touched_total(ctx), (hashed, _touched_total(ctx))
    assert list(rep.phases) == ["plan", "read", "verify", "verdict"], rep.phases


@worlds(4)
@needs("column_load_of_row_shards_hashes_each_block_once")
def scenario_overlap_flipped_byte_fails_every_rank_and_says_the_targets_are_unspecified(ctx):
    """With "overlap" a flipped byte still fails every rank with a ChecksumError naming the file, and the message
    says the targets now hold unspecified contents (they were written while hashing), not that nothing was
    loaded; the same for the warm path (a same-layout load of the corrupt copy)."""
    ck = _flip_copy(ctx, "ck_overlap", 1)
    sd = {k: _cols(k, *_col_split(k, ctx.rank, ctx.world)) for k in SHAPES}
    for label, target in (("column", sd), ("warm", {k: _rows(k, ctx.rank, ctx.world, torch.zeros(
            SHAPES[k][0] // ctx.world, SHAPES[k][1])) for k in SHAPES})):
        try:
            load_state_dict(target, ck, verify_checksums="overlap")
            raise AssertionError(f"{label}: the flipped byte was not caught")
        except ChecksumError as e:
            msg = str(e)
        every = _gather(ctx, msg)
        assert all("rank-00001.safetensors" in m and "unspecified contents" in m and "nothing was loaded" not in m
                   for m in every), (label, every)
    # and a bad mode is refused before anything is read, naming the value
    try:
        load_state_dict(sd, ck, verify_checksums="later")
        raise AssertionError("verify_checksums='later' was accepted")
    except Exception as e:
        assert "verify_checksums='later'" in str(e) and "'overlap'" in str(e), str(e)
