"""Scale simulator (issue 26, item 1): what one rank pays for bookkeeping, coordination, planning and verification
at hundreds to thousands of ranks, oarlock and torch DCP side by side on the same shards.

One process stands in for any one rank and no data file is written: every figure comes from the code a real rank
runs on the same inputs. oarlock: ``assign_writes`` / ``build_layout`` (the save coordinator), the
``metadata.json`` text and its parser, ``Planner.plan_rank``. DCP: its own ``WriteItem`` / ``SavePlan`` /
``Metadata`` classes, ``DefaultSavePlanner.create_global_plan`` (dedup + global plan + validation, the
coordinator's work), a pickled ``.metadata`` with the ``_StorageInfo`` records a ``FileSystemWriter`` stores,
and ``create_read_items_for_chunk_list`` (what ``create_default_local_load_plan`` calls per key). Shard boxes
come from DTensor's own ``_compute_local_shape_and_global_offset`` for both libraries.

Libraries (one fresh subprocess per cell and library; peak RSS above the Python + torch + oarlock runtime
measured in that subprocess before anything is built):

* ``oarlock-v1`` -- the version-1 path: every rank all-gathers every rank's shard descriptions, every rank runs
  ``assign_writes``; ``metadata.json`` lists one record per stored shard.
* ``oarlock`` -- the grid path (``oarlock.checkpoint.model.grid``; present once issue 26 items 2-3 are merged): each
  rank describes its DTensors by their grid rule (``RankRecord``), ranks all-gather fixed-size fingerprints, one
  record per class of equal records goes to rank 0, which runs ``build_layout`` and scatters to each rank its
  listed writes; ``metadata.json`` holds one grid record per regular tensor.
* ``dcp`` -- torch.distributed.checkpoint.

Figures per cell (where a figure depends on the rank: the loading rank, of the first, middle and last target
ranks the one requesting the most bytes, the same rank for every library):

* bookkeeping: ``metadata.json`` bytes plus, for oarlock, the digests files beside the data files (8 bytes per
  4 MiB block; the checksum records in ``metadata.json`` and the digests files are shown) / DCP ``.metadata``.
  oarlock-v1 keeps the block digests inline in ``metadata.json`` (format 3).
* read + parse: ``json.loads`` + ``CheckpointMetadata.from_json`` + the checksum record / ``pickle.loads``.
* plan: a fresh ``Planner(meta).plan_rank(requests, compact=True)`` held as a load holds it (``FileWork``: the
  planner's templates, one per grid geometry) plus one pass making every file's read items, as the
  load's check pass does, unsorted, the cyclic collector paused as in a load (a real load makes them once more
  to read: that pass costs about as much again) /
  ``create_read_items_for_chunk_list`` for every key. The largest file's item count is shown with the items:
  the pairs a rank holds at once.
* save coordination: bytes the coordinator (rank 0) and any other rank receive, counted as torch's object
  collectives move them (``all_gather_object`` / ``gather_object`` pad every object to the largest one; sizes
  are exchanged as 8-byte ints), for the planning exchange and the write-results exchange (oarlock: the
  fingerprints agree in one all-reduce of 42 int64s, counted as twice its size for a ring); and the time of the
  coordinator's work (oarlock-v1: ``assign_writes`` + tiling checks, on every rank; oarlock: ``build_layout``;
  DCP: ``create_global_plan``).
* reads: read items, files, bytes. DCP reads every stored chunk a read item touches whole (``FileSystemReader``
  slices the chunk's full ``_StorageInfo`` range and narrows after ``torch.load``): its storage bytes are shown
  beside the bytes its items select.
* hashed: bytes of 4 MiB checksum blocks the rank hashes before writing a target (oarlock only; DCP does not
  verify). oarlock-v1: every block the rank touches. oarlock: the ownership rule of issue 26 item 5 -- each
  touched block is hashed once per group, by the reader of the most of its bytes (ties: the tied ranks, sorted,
  indexed by a hash of file and block). Modelled, not run: file offsets are the stored shards laid out in the
  order the writer writes them (key order; the safetensors header is ignored), and the readers of a block are
  counted over the stored shards this rank reads in it. Over 64 touched files, 64 evenly spaced files are
  modelled and scaled by bytes read (shown with ``~``).

Usage: python benchmarks/scale.py [--models 70b,405b,dsv3] [--layouts fsdp2,hsdp,fsdp_tp8,zero1,ep64]
       [--reshards lost,fsdp_to_tp8,tp8_to_tp4] [--worlds 256,1024,4096] [--libs oarlock-v1,oarlock,dcp]
       [--max-ranks-v1 1024] [--max-ranks-dcp 1024] [--timeout 900] [--quick] [--append-results]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pickle
import resource
import subprocess
import sys
import time
import warnings
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

BLOCK = 4 * 1024 * 1024
ITEM = 4  # float32: parameters and both AdamW moments
DTYPE = "float32"
MOMENTS = (".exp_avg", ".exp_avg_sq")


# ---------------------------------------------------------------- models

@dataclass(frozen=True)
class Param:
    key: str
    shape: tuple[int, ...]
    tp_dim: int | None  # Megatron rule: column-parallel 0, row-parallel 1 (experts: +1); None = replicated on TP
    expert: bool = False  # stacked routed experts (EP-sharded in the ep64 layout)


def llama(layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, head_dim: int, vocab: int) -> list[Param]:
    out = [Param("model.embed_tokens.weight", (vocab, hidden), 0)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [Param(p + "self_attn.q_proj.weight", (heads * head_dim, hidden), 0),
                Param(p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden), 0),
                Param(p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden), 0),
                Param(p + "self_attn.o_proj.weight", (hidden, heads * head_dim), 1),
                Param(p + "mlp.gate_proj.weight", (ffn, hidden), 0),
                Param(p + "mlp.up_proj.weight", (ffn, hidden), 0),
                Param(p + "mlp.down_proj.weight", (hidden, ffn), 1),
                Param(p + "input_layernorm.weight", (hidden,), None),
                Param(p + "post_attention_layernorm.weight", (hidden,), None)]
    return out + [Param("model.norm.weight", (hidden,), None), Param("lm_head.weight", (vocab, hidden), 0)]


def deepseek_v3(layers: int = 61, hidden: int = 7168, dense_ffn: int = 18432, dense_layers: int = 3,
                experts: int = 256, moe_ffn: int = 2048, heads: int = 128, q_lora: int = 1536, kv_lora: int = 512,
                nope: int = 128, rope: int = 64, v_dim: int = 128, vocab: int = 129280) -> list[Param]:
    out = [Param("model.embed_tokens.weight", (vocab, hidden), 0)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [Param(p + "self_attn.q_a_proj.weight", (q_lora, hidden), None),
                Param(p + "self_attn.q_a_layernorm.weight", (q_lora,), None),
                Param(p + "self_attn.q_b_proj.weight", (heads * (nope + rope), q_lora), 0),
                Param(p + "self_attn.kv_a_proj_with_mqa.weight", (kv_lora + rope, hidden), None),
                Param(p + "self_attn.kv_a_layernorm.weight", (kv_lora,), None),
                Param(p + "self_attn.kv_b_proj.weight", (heads * (nope + v_dim), kv_lora), 0),
                Param(p + "self_attn.o_proj.weight", (hidden, heads * v_dim), 1),
                Param(p + "input_layernorm.weight", (hidden,), None),
                Param(p + "post_attention_layernorm.weight", (hidden,), None)]
        if i < dense_layers:
            out += [Param(p + "mlp.gate_proj.weight", (dense_ffn, hidden), 0),
                    Param(p + "mlp.up_proj.weight", (dense_ffn, hidden), 0),
                    Param(p + "mlp.down_proj.weight", (hidden, dense_ffn), 1)]
        else:  # torchtitan-style stacked experts, router, one shared expert
            out += [Param(p + "mlp.router.gate.weight", (experts, hidden), None),
                    Param(p + "mlp.router.expert_bias", (experts,), None),
                    Param(p + "mlp.experts.w1", (experts, moe_ffn, hidden), 1, True),
                    Param(p + "mlp.experts.w3", (experts, moe_ffn, hidden), 1, True),
                    Param(p + "mlp.experts.w2", (experts, hidden, moe_ffn), 2, True),
                    Param(p + "mlp.shared_experts.gate_proj.weight", (moe_ffn, hidden), 0),
                    Param(p + "mlp.shared_experts.up_proj.weight", (moe_ffn, hidden), 0),
                    Param(p + "mlp.shared_experts.down_proj.weight", (hidden, moe_ffn), 1)]
    return out + [Param("model.norm.weight", (hidden,), None), Param("lm_head.weight", (vocab, hidden), 0)]


MODELS = {
    "70b": ("Llama-70B", lambda layers=None: llama(layers or 80, 8192, 28672, 64, 8, 128, 128256)),
    "405b": ("Llama-405B", lambda layers=None: llama(layers or 126, 16384, 53248, 128, 8, 128, 128256)),
    "dsv3": ("DeepSeek-V3", lambda layers=None: deepseek_v3(layers or 61, dense_layers=min(3, layers or 61))),
    # test-sized model (the pytest smoke test and --quick --tiny)
    "tiny": ("tiny Llama", lambda layers=None: llama(layers or 2, 64, 160, 4, 2, 16, 96)),
}


def with_moments(params: list[Param]) -> list[Param]:
    """Parameters, then both AdamW moments of each (same shapes, oarlock's optimizer keys)."""
    return params + [dataclasses.replace(p, key=p.key + s) for s in MOMENTS for p in params]


# ---------------------------------------------------------------- layouts

@dataclass(frozen=True)
class Layout:
    """How every key is sharded over ``world`` ranks: ``kind`` with its mesh (see :func:`placement`)."""

    kind: str  # fsdp2 | hsdp | fsdp_tp | tp_dp | zero1 | ep64
    world: int
    mesh: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.kind} {'x'.join(map(str, self.mesh))}"


def make_layout(kind: str, world: int, *, rows: int | None = None, tp: int = 8) -> Layout:
    if kind in ("fsdp2", "zero1"):
        return Layout(kind, world, (world,))
    if kind in ("hsdp", "ep64"):
        r = rows if rows is not None else world // 64
        return Layout(kind, r * 64, (r, 64))
    if kind in ("fsdp_tp", "tp_dp"):
        r = rows if rows is not None else world // tp
        return Layout(kind, r * tp, (r, tp))
    raise ValueError(kind)


def placement(lay: Layout, p: Param) -> tuple[tuple[int, ...], tuple] | None:
    """``(mesh shape, placements)`` of key ``p`` (placements as ``("S", dim)`` / ``("R",)``), or None for a
    ZeRO-1 flat-range key."""
    R = ("R",)
    if lay.kind == "fsdp2":
        return lay.mesh, (("S", 0),)
    if lay.kind == "hsdp":
        return lay.mesh, (R, ("S", 0))
    if lay.kind == "fsdp_tp":
        return lay.mesh, (("S", 0), ("S", p.tp_dim) if p.tp_dim is not None else R)
    if lay.kind == "tp_dp":
        return lay.mesh, (R, ("S", p.tp_dim) if p.tp_dim is not None else R)
    if lay.kind == "zero1":
        if p.key.endswith(MOMENTS):
            return None
        return lay.mesh, (R,)
    if lay.kind == "ep64":
        if p.expert:  # EP over the 64-wide mesh dim on the expert dim, FSDP over the other on dim 1
            return lay.mesh, (("S", 1), ("S", 0))
        return (lay.world,), (("S", 0),)  # dense parts: FSDP over every rank (row-major mesh order)
    raise ValueError(lay.kind)


def torch_placements(pl: tuple) -> list:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if q[0] == "R" else Shard(q[1]) for q in pl]


@lru_cache(maxsize=None)
def _coord(rank: int, mesh: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(mesh):
        out.append(rank % n)
        rank //= n
    return tuple(reversed(out))


@lru_cache(maxsize=1 << 20)
def dtensor_box(shape: tuple[int, ...], mesh: tuple[int, ...], pl: tuple, coord: tuple[int, ...]
                ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offset, local shape)`` DTensor gives mesh coordinate ``coord`` (DTensor's own function)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    lshape, off = _compute_local_shape_and_global_offset(shape, mesh, list(coord), torch_placements(pl))
    return tuple(int(x) for x in off), tuple(int(x) for x in lshape)


@lru_cache(maxsize=8)
def zero1_ranges(params: tuple[Param, ...], world: int) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Per rank, ``(param index, start, stop)`` of its flat range of the concatenated parameters (even split:
    ``ceil(N / world)`` elements per rank, trailing ranks may hold less or nothing)."""
    sizes = [math.prod(p.shape) for p in params]
    total = sum(sizes)
    per = -(-total // world)
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + s)
    import bisect

    out = []
    for r in range(world):
        a, b = min(r * per, total), min((r + 1) * per, total)
        pieces = []
        i = bisect.bisect_right(starts, a) - 1
        while a < b and i < len(params) and starts[i] < b:
            lo, hi = max(a, starts[i]), min(b, starts[i + 1])
            if hi > lo:
                pieces.append((i, lo - starts[i], hi - starts[i]))
            i += 1
        out.append(tuple(pieces))
    return tuple(out)


def rank_shards(lay: Layout, params: Sequence[Param], rank: int) -> list[tuple[Param, tuple, tuple, tuple | None]]:
    """What rank ``rank`` holds: ``(param, offset, local shape, flattened range)`` per non-empty shard (the
    rank's save descriptions and its load requests). ZeRO-1 moments: flat ranges of the whole box."""
    out = []
    for p in params:
        pm = placement(lay, p)
        if pm is None:
            continue
        mesh, pl = pm
        off, ls = dtensor_box(p.shape, mesh, pl, _coord(rank, mesh))
        out.append((p, off, ls, None))  # empty shards too: a DTensor rank describes and requests every key
    if lay.kind == "zero1":
        base = tuple(p for p in params if not p.key.endswith(MOMENTS))
        by_key = {p.key: p for p in params}
        for suf in MOMENTS:
            for i, a, b in zero1_ranges(base, lay.world)[rank]:
                p = by_key[base[i].key + suf]
                out.append((p, (0,) * len(p.shape), p.shape, (a, b)))
    return out


@dataclass(frozen=True)
class Reshard:
    name: str
    source: Layout
    target: Layout
    note: str = ""


def make_reshard(name: str, kind: str, world: int) -> Reshard | None:
    """The reshard ``name`` of a checkpoint saved with layout ``kind`` on ``world`` ranks, or None when it does not
    apply to that layout."""
    src = make_layout(kind, world)
    if name == "lost":
        if kind in ("hsdp", "ep64"):  # the mesh needs a multiple of 64: the job drops the lost node's replica row
            return Reshard(name, src, make_layout(kind, world, rows=src.mesh[0] - 1),
                           f"D -> D-64 (the layout needs multiples of 64)")
        if kind == "fsdp_tp":
            return Reshard(name, src, make_layout(kind, world, rows=src.mesh[0] - 1), "D -> D-8")
        return Reshard(name, src, make_layout(kind, world - 8), "D -> D-8")
    if name == "fsdp_to_tp8":
        if kind not in ("fsdp2", "hsdp", "zero1"):
            return None
        return Reshard(name, src, make_layout("tp_dp", world, tp=8), "TP8 x DP, (Replicate, Shard(tp_dim))")
    if name == "tp8_to_tp4":
        if kind != "fsdp_tp":
            return None
        return Reshard(name, src, make_layout("tp_dp", world, tp=4), "TP4 x DP, (Replicate, Shard(tp_dim))")
    raise ValueError(name)


def sample_ranks(world: int) -> list[int]:
    """The loading ranks simulated: first, middle, last (the worst of those that request data is reported)."""
    return sorted({0, world // 2 + 1 if world > 2 else 0, world - 1})


def loading_rank(lay: Layout, params: Sequence[Param]) -> int:
    """The simulated loading rank: of :func:`sample_ranks`, the one requesting the most bytes (the first on ties),
    the same rank for every library."""
    return max(sample_ranks(lay.world), key=lambda r: (sum((fr[1] - fr[0]) if fr else math.prod(ls)
                                                           for _, _, ls, fr in rank_shards(lay, params, r)), -r))


# ---------------------------------------------------------------- wire accounting

def psize(obj: Any) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def all_gather_bytes(sizes: Sequence[int]) -> int:
    """What each rank receives from ``all_gather_object``: every rank's object padded to the largest, plus the
    sizes (8 bytes each)."""
    return len(sizes) * (max(sizes) + 8)


def gather_bytes(sizes: Sequence[int]) -> tuple[int, int]:
    """``gather_object``: (coordinator receives, any other rank receives)."""
    return len(sizes) * (max(sizes) + 8), len(sizes) * 8


# ---------------------------------------------------------------- hashing model

def count_lt(box: Sequence[tuple[int, int]], shape: Sequence[int], x: int) -> int:
    """Elements of ``box`` (local coordinates of a C-contiguous array of ``shape``) with flat index < ``x``."""
    if x <= 0:
        return 0
    if not shape:
        return 1
    stride = math.prod(shape[1:])
    a, b = box[0]
    rest = math.prod(y - z for z, y in box[1:])
    q, r = divmod(x, stride)
    n = max(0, min(b, q) - a) * rest
    if a <= q < b and r:
        n += count_lt(box[1:], shape[1:], r)
    return n


def flat_of(point: Sequence[int], shape: Sequence[int]) -> int:
    f = 0
    for i, n in zip(point, shape):
        f = f * n + i
    return f


class ReaderIndex:
    """Per key, the target ranks grouped by identical requests (*classes*), indexed for box queries with oarlock's
    own :class:`KeyIndex` (one listed shard per class)."""

    def __init__(self, lay: Layout, params: Sequence[Param]):
        from oarlock.checkpoint.model.metadata import ShardMeta, TensorMeta

        self.ShardMeta, self.TensorMeta = ShardMeta, TensorMeta
        self.lay = lay
        self.params = {p.key: p for p in params}
        self.by_rank: dict[int, dict[str, int]] = {}
        self._idx: dict[str, Any] = {}
        self._ranks: dict[str, list[list[int]]] = {}
        self._geo: dict[tuple, tuple] = {}

    def _build(self, key: str) -> None:
        from oarlock.checkpoint.planning.load import KeyIndex

        p = self.params[key]
        pm = placement(self.lay, p)
        if pm is not None:  # DTensor keys: the classes depend on the geometry only (shared by the layers)
            sig = (p.shape, pm)
            if sig not in self._geo:
                mesh, pl = pm
                classes: dict[tuple, int] = {}
                ranks: list[list[int]] = []
                shards = []
                for r in range(self.lay.world):
                    off, ls = dtensor_box(p.shape, mesh, pl, _coord(r, mesh))
                    if not math.prod(ls) and p.shape:
                        continue
                    c = classes.get((off, ls))
                    if c is None:
                        c = classes[(off, ls)] = len(ranks)
                        ranks.append([])
                        shards.append(self.ShardMeta(off, ls, str(c), "t"))
                    ranks[c].append(r)
                self._geo[sig] = (KeyIndex(self.TensorMeta("t", p.shape, DTYPE, shards)), ranks)
            self._idx[key], self._ranks[key] = self._geo[sig]
            return
        ranks, shards = [], []  # ZeRO-1 moment: one class per rank holding a flat range of it
        base = tuple(q for q in self.params.values() if not q.key.endswith(MOMENTS))
        stem = next(key[:-len(s)] for s in MOMENTS if key.endswith(s))
        i = [q.key for q in base].index(stem)
        for r, pieces in enumerate(zero1_ranges(base, self.lay.world)):
            for j, a, b in pieces:
                if j == i:
                    ranks.append([r])
                    shards.append(self.ShardMeta((0,) * len(p.shape), p.shape, str(len(ranks) - 1), key, (a, b)))
        self._idx[key] = KeyIndex(self.TensorMeta(key, p.shape, DTYPE, shards))
        self._ranks[key] = ranks

    def query(self, key: str, box) -> list[tuple[int, Any]]:
        """``(class, target piece)`` overlapping ``box``."""
        if key not in self._idx:
            self._build(key)
        return [(int(q.file), q) for q in self._idx[key].query(box)]

    def ranks(self, key: str, cls: int) -> list[int]:
        return self._ranks[key][cls]


def lay_out_file(entries: list[tuple]) -> tuple[dict, list]:
    """A data file's tensors at byte offsets in the writer's order (header ignored): ``(names, pieces)`` with
    ``names[tensor name] = (offset, stored shape, key)`` and ``pieces`` sorted by offset: ``(start byte, key,
    global box, box shape)`` of every regular box the file holds (flattened shards cut into contiguous boxes)."""
    from oarlock.checkpoint.model.sharded import flat_range_boxes, make_box

    pos, names, pieces = 0, {}, []
    for k, off, fr, name, s in file_write_order(entries):
        names[name] = (pos, s.local_shape, k)
        if fr is None:
            if math.prod(s.local_shape):
                pieces.append((pos, k, make_box(s.global_offset, s.local_shape), tuple(s.local_shape)))
        else:
            for o, e, fs in flat_range_boxes(s.local_shape, *fr):
                if math.prod(e):
                    pieces.append((pos + (fs - fr[0]) * ITEM, k,
                                   make_box([x + y for x, y in zip(s.global_offset, o)], e), tuple(e)))
        pos += s.numel * ITEM
    return names, pieces


def _window(blk: int, start: int, vol: int) -> tuple[int, int]:
    """Element range ``[w0, w1)`` of a box stored from byte ``start`` (``vol`` elements) that block ``blk``
    holds."""
    w0 = max(0, (blk * BLOCK - start) // ITEM)
    w1 = min(vol, -(-((blk + 1) * BLOCK - start) // ITEM))
    return w0, max(w0, w1)


def hashed_bytes(all_files: Sequence[str], items_of: Any, read_all: int, rank: int, file_layout: Any,
                 readers: ReaderIndex, file_sizes: dict[str, int], rule: str, max_files: int = 64
                 ) -> tuple[int, int, bool]:
    """``(bytes hashed, bytes of touched blocks, sampled)`` for one rank's oarlock read items: ``items_of(file)``
    gives the items of each of ``all_files``; ``read_all``: elements read in all (to scale a sample of files).

    ``file_layout(file)`` -> :func:`lay_out_file` of the file. ``rule``: ``"touched"`` (every touched block) or
    ``"owner"`` (issue 26 item 5: the block's hasher is the rank reading most of its bytes, counted over every
    stored box in the block and every target rank requesting part of it; ties: the tied ranks, sorted, indexed by
    a hash of file and block).
    """
    import bisect

    from oarlock.checkpoint.model.sharded import box_intersection

    files = list(all_files)
    sampled = len(files) > max_files
    if sampled:
        step = len(files) / max_files
        files = [files[int(i * step)] for i in range(max_files)]
    hashed = touched_total = 0
    read_sample = 0
    for f in files:
        names, pieces = file_layout(f)
        starts = [p[0] for p in pieces]
        size = file_sizes.get(f, 0)
        mine: dict[int, int] = {}
        for it in items_of(f):
            read_sample += math.prod(b - a for a, b in it.src_box)
            base = names[it.name][0] + it.src_flat_start * ITEM
            vol = math.prod(it.src_shape)
            first = flat_of([a for a, _ in it.src_box], it.src_shape)
            last = flat_of([b - 1 for _, b in it.src_box], it.src_shape)
            for blk in range((base + first * ITEM) // BLOCK, (base + last * ITEM) // BLOCK + 1):
                w0, w1 = _window(blk, base, vol)
                n = count_lt(it.src_box, it.src_shape, w1) - count_lt(it.src_box, it.src_shape, w0)
                if n > 0:
                    mine[blk] = mine.get(blk, 0) + n
        classes: dict[int, list] = {}
        for blk in sorted(mine):
            nbytes = max(0, min(BLOCK, size - blk * BLOCK)) if size else BLOCK
            touched_total += nbytes
            if rule != "owner":
                hashed += nbytes
                continue
            per_rank: dict[int, int] = {}
            i = max(0, bisect.bisect_right(starts, blk * BLOCK) - 1)
            while i < len(pieces) and pieces[i][0] < (blk + 1) * BLOCK:
                start, key, pbox, shape = pieces[i]
                vol = math.prod(shape)
                if start + vol * ITEM > blk * BLOCK:
                    if i not in classes:
                        found = []
                        for cls, q in readers.query(key, pbox):
                            ov = box_intersection(q.box, pbox)
                            if ov is not None:
                                found.append((readers.ranks(key, cls),
                                              tuple((x - o, y - o) for (x, y), (o, _) in zip(ov, pbox))))
                        classes[i] = found
                    w0, w1 = _window(blk, start, vol)
                    for ranks, loc in classes[i]:
                        n = count_lt(loc, shape, w1) - count_lt(loc, shape, w0)
                        if n > 0:
                            for r in ranks:
                                per_rank[r] = per_rank.get(r, 0) + n
                i += 1
            if not per_rank:
                continue
            top = max(per_rank.values())
            tied = sorted(r for r, n in per_rank.items() if n == top)
            if tied[zlib.crc32(f"{f}:{blk}".encode()) % len(tied)] == rank:
                hashed += nbytes
    if sampled and read_sample:
        scale = read_all / read_sample
        return int(hashed * scale), int(touched_total * scale), True
    return hashed, touched_total, False


# ---------------------------------------------------------------- oarlock phases

def _meta_classes():
    from oarlock.checkpoint.model.metadata import CheckpointMetadata

    return CheckpointMetadata


def has_grid_api() -> bool:
    try:
        from oarlock.checkpoint.model.grid import GridLayout  # noqa: F401
        from oarlock.checkpoint.runtime.save import RankRecord, build_layout  # noqa: F401
    except ImportError:
        return False
    return True


def checksum_record(file_sizes: dict[str, int], inline: bool = False) -> dict[str, Any]:
    """``extra.checksums`` of a save whose files have ``file_sizes`` (hash values: placeholders of the real
    length, 8 bytes per 4 MiB block): each file's record pointing at its digests file (what a save writes), or
    with ``inline`` the digests in the record (format 3, ``oarlock-v1``)."""
    from oarlock.checkpoint.integrity import digests_record, make_record

    recs = {}
    for f, s in file_sizes.items():
        rec = {"size": s, "blocks": [f"{(i * 2654435761) & 0xFFFFFFFFFFFFFFFF:016x}" for i in range(-(-s // BLOCK))]}
        recs[f] = rec if inline else digests_record(f, rec)[0]
    return make_record(recs)


def digests_file_bytes(file_sizes: dict[str, int]) -> int:
    """Bytes of the digests files beside the data files (8 per block)."""
    return sum(8 * -(-s // BLOCK) for s in file_sizes.values())


def file_write_order(entries: list[tuple]) -> list[tuple]:
    """The writer's order of a file's tensors: by (key, offset, flattened range) (``write_and_commit``)."""
    return sorted(entries, key=lambda e: (e[0], e[1], e[2] or ()))


class OarlockV1:
    """The version-1 path (listed shards, all-gather of every rank's descriptions)."""

    name = "oarlock-v1"

    def __init__(self, params: list[Param], src: Layout):
        self.params, self.src = params, src

    def describe(self, rank: int) -> dict:
        descs = [(p.key, p.shape, DTYPE, off, ls, fr, (fr[1] - fr[0] if fr else math.prod(ls)) * ITEM)
                 for p, off, ls, fr in rank_shards(self.src, self.params, rank)]
        return {"descs": descs, "tmp": "/ckpt/.tmp-save" if rank == 0 else None,
                "save_id": "0" * 32 if rank == 0 else None, "objects": {}, "nested": {}, "tp_layouts": {}}

    def coordinate(self) -> dict:
        from oarlock.checkpoint.planning.load import KeyIndex
        from oarlock.checkpoint.runtime.save import assign_writes

        D = self.src.world
        gathered = [self.describe(r) for r in range(D)]
        sizes = [psize((g, None)) for g in gathered]
        t0 = time.perf_counter()
        tensors, writes = assign_writes([g["descs"] for g in gathered])
        for t in tensors.values():
            KeyIndex(t)
        work = time.perf_counter() - t0
        del gathered
        self.tensors = tensors
        self.file_sizes = files_of_listed(tensors)
        rec_sizes = [psize(({f: checksum_record({f: s}, inline=True)["files"][f]}, None))
                     for f, s in self.file_sizes.items()]
        rec_sizes += [psize(({}, None))] * (D - len(rec_sizes))
        plan_b = all_gather_bytes(sizes)
        write_b = all_gather_bytes(rec_sizes)
        return {"recv_coord": plan_b + write_b, "recv_other": plan_b + write_b, "coord_s": work,
                "coord_note": "assign_writes + tiling checks (every rank)"}

    def metadata_text(self) -> str:
        CheckpointMetadata = _meta_classes()
        meta = CheckpointMetadata("oarlock", tensors=self.tensors,
                                  extra={"checksums": checksum_record(self.file_sizes, inline=True)})
        try:
            return meta.dumps(compact=False)  # version-1 form once grid records exist
        except TypeError:
            return meta.dumps()

    def file_layout(self, meta) -> Any:
        per_file: dict[str, list] = {}
        for k, t in meta.tensors.items():
            for s in t.shards:
                per_file.setdefault(s.file, []).append((k, s.global_offset, s.flattened_range, s.name, s))
        return _layout_from_entries(per_file)


def files_of_listed(tensors: dict) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for t in tensors.values():
        for s in t.shards:
            sizes[s.file] = sizes.get(s.file, 0) + s.numel * ITEM
    return sizes


def _layout_from_entries(per_file: dict[str, list]):
    cache: dict[str, tuple] = {}

    def layout(f: str) -> tuple[dict, list]:
        if f not in cache:
            cache[f] = lay_out_file(per_file.get(f, []))
        return cache[f]

    return layout


class OarlockGrid(OarlockV1):
    """The grid path: ``RankRecord`` per rank, fingerprint classes, ``build_layout`` on rank 0."""

    name = "oarlock"

    def record(self, rank: int):
        from oarlock.checkpoint.model.grid import GridLayout
        from oarlock.checkpoint.runtime.save import RankRecord

        rec = RankRecord()
        writes = []
        seen: set[str] = set()
        flat = self.flat_rules() if self.src.kind == "zero1" else {}
        for p, off, ls, fr in rank_shards(self.src, self.params, rank):
            if p.key in flat:  # described below, as every rank does: one flat rule per state (save.describe_rank)
                continue
            pm = placement(self.src, p)
            grid = None
            if pm is not None:
                mesh, pl = pm
                grid = GridLayout.from_placements(p.shape, mesh, pl, key=p.key)
            if grid is not None:
                seen.add(p.key)
                rec.tensors.append((p.key, tuple(p.shape), DTYPE, grid))
                cell = grid.cell_of(p.shape, off) if p.shape else ()
                if cell is not None and grid.writer(cell) == rank:
                    writes.append((p.key, off, ls, None))
            else:
                if p.key not in seen:
                    seen.add(p.key)
                    rec.tensors.append((p.key, tuple(p.shape), DTYPE, None))
                rec.listed.append((p.key, tuple(p.shape), DTYPE, off, ls, fr,
                                   (fr[1] - fr[0] if fr else math.prod(ls)) * ITEM))
        # ZeRO-1 moments with their FlatPartition (oarlock.models.zero): the same rule on every rank, the writer of
        # each shard the rank whose partition it is
        for key, (shape, grid, j0) in flat.items():
            rec.tensors.append((key, shape, DTYPE, grid))
            n = math.prod(shape)
            if j0 <= rank < j0 + grid.count(n):
                writes.append((key, (0,) * len(shape), shape, grid.shard(n, rank - j0)))
        return rec, writes

    def flat_rules(self) -> dict[str, tuple[tuple[int, ...], Any, int]]:
        """ZeRO-1 moment key -> (shape, FlatGrid, partition of its shard 0), from the buffer's parameter order and
        partition size (what ``FlatGrid.of_partition`` makes on each rank)."""
        if getattr(self, "_flat", None) is None:
            from oarlock.checkpoint.model.grid import FlatGrid

            base = [p for p in self.params if not p.key.endswith(MOMENTS)]
            by_key = {p.key: p for p in self.params}
            total = sum(math.prod(p.shape) for p in base)
            per, off, out = -(-total // self.src.world), 0, {}
            for p in base:
                n = math.prod(p.shape)
                grid, j0 = FlatGrid.of_partition(n, off, per)
                for suf in MOMENTS:
                    out[p.key + suf] = (tuple(p.shape), grid, j0)
                off += n
            self._flat = out
        return self._flat

    def coordinate(self) -> dict:
        from oarlock.checkpoint.runtime.save import build_layout

        D = self.src.world
        # every rank of a DTensor layout has the same record, and so has every rank of a ZeRO-1 layout (one flat
        # rule per moment, flat_rules): check on a few ranks, one class
        recs = {r: self.record(r)[0] for r in sample_ranks(D)}
        fps = {r: rec.fingerprint() for r, rec in recs.items()}
        assert len(set(fps.values())) == 1, "ranks of a regular layout should share one record"
        classes = [(recs[0], list(range(D)))]
        rec_sizes = [psize(recs[0])] + [psize(None)] * (D - 1)
        t0 = time.perf_counter()
        layout = build_layout(classes, D)
        work = time.perf_counter() - t0
        self.tensors = layout.tensors
        self.file_sizes = self._file_sizes()
        scatter = [psize((None, "/ckpt/.tmp-save", "0" * 32, layout.listed_writes.get(r, []),
                          layout.grid_skip.get(r, []))) for r in range(D)]
        # the ranks' fingerprints agree (one class): one all-reduce of 21 ints and their negations, as int64
        # (save._agree_fingerprints via DistWrapper.min_max); a ring all-reduce receives about twice its size
        fp_b = 2 * 8 * 2 * (1 + 16 + 4)
        # the class records travel point to point from their senders (DistWrapper.gather_from): a length and the
        # payload per distinct record, nothing from the other ranks
        rec_coord, rec_other = sum(8 + s for s in rec_sizes if s > psize(None)), 0
        sc = max(scatter) + 16
        chk = [psize({f: checksum_record({f: s})["files"][f]}) for f, s in self.file_sizes.items()]
        chk += [psize({})] * (D - len(chk))
        chk_coord, chk_other = gather_bytes(chk)
        flags = 3 * 8  # all_true / all_min agreements
        return {"recv_coord": fp_b + rec_coord + chk_coord + flags, "recv_other": fp_b + rec_other + sc + chk_other
                + flags, "coord_s": work, "coord_note": f"build_layout ({len(classes)} class(es))"}

    def _file_sizes(self) -> dict[str, int]:
        from oarlock.checkpoint.model.grid import FlatGrid, data_file_name

        sizes: dict[str, int] = {}
        cache: dict[tuple, list[tuple[int, int]]] = {}
        for t in self.tensors.values():
            g = t.grid
            if g is None:
                for s in t.shards:
                    sizes[s.file] = sizes.get(s.file, 0) + s.numel * ITEM
                continue
            if isinstance(g, FlatGrid):
                n = math.prod(t.global_shape)
                for i in range(g.count(n)):
                    a, b = g.shard(n, i)
                    f = data_file_name(g.writer(i))
                    sizes[f] = sizes.get(f, 0) + (b - a) * ITEM
                continue
            sig = (t.global_shape, g) if g.replicas else (t.global_shape, g.chunks, g.base, g.strides)
            cells = cache.get(sig)
            if cells is None:
                cells = [(g.writer(c), math.prod(shp) * ITEM) for c, _, shp in g.cells(t.global_shape)]
                if not g.replicas:
                    cache[sig] = cells
            for w, n in cells:
                f = data_file_name(w)
                sizes[f] = sizes.get(f, 0) + n
        return sizes

    def metadata_text(self) -> str:
        CheckpointMetadata = _meta_classes()
        return CheckpointMetadata("oarlock", tensors=self.tensors,
                                  extra={"checksums": checksum_record(self.file_sizes)}).dumps()

    def file_layout(self, meta) -> Any:
        """A file's tensors from the layout rule (grid keys: the writer holds its own cell; listed keys: from the
        metadata), only for the files asked about."""
        from oarlock.checkpoint.model.grid import FlatGrid, data_file_name

        listed: dict[str, list] = {}
        for k, t in meta.tensors.items():
            if t.grid is None:
                for s in t.shards:
                    listed.setdefault(s.file, []).append((k, s.global_offset, s.flattened_range, s.name, s))
        from oarlock.checkpoint.model.metadata import ShardMeta

        cache: dict[str, dict] = {}

        def layout(f: str) -> tuple[dict, list]:
            if f in cache:
                return cache[f]
            w = int(f[5:-12])
            entries = list(listed.get(f, []))
            for p in self.params:
                t = meta.tensors[p.key]
                if isinstance(t.grid, FlatGrid):  # ZeRO flat ranges: writer w holds shard (w - base) / stride
                    g, n = t.grid, math.prod(p.shape)
                    i, rem = divmod(w - g.base, g.stride) if g.stride else (0, w - g.base)
                    if rem == 0 and 0 <= i < g.count(n):
                        a, b = g.shard(n, i)
                        off = (0,) * len(p.shape)
                        if b > a:
                            entries.append((p.key, off, (a, b), p.key, ShardMeta(off, tuple(p.shape), f, p.key, (a, b))))
                    continue
                pm = placement(self.src, p)
                if t.grid is None or pm is None or w >= self.src.world:
                    continue
                mesh, pl = pm
                off, ls = dtensor_box(p.shape, mesh, pl, _coord(w, mesh))
                if not math.prod(ls):
                    continue
                cell = t.grid.cell_of(p.shape, off) if p.shape else ()
                if cell is not None and data_file_name(t.grid.writer(cell)) == f:
                    entries.append((p.key, off, None, p.key, ShardMeta(off, ls, f, p.key)))
            cache[f] = lay_out_file(entries)
            return cache[f]

        return layout


def oarlock_parse(text: str):
    from oarlock.checkpoint.integrity import recorded

    CheckpointMetadata = _meta_classes()
    meta = CheckpointMetadata.from_json(json.loads(text))
    recorded(meta)
    return meta


def requests_of(lay: Layout, params: Sequence[Param], rank: int):
    from oarlock.checkpoint.model.sharded import ShardDesc

    return [ShardDesc(p.key, ls, p.shape, off, DTYPE, fr) for p, off, ls, fr in rank_shards(lay, params, rank)]


def oarlock_plan(meta, reqs) -> tuple[Any, dict]:
    """What a loading rank builds before its checks, hashing and reads: the plan, held as a real load holds it
    (``FileWork`` over the planner's compact groups where this version has them, else the list of every item),
    then one pass making every file's items, as the load's check pass does (the read pass makes them again: not
    timed here). Returns the work and ``{items, bytes, files, largest_file}``."""
    from oarlock.checkpoint.planning.load import Planner

    planner = Planner(meta)
    try:
        from oarlock.checkpoint.runtime.executor import FileWork
    except ImportError:  # before the compact plans: every item in one list
        items = planner.plan_rank(reqs).items
        return items, {"items": len(items), "files": len({it.file for it in items}), "largest_file": None}
    from oarlock.utils import gc_paused

    with gc_paused():  # as in a real load (run_load pauses the cyclic collector for its whole run)
        return _oarlock_work(planner, reqs, FileWork)


def _oarlock_work(planner: Any, reqs: Any, FileWork: Any) -> tuple[Any, dict]:
    plan = planner.plan_rank(reqs, compact=True)
    work = FileWork([(it, None) for it in plan.items], [(label, tmpl, None) for label, tmpl in plan.groups])
    n = largest = 0
    for f in work.files:
        pairs = work.pairs_of(f, ordered=False)
        n += len(pairs)
        largest = max(largest, len(pairs))
    return work, {"items": n, "files": len(work.files), "largest_file": largest}


def work_items(work: Any) -> Any:
    """Every read item of :func:`oarlock_plan`'s work (a list, or made file by file from a ``FileWork``)."""
    return work if isinstance(work, list) else (it for f in work.files for it, _ in work.pairs_of(f, ordered=False))


def plan_bytes(work: Any) -> int:
    """Bytes the read items select (untimed: the simulator's check that the plan covers the request)."""
    return sum(math.prod(b - a for a, b in it.src_box) for it in work_items(work)) * ITEM


# ---------------------------------------------------------------- DCP phases

class DCP:
    name = "dcp"

    def __init__(self, params: list[Param], src: Layout):
        self.params, self.src = params, src

    def local_plan(self, rank: int):
        import torch
        from torch.distributed.checkpoint.filesystem import _StoragePrefix
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

        from oarlock.checkpoint.model.sharded import flat_range_boxes

        props = TensorProperties(dtype=torch.float32)
        items = []
        for p, off, ls, fr in rank_shards(self.src, self.params, rank):
            boxes = [(off, ls)] if fr is None else [(o, e) for o, e, _ in flat_range_boxes(ls, *fr)]
            for o, e in boxes:  # DCP stores boxes only: a ZeRO flat range is cut into regular boxes
                o, e = torch.Size(o), torch.Size(e)
                items.append(WriteItem(index=MetadataIndex(p.key, o), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(o, e),
                                                                   properties=props, size=torch.Size(p.shape))))
        plan = SavePlan(items, planner_data={p.key: (p.key,) for p in self.params})
        return plan, _StoragePrefix(f"__{rank}_")

    def coordinate(self) -> dict:
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import StorageMeta
        from torch.distributed.checkpoint.storage import WriteResult

        D = self.src.world
        plans, sizes = [], []
        for r in range(D):
            plan, _ = self.local_plan(r)
            plans.append(plan)
            sizes.append(psize(plan))
        planner = DefaultSavePlanner()
        t0 = time.perf_counter()
        global_plan, metadata = planner.create_global_plan(plans)
        work = time.perf_counter() - t0
        del plans
        storage, wsizes, gsizes = {}, [], []
        self.file_sizes: dict[str, int] = {}
        for r, plan in enumerate(global_plan):
            import dataclasses as dc

            from torch.distributed.checkpoint.filesystem import _StoragePrefix

            plan = dc.replace(plan, storage_data=_StoragePrefix(f"__{r}_"))
            gsizes.append(psize(plan))
            pos, results, fname = 0, [], f"__{r}_0.distcp"
            for it in plan.items:
                n = math.prod(it.tensor_data.chunk.sizes) * ITEM
                info = _StorageInfo(fname, pos, n)
                results.append(WriteResult(index=it.index, size_in_bytes=n, storage_data=info))
                storage[it.index] = info
                pos += n
            if pos:
                self.file_sizes[fname] = pos
            wsizes.append(psize(results))
        metadata = dataclasses.replace(metadata, storage_data=storage,
                                       storage_meta=StorageMeta(checkpoint_id="/ckpt", save_id="0" * 32),
                                       version="1.0.0")
        self.metadata = metadata
        pc, po = gather_bytes(sizes)
        wc, wo = gather_bytes(wsizes)
        return {"recv_coord": pc + wc + 16, "recv_other": po + max(gsizes) + 8 + wo + 16, "coord_s": work,
                "coord_note": "create_global_plan (dedup + global plan + validate)"}

    def metadata_blob(self) -> bytes:
        return pickle.dumps(self.metadata)


def dcp_plan(md, reqs) -> list:
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    from oarlock.checkpoint.model.sharded import flat_range_boxes

    chunks: dict[str, list] = {}
    for r in reqs:
        boxes = ([(r.global_offset, r.local_shape)] if r.flattened_range is None else
                 [(tuple(o + a for o, a in zip(r.global_offset, off)), e)
                  for off, e, _ in flat_range_boxes(r.local_shape, *r.flattened_range)])
        chunks.setdefault(r.key, []).extend(ChunkStorageMetadata(torch.Size(o), torch.Size(e)) for o, e in boxes)
    out = []
    for key, ch in chunks.items():
        out += create_read_items_for_chunk_list(key, md.state_dict_metadata[key], ch)
    return out


# ---------------------------------------------------------------- one cell, one library (in a subprocess)

def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_cell(model: str, layers: int | None, kind: str, reshard: str, world: int, lib: str) -> dict:
    """Every figure of one library on one cell (call in a fresh process for a meaningful RSS)."""
    import gc

    import torch  # noqa: F401  (the runtime baseline includes torch, DCP and oarlock)
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    import oarlock.checkpoint  # noqa: F401

    warnings.filterwarnings("ignore")
    gc.collect()
    base_rss = peak_rss()
    params = with_moments(MODELS[model][1](layers))
    rs = make_reshard(reshard, kind, world)
    res: dict[str, Any] = {"lib": lib, "params": len(params)}
    t_all = time.perf_counter()
    if lib == "dcp":
        sim = DCP(params, rs.source)
        res.update(sim.coordinate())
        blob = sim.metadata_blob()
        res["meta_bytes"] = len(blob)
        del sim.metadata
        gc.collect()
        t0 = time.perf_counter()
        md = pickle.loads(blob)
        res["parse_s"] = time.perf_counter() - t0
        worst = None
        storage = md.storage_data
        for r in [loading_rank(rs.target, params)]:
            reqs = requests_of(rs.target, params, r)
            t0 = time.perf_counter()
            items = dcp_plan(md, reqs)
            dt = time.perf_counter() - t0
            sel = sum(math.prod(it.lengths) for it in items) * ITEM
            want = sum(q.numel for q in reqs) * ITEM
            assert sel == want, f"DCP's read items select {sel} bytes for {want} requested (rank {r})"
            row = {"rank": r, "plan_s": dt, "items": len(items), "bytes": sel,
                   "storage_bytes": sum(storage[it.storage_index].length for it in items),
                   "files": len({storage[it.storage_index].relative_path for it in items})}
            worst = row
        res["worst"] = worst
        res["rss"] = peak_rss() - base_rss
    else:
        sim = (OarlockGrid if lib == "oarlock" else OarlockV1)(params, rs.source)
        res.update(sim.coordinate())
        text = sim.metadata_text()
        res["meta_bytes"] = len(text.encode())
        res["meta_checksum_bytes"] = len(json.dumps(checksum_record(sim.file_sizes, inline=lib != "oarlock"),
                                                    separators=(",", ":")))
        if lib == "oarlock":
            res["digests_bytes"] = digests_file_bytes(sim.file_sizes)
        file_sizes = sim.file_sizes
        del sim.tensors
        gc.collect()
        t0 = time.perf_counter()
        meta = oarlock_parse(text)
        res["parse_s"] = time.perf_counter() - t0
        worst = None
        plans = {}
        for r in [loading_rank(rs.target, params)]:
            reqs = requests_of(rs.target, params, r)
            t0 = time.perf_counter()
            work, row = oarlock_plan(meta, reqs)
            dt = time.perf_counter() - t0
            want = sum(q.numel for q in reqs) * ITEM
            row["bytes"] = plan_bytes(work)
            assert row["bytes"] == want, f"oarlock's read items cover {row['bytes']} bytes for {want} requested " \
                                         f"(rank {r})"
            row.update(rank=r, plan_s=dt)
            plans[r] = (work, reqs)
            worst = row
        res["worst"] = worst
        res["rss"] = peak_rss() - base_rss  # the hashing model below is the simulator's, not a rank's
        r = worst["rank"]
        work, reqs = plans[r]
        del plans
        readers = ReaderIndex(rs.target, params)
        if isinstance(work, list):
            per_file: dict[str, list] = {}
            for it in work:
                per_file.setdefault(it.file, []).append(it)
            files, items_of = sorted(per_file), per_file.__getitem__
        else:
            files, items_of = work.files, lambda f: [it for it, _ in work.pairs_of(f, ordered=False)]
        h, touched, sampled = hashed_bytes(files, items_of, worst["bytes"] // ITEM, r, sim.file_layout(meta),
                                           readers, file_sizes, "owner" if lib == "oarlock" else "touched")
        res["worst"].update({"hashed": h, "touched": touched, "hash_sampled": sampled})
    res["total_s"] = time.perf_counter() - t_all
    return res


# ---------------------------------------------------------------- driver

LAYOUT_NAMES = {"fsdp2": "FSDP2 [Shard(0)]", "hsdp": "HSDP [D/64, 64] (Replicate, Shard(0))",
                "fsdp_tp8": "FSDP x TP8 [D/8, 8] (Shard(0), Shard(tp_dim))",
                "zero1": "ZeRO-1 (params replicated, moments flat ranges)",
                "ep64": "EP64 x FSDP (experts [D/64, 64] (Shard(1), Shard(0)); dense FSDP over D)"}
KIND = {"fsdp2": "fsdp2", "hsdp": "hsdp", "fsdp_tp8": "fsdp_tp", "zero1": "zero1", "ep64": "ep64"}
RESHARD_NAMES = {"lost": "one node lost", "fsdp_to_tp8": "FSDP -> TP8 x DP", "tp8_to_tp4": "TP8 -> TP4 x DP"}


def run_subprocess(args: list[str], timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(args)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return {"status": f"timeout ({timeout:.0f} s)"}
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["?"]
        return {"status": f"failed: {tail[0][:120]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(n: float) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{int(n)} B"


def fmt_s(x: float) -> str:
    return f"{x:.3f} s" if x < 10 else f"{x:.1f} s"


def table(title: str, results: dict[str, dict], libs: list[str]) -> str:
    rows = [("bookkeeping on disk", lambda r: mib(r["meta_bytes"] + r.get("digests_bytes", 0))
             + (f" (metadata.json {mib(r['meta_bytes'])}, checksums in it {mib(r['meta_checksum_bytes'])}"
                + (f"; digests files {mib(r['digests_bytes'])}" if "digests_bytes" in r else "") + ")"
                if "meta_checksum_bytes" in r else ""),
             lambda r: r["meta_bytes"] + r.get("digests_bytes", 0)),
            ("read + parse (per rank)", lambda r: fmt_s(r["parse_s"]), lambda r: r["parse_s"]),
            ("plan (loading rank)", lambda r: fmt_s(r["worst"]["plan_s"]) + f" (rank {r['worst']['rank']})",
             lambda r: r["worst"]["plan_s"]),
            ("read + plan", lambda r: fmt_s(r["parse_s"] + r["worst"]["plan_s"]),
             lambda r: r["parse_s"] + r["worst"]["plan_s"]),
            ("save coordination: coordinator receives", lambda r: mib(r["recv_coord"]), lambda r: r["recv_coord"]),
            ("save coordination: other rank receives", lambda r: mib(r["recv_other"]), lambda r: r["recv_other"]),
            ("coordinator's work", lambda r: fmt_s(r["coord_s"]), lambda r: r["coord_s"]),
            ("read items / files (that rank)", lambda r: f"{r['worst']['items']:,} / {r['worst']['files']:,}"
             + (f" (largest file {r['worst']['largest_file']:,})" if r["worst"].get("largest_file") else ""),
             lambda r: r["worst"]["items"]),
            ("bytes read (that rank)", lambda r: mib(r["worst"]["bytes"]) + (
                f" (storage {mib(r['worst']['storage_bytes'])})" if "storage_bytes" in r["worst"] else ""),
             lambda r: r["worst"].get("storage_bytes", r["worst"]["bytes"])),
            ("bytes hashed (that rank)", lambda r: ("~" if r["worst"].get("hash_sampled") else "")
             + mib(r["worst"]["hashed"]) if "hashed" in r["worst"] else "0 (no checksums)",
             lambda r: r["worst"].get("hashed")),
            ("peak RSS above runtime", lambda r: mib(r["rss"]), lambda r: r["rss"]),
            ("cell wall time (simulator)", lambda r: fmt_s(r["total_s"]), lambda r: r["total_s"])]
    ok = [l for l in libs if "status" not in results.get(l, {"status": "-"})]
    pairs = ratio_pairs(libs)
    head = "| | " + " | ".join(libs + [f"{a} / {b}" for a, b in pairs]) + " |"
    lines = [f"**{title}**", "", head, "|" + "---|" * (1 + len(libs) + len(ratio_pairs(libs)))]
    for name, show, val in rows:
        cells = []
        for l in libs:
            r = results.get(l, {})
            cells.append(r["status"] if "status" in r else show(r))
        ratios = []
        for a, b in ratio_pairs(libs):
            if a in ok and b in ok:
                va, vb = val(results[a]), val(results[b])
                ratios.append(f"{va / vb:.3g}x" if va is not None and vb else "-")
            else:
                ratios.append("-")
        lines.append(f"| {name} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def ratio_pairs(libs: list[str]) -> list[tuple[str, str]]:
    out = []
    if "oarlock" in libs and "oarlock-v1" in libs:
        out.append(("oarlock", "oarlock-v1"))
    for a in ("oarlock", "oarlock-v1"):
        if a in libs and "dcp" in libs:
            out.append((a, "dcp"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="70b,405b,dsv3")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (smaller runs)")
    ap.add_argument("--layouts", default="fsdp2,hsdp,fsdp_tp8,zero1,ep64")
    ap.add_argument("--reshards", default="lost,fsdp_to_tp8,tp8_to_tp4")
    ap.add_argument("--worlds", default="256,1024,4096")
    ap.add_argument("--libs", default=None, help="default: oarlock-v1,oarlock,dcp (oarlock when the grid API exists)")
    ap.add_argument("--max-ranks-v1", type=int, default=1024, help="skip oarlock-v1 cells above this world size")
    ap.add_argument("--max-ranks-dcp", type=int, default=1024, help="skip DCP cells above this world size")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per cell and library")
    ap.add_argument("--quick", action="store_true", help="one small cell: D=256, Llama-70B FSDP2, one node lost")
    ap.add_argument("--append-results", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(run_cell(*json.loads(args.worker))))
        return 0
    if args.quick:
        args.models, args.layouts, args.reshards, args.worlds = "70b", "fsdp2", "lost", "256"
    libs = (args.libs.split(",") if args.libs else
            ["oarlock-v1"] + (["oarlock"] if has_grid_api() else []) + ["dcp"])
    out = []
    for model in args.models.split(","):
        for lname in args.layouts.split(","):
            kind = KIND[lname]
            if kind == "ep64" and model != "dsv3":
                continue
            for rname in args.reshards.split(","):
                for world in (int(w) for w in args.worlds.split(",")):
                    rs = make_reshard(rname, kind, world)
                    if rs is None:
                        continue
                    results = {}
                    for lib in libs:
                        cap = {"oarlock-v1": args.max_ranks_v1, "dcp": args.max_ranks_dcp}.get(lib)
                        if cap is not None and world > cap:
                            results[lib] = {"status": "skipped (cap)"}
                            continue
                        results[lib] = run_subprocess([model, args.layers, kind, rname, world, lib], args.timeout)
                    title = (f"{MODELS[model][0]}{f' ({args.layers} layers)' if args.layers else ''}, "
                             f"{LAYOUT_NAMES[lname]}, D={world}: {RESHARD_NAMES[rname]} "
                             f"({rs.source.describe()} -> {rs.target.describe()}; {rs.note})")
                    text = table(title, results, libs)
                    print(text + "\n", flush=True)
                    out.append(text)
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    cmd = "python benchmarks/scale.py " + " ".join(argv if argv is not None else sys.argv[1:])
    footer = (f"Command: `{cmd.strip()}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
              f"{os.cpu_count()} cores; load average (1/5/15 min) at the end: {load})")
    print(footer)
    if args.append_results:
        import torch

        from _results import write_section  # benchmarks/_results.py: this script's own section

        write_section(__file__, "Scale simulator: bookkeeping, coordination, planning, verification per rank (issue 26)", ""
                    + footer + f", torch {torch.__version__}. One process stands in for one rank; figures from the "
                    "libraries' own planning code on the same shards (see the docstring of benchmarks/scale.py "
                    "for what each row counts). Times on a shared machine: compare ratios.\n\n"
                    + "\n\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
