"""The plan of a live reshard (:mod:`oarlock.checkpoint.runtime.live`, steps 1-3): describe the sources as a save
would, plan every target slice against them as a load does, and encode the requests each receiver sends its
senders (dtype codes, key and shard ids: fixed-size words). No tensor bytes move here."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from oarlock.checkpoint.runtime import transfer
from oarlock.checkpoint.runtime.dist import DistWrapper, error_report
from oarlock.checkpoint.runtime.live_errors import identity_mismatch, mismatch_error
from oarlock.checkpoint.errors import CheckpointError, CheckpointMismatchError
from oarlock.checkpoint.model.grid import GridLayout, rank_of_file
from oarlock.checkpoint.model.mapping import MappingProgram, box_slices
from oarlock.checkpoint.model.metadata import CheckpointMetadata
from oarlock.checkpoint.planning.load import Planner, ReadItem, source_specs
from oarlock.checkpoint.model.sharded import ShardedWeight, box_volume
from oarlock.checkpoint.model.traversal import Leaves
from oarlock.utils import dtype_name, numel, torch_dtype

#: Wire dtype codes of a request (an index into this tuple).
_WIRE_DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "uint16",
                "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2", "complex64")


@dataclass
class ReshardReport:
    """What one rank's part of a live reshard did.

    Attributes:
        missing_keys: target keys (on any rank) no source provides (their targets are untouched).
        unexpected_keys: source keys no target reads.
        skipped_keys: target keys an AOA config deliberately leaves alone (``_ -> key``).
        bytes_sent: bytes this rank's sources supplied, to other ranks and to itself, in the target dtype.
        bytes_received: bytes written into this rank's targets, from other ranks and from itself: the bytes of
            its target boxes, exactly (nothing else is fetched).
        bytes_local: the part of both that this rank copied from its own sources (no message).
        messages_sent, messages_received: point-to-point messages of tensor data (a chunk each).
        rounds: transfer rounds this rank took part in.
        seconds: wall time of the call on this rank; plan_seconds: the part spent describing, agreeing and
            planning (on a replayed :class:`WeightSync` run, the fingerprint check).
        plan_reused: the plan of the previous :meth:`WeightSync.run` was replayed.
        staging_peak_bytes: the most bytes of staging buffers (packed chunks, receive buffers, casts, gathered
            strided slices, slices being assembled) this rank held at once; at most ``bucket_bytes`` plus one
            round's and one straddling slice's worth.
    """

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    skipped_keys: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    rounds: int = 0
    seconds: float = 0.0
    plan_seconds: float = 0.0
    plan_reused: bool = False
    staging_peak_bytes: int = 0


# ---------------------------------------------------------------- the plan of one rank

@dataclass
class Send:
    """A slice this rank sends: ``leaf`` (index into its source shards), the stored piece's flat start and
    shape, the box inside it, the wire dtype, its bytes."""

    leaf: int
    key: str
    flat_start: int
    shape: tuple[int, ...]
    box: tuple
    dtype: torch.dtype
    nbytes: int


@dataclass
class Recv:
    """A slice this rank receives: target ``leaf``, its read item (cast already done by the sender), bytes."""

    leaf: int
    item: ReadItem
    nbytes: int


@dataclass
class LivePlan:
    fingerprint: str
    sends: dict[int, list[Send]]
    recvs: dict[int, list[Recv]]
    local: list[tuple[Send, Recv]]
    chunk_bytes: int
    missing: list[str]
    unexpected: list[str]
    skipped: list[str]


def strip_layouts(leaves: Leaves) -> None:
    """Forget DTensor meshes and flat partitions (their ranks are the job's own, not a joined group's): the
    shards are then described one by one, which is always right."""
    for sw in leaves.shards:
        sw.placement_layout = None
        sw.flat_partition = None


def live_fingerprint(src: Leaves, tgt: Leaves, dw: DistWrapper, settings: tuple) -> str:
    """SHA-256 over what a plan depends on: every shard's key, dtype, global shape, box, flat range, device and
    placements on both sides, the group, and the settings."""
    meshes: dict[int, str] = {}  # DeviceMesh.mesh is rebuilt on every access (0.1 ms): once per mesh and call

    def ranks_of(mesh: Any) -> str:
        got = meshes.get(id(mesh))
        if got is None:
            got = meshes[id(mesh)] = repr(mesh.mesh.tolist())
        return got

    def rows(leaves: Leaves) -> list:
        out = []
        for sw in leaves.shards:
            pl = sw.placement_layout
            out.append((sw.key, str(sw.local_tensor.dtype), sw.global_shape, sw.global_offset, sw.local_shape,
                        sw.flattened_range, sw.local_tensor.device.type,
                        None if pl is None else (repr(pl[1]), ranks_of(pl[0]))))
        return out

    group = dw.group
    if isinstance(group, transfer.PeerGroup):
        gid: Any = ("peer", id(group.pg), group.rank, group.size)
    elif group is None:
        gid = ("default", dw.rank, dw.size)
    else:
        import torch.distributed as dist

        gid = ("group", tuple(dist.get_process_group_ranks(group)), dw.rank)
    doc = [rows(src), rows(tgt), gid, settings]
    return hashlib.sha256(json.dumps(doc, default=repr).encode()).hexdigest()


def quick_signature(state: Any) -> list:
    """Identity of every tensor leaf and its storage (object, data pointer, shape, dtype): equal signatures mean
    the same tensors as last run, so their descriptions (and the fingerprint) still hold. A DTensor's placements
    cannot change without a new DTensor object."""
    from oarlock.checkpoint.model.traversal import iter_leaves

    out = []
    for path, leaf in iter_leaves(state):
        if isinstance(leaf, ShardedWeight):
            t = leaf.local_tensor
            out.append((path, id(t), t.data_ptr(), tuple(t.shape), t.dtype, leaf.global_shape, leaf.global_offset,
                        leaf.local_shape, leaf.flattened_range))
            continue
        t = getattr(leaf, "_local_tensor", leaf)  # a DTensor's local shard, else the leaf itself
        if isinstance(t, torch.Tensor):
            out.append((path, id(leaf), id(t), t.data_ptr(), tuple(t.shape), t.dtype))
        else:
            out.append((path, id(leaf)))
    return out


def _describe_sources(src: Leaves, dw: DistWrapper) -> CheckpointMetadata:
    """Collective: the sources' layout as checkpoint metadata whose "files" are the ranks that send each piece."""
    from oarlock.checkpoint.runtime.save import RankRecord, build_layout, describe_rank

    def describe() -> tuple:
        rec, _ = describe_rank(src, dw)
        rec.objects = {}
        return rec, (rec.spec_fingerprint(), rec.listed_fingerprint())

    mine: tuple = (None, None)
    err = None
    try:
        mine = describe()
    except Exception as e:
        err = e
    both = dw.all_gather_object((None if err is None else error_report(err, dw.rank), mine[1]))
    dw.raise_reports([b[0] for b in both], err)
    first: dict[tuple, int] = {}
    for r, (_, fp) in enumerate(both):
        first.setdefault(tuple(fp), r)
    rec = mine[0]
    parts = dw.gather_from((rec.tensors, rec.listed, rec.nested, rec.tp_layouts)
                           if first[tuple(mine[1])] == dw.rank else None, set(first.values()))
    out: Any = None
    if dw.is_coordinator:
        try:
            classes = {}
            for r, (_, fp) in enumerate(both):
                fp = tuple(fp)
                if fp not in classes:
                    t, listed, nested, tpl = parts[first[fp]]
                    classes[fp] = (RankRecord(t, listed, {}, nested, tpl), [])
                classes[fp][1].append(r)
            layout = build_layout(list(classes.values()), dw.size)
            extra: dict[str, Any] = {"tp_layouts": layout.tp_layouts} if layout.tp_layouts else {}
            holders = holder_sets(list(classes.values()), layout.tensors)
            if holders:
                extra["holders"] = holders
            meta = CheckpointMetadata("oarlock", tensors=layout.tensors, extra=extra)
            out = (None, meta.to_json())
        except Exception as e:
            out = (error_report(e, dw.rank), None)
    rep, doc = dw.broadcast_object(out, 0)
    if rep is not None:
        dw.raise_reports([rep])
    return CheckpointMetadata.from_json(doc, source="the live sources' layout")


def source_view(t: torch.Tensor, flat_start: int, shape: tuple[int, ...], box: tuple) -> torch.Tensor:
    """``box`` of the stored piece of ``shape`` that starts ``flat_start`` elements into local tensor ``t``."""
    if flat_start or t.dim() != len(shape):
        t = t.reshape(-1)[flat_start:flat_start + numel(shape)].view(shape)
    return t[box_slices(box)]


def row_bytes(box: tuple, dtype: torch.dtype) -> int:
    """Bytes of one row (the trailing dims) of a slice with ``box``: the unit a big slice's chunks are cut in."""
    return numel(b - a for a, b in box[1:]) * dtype.itemsize if box else dtype.itemsize


def aligned_to(buf: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``buf`` (bytes) where it can be viewed as ``t``'s dtype: copied when it starts at an odd offset (a slice
    packed after an odd-sized one)."""
    return buf.clone() if buf.data_ptr() % t.element_size() else buf


def _encode(items: list[tuple[ReadItem, torch.dtype, int]], key_ids: dict[str, int]) -> list[int]:
    """A receiver's request to one sender, as int64s: per slice ``key, shard (-1: grid), flat start, wire dtype,
    ndim, shape..., box starts..., box stops...``."""
    out: list[int] = []
    for it, dt, sid in items:
        nd = len(it.src_shape)
        out += [key_ids[it.src_key], sid, it.src_flat_start, _WIRE_DTYPES.index(dtype_name(dt)), nd, *it.src_shape]
        out += [a for a, _ in it.src_box] + [b for _, b in it.src_box]
    return out


def _decode(words: list[int], peer: int, keys: list[str], meta: CheckpointMetadata, local: dict,
            src: Leaves, me: int, holders: "Holders") -> list[Send]:
    """A request from receiver ``peer``, checked against what this rank holds (a peer is never trusted with an
    index: every key, shard, range and box is bounds-checked).

    Raises:
        CheckpointError: naming the peer and the slice at fault.
    """
    from oarlock.checkpoint.model.grid import data_file_name

    out: list[Send] = []
    i, n = 0, len(words)
    mine = data_file_name(me)

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"live reshard: rank {peer} asked rank {me} for a slice it cannot send: {why}")

    while i < n:
        if i + 5 > n:
            raise bad("truncated request")
        kid, sid, flat, did, nd = words[i:i + 5]
        if not 0 <= kid < len(keys) or not 0 <= did < len(_WIRE_DTYPES) or not 0 <= nd <= 64 or i + 5 + 3 * nd > n:
            raise bad(f"malformed entry at word {i}")
        shape = tuple(words[i + 5:i + 5 + nd])
        lo, hi = words[i + 5 + nd:i + 5 + 2 * nd], words[i + 5 + 2 * nd:i + 5 + 3 * nd]
        i += 5 + 3 * nd
        key = keys[kid]
        tm = meta.tensors[key]
        if sid < 0:
            leaf = local.get((key, None))
        else:
            shards = tm.shards
            if sid >= len(shards) or (shards[sid].file != mine and me not in holders.listed.get(
                    (key, rank_of_file(shards[sid].file), shards[sid].name), ())):
                raise bad(f"key {key!r}: shard {sid} is not this rank's")
            s = shards[sid]
            leaf = local.get((key, (tuple(s.global_offset), s.flattened_range)))
        if leaf is None:
            raise bad(f"key {key!r} is not held here")
        t = src.shards[leaf].local_tensor
        if flat < 0 or any(x < 0 for x in shape) or flat + numel(shape) > t.numel() \
                or any(not 0 <= a <= b <= e for a, b, e in zip(lo, hi, shape)):
            raise bad(f"key {key!r}: box {list(zip(lo, hi))} of a piece of shape {list(shape)} at element {flat} "
                      f"lies outside the {t.numel()} elements held")
        box = tuple(zip(lo, hi))
        dt = torch_dtype(_WIRE_DTYPES[did])
        out.append(Send(leaf, key, flat, shape, box, dt, box_volume(box) * dt.itemsize))
    return out


def make_plan(src: Leaves, tgt: Leaves, dw: DistWrapper, aoa_config: Any, program: MappingProgram | None,
          strict: bool, bucket_bytes: int, fingerprint: str) -> LivePlan:
    """Collective: steps 1-3 of the module docstring. Raises on every rank alike, before any target byte is
    written (mismatched shapes or dtypes, missing or unexpected keys under ``strict``, bad AOA)."""
    from oarlock.checkpoint.runtime.load import (compile_aoa_for_load, destination_request, fmt_keys, gather_requests,
                                                 request_record)

    meta = _describe_sources(src, dw)
    gathered = gather_requests(lambda: request_record(tgt, dw, with_offsets=program is None), dw)
    state: dict[str, Any] = {}

    def plan_here() -> dict | None:
        nonlocal program
        dest_all, counts = destination_request(gathered)
        cfg = aoa_config
        if cfg is None and program is None and meta.extra.get("tp_layouts"):
            cfg = []
        specs = source_specs(meta)
        if cfg is not None:
            try:
                program = compile_aoa_for_load(cfg, specs, dest_all, meta, counts)
            except CheckpointError as e:  # a shape or dtype mismatch: said with both sides' keys and shapes
                plain = mismatch_error(e, cfg, specs)
                if plain is None:
                    raise
                raise plain from None
        elif program is None:
            identity_mismatch(dest_all, specs)
        planner = Planner(meta, program)
        missing: set[str] = set()
        items: list[tuple[int, ReadItem]] = []
        for i, sw in enumerate(tgt.shards):
            p = planner.plan_rank([sw.desc])
            missing.update(p.missing_keys)
            items.extend((i, it) for it in p.all_items())
        skipped = missing & set(getattr(planner.program, "skipped", ()) or ())
        missing -= skipped
        dest_keys = set(planner.program.destination_keys())
        used = {m.src_key for k in dest_all if k in dest_keys for m in planner.mappings(k)}
        used.update(getattr(planner.program, "deleted_keys", ()) or ())
        state.update(items=items, unexpected=sorted(k for k in meta.tensors if k not in used))
        return {"missing": sorted(missing), "skipped": sorted(skipped)} if missing or skipped else None

    status = [s for s in dw.gather_if_any(plan_here) or () if s]
    missing = sorted({k for s in status for k in s["missing"]})
    skipped = sorted({k for s in status for k in s["skipped"]})
    unexpected = state["unexpected"]
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing keys (wanted by a target, held by no source): {fmt_keys(missing)}")
        if unexpected:
            parts.append(f"unexpected keys (held by a source, wanted by no target): {fmt_keys(unexpected)}")
        raise CheckpointMismatchError("live reshard: " + "; ".join(parts) + " (map them with an AOA config, or pass "
                                      "strict=False to move the rest)")
    keys = sorted(meta.tensors)
    key_ids = {k: i for i, k in enumerate(keys)}
    me = dw.rank
    holders = Holders(meta)
    # what this rank receives, by sender (replicated pieces spread over their holders); its own slices are copied
    recvs: dict[int, list[Recv]] = {}
    wanted: dict[int, list[tuple[ReadItem, torch.dtype, int]]] = {}
    spread = spread_over_holders(state["items"], holders, tgt, me)
    for leaf, it, sid in sorted(spread, key=lambda x: (rank_of_file(x[1].file), x[1].src_key, x[1].name,
                                                       x[1].src_flat_start, x[1].src_box, x[0])):
        sender = rank_of_file(it.file)
        dt = tgt.shards[leaf].local_tensor.dtype
        recvs.setdefault(sender, []).append(Recv(leaf, it._replace(dtype=None), it.numel * dt.itemsize))
        wanted.setdefault(sender, []).append((it, dt, sid))
    words = {s: _encode(w, key_ids) for s, w in wanted.items()}
    local_index = _local_index(src, meta)

    def exchange() -> dict[int, list[Send]]:
        counts = transfer.all_to_all_counts(dw, [len(words.get(r, ())) if r != me else 0 for r in range(dw.size)])
        dev = dw.comm_device()
        out_bufs = [(torch.tensor(words[r], dtype=torch.int64, device=dev), r) for r in sorted(words)
                    if r != me and words[r]]
        in_bufs = [(torch.empty(c, dtype=torch.int64, device=dev), r) for r, c in enumerate(counts) if c and r != me]
        for w in transfer.post(dw, out_bufs, in_bufs):
            w.wait()
        sends = {r: _decode(b.cpu().tolist(), r, keys, meta, local_index, src, me, holders) for b, r in in_bufs}
        if me in words:
            sends[me] = _decode(words[me], me, keys, meta, local_index, src, me, holders)
        return sends

    sends = dw.run(exchange)
    local = list(zip(sends.pop(me, []), recvs.pop(me, [])))
    fan = max(len(sends), len(recvs))
    fan = int(dw.all_max_tensor(torch.tensor([fan], dtype=torch.int64))[0]) if dw.active else fan
    return LivePlan(fingerprint, sends, recvs, local, transfer.chunk_bytes_for(bucket_bytes, fan), missing,
                 unexpected, skipped)


# ---------------------------------------------------------------- replicated pieces: one sender per requested slice

#: A requested slice of a piece held by several ranks is cut into row ranges, one per holder, when each range would
#: have at least this many bytes (slices of :data:`~oarlock.checkpoint.runtime.transfer.ALONE_BYTES` or more only
#: into ranges of that size, which still travel without staging); smaller slices go whole to the holder this
#: receiver has asked least so far.
SPLIT_PART_BYTES = 4 << 10


def holder_sets(classes: list[tuple[Any, list[int]]], tensors: dict) -> dict:
    """(Coordinator) every listed piece held by more than one rank, for the metadata's ``extra["holders"]``:
    ``{"sets": [[ranks], ...], "pieces": [[key, recorded sender, stored name, set index], ...]}`` (one entry per
    replicated piece, each distinct holder set once); ``{}`` when no piece is replicated."""
    held: dict[tuple, set[int]] = {}
    for rec, members in classes:
        for key, _, _, off, lshape, fr, nbytes in rec.listed:
            if nbytes:
                held.setdefault((key, tuple(off), tuple(lshape), None if fr is None else tuple(fr)),
                                set()).update(members)
    if not any(len(h) > 1 for h in held.values()):
        return {}
    sets: list[list[int]] = []
    index: dict[tuple, int] = {}
    pieces = []
    for key, tm in tensors.items():
        if tm.grid is not None:
            continue
        for s in tm.shards:
            fr = None if s.flattened_range is None else tuple(s.flattened_range)
            h = held.get((key, tuple(s.global_offset), tuple(s.local_shape), fr))
            if h is not None and len(h) > 1:
                hs = tuple(sorted(h))
                if hs not in index:
                    index[hs] = len(sets)
                    sets.append(list(hs))
                pieces.append([key, rank_of_file(s.file), s.name, index[hs]])
    return {"sets": sets, "pieces": pieces}


class Holders:
    """Which ranks hold a stored piece of the live layout: the listed replicas of ``extra["holders"]``, and the
    replicas of a DTensor grid rule (its ``Replicate`` mesh dims)."""

    def __init__(self, meta: CheckpointMetadata):
        h = meta.extra.get("holders") or {}
        sets = [tuple(int(r) for r in x) for x in h.get("sets", ())]
        self.listed: dict[tuple, tuple[int, ...]] = {(k, int(r), n): sets[i] for k, r, n, i in h.get("pieces", ())}
        self.listed_keys = {k for k, _, _ in self.listed}
        self.meta = meta
        self._grid: dict[tuple[str, int], tuple[int, ...] | None] = {}
        self._ids: dict[str, dict[tuple[str, str], int]] = {}

    def of(self, it: ReadItem) -> tuple[int, ...] | None:
        """The ranks holding the piece ``it`` reads (None: only its recorded sender)."""
        w = rank_of_file(it.file)
        if it.src_key in self.listed_keys:
            return self.listed.get((it.src_key, w, it.name))
        grid = self.meta.tensors[it.src_key].grid
        if not isinstance(grid, GridLayout) or not grid.replicas:
            return None
        got = self._grid.get((it.src_key, w), False)
        if got is False:
            got = self._grid[(it.src_key, w)] = _grid_holders(grid, w)
        return got

    def shard_id(self, it: ReadItem) -> int:
        """The index of the recorded shard ``it`` reads in its key's shard list (-1: a grid-recorded key)."""
        tm = self.meta.tensors[it.src_key]
        if tm.grid is not None and tm._shards is None:
            return -1
        idx = self._ids.get(it.src_key)
        if idx is None:  # a stored name is unique within its sender's "file", not across them
            idx = self._ids[it.src_key] = {(s.file, s.name): j for j, s in enumerate(tm.shards)}
        return idx[(it.file, it.name)]


def _grid_holders(grid: GridLayout, writer: int) -> tuple[int, ...] | None:
    """The holders of the cell ``writer`` writes (a rank holds one cell of a DTensor): its digits read back from
    the affine rank rule; None when they do not give back ``writer``."""
    rel = writer - grid.base
    cell, i = [], 0
    for cs in grid.chunks:
        e = 0
        for n in cs:
            e = e * n + (rel // grid.strides[i]) % n if grid.strides[i] > 0 else e * n
            i += 1
        cell.append(e)
    try:
        if grid.writer(cell) != writer:
            return None
        return tuple(sorted(grid.holders(cell)))
    except (IndexError, ValueError):
        return None


def split_rows(it: ReadItem, k: int) -> list[ReadItem] | None:
    """``it`` cut into ``k`` ranges of its outermost source dim of at least ``k`` elements (the matching
    destination dim cut alike); None when the boxes do not correspond dim for dim."""
    nd = len(it.src_box)
    perm = tuple(it.permute) if it.permute is not None else tuple(range(nd))
    if len(it.dst_box) != nd or sorted(perm) != list(range(nd)):
        return None
    d = next((j for j in range(nd) if it.src_box[j][1] - it.src_box[j][0] >= k), None)
    if d is None:
        return None
    i = perm.index(d)
    (a, b), (c, _) = it.src_box[d], it.dst_box[i]
    if it.dst_box[i][1] - c != b - a:
        return None
    out = []
    for j in range(k):
        lo, hi = a + (b - a) * j // k, a + (b - a) * (j + 1) // k
        sb, db = list(it.src_box), list(it.dst_box)
        sb[d], db[i] = (lo, hi), (c + lo - a, c + hi - a)
        out.append(it._replace(src_box=tuple(sb), dst_box=tuple(db)))
    return out


def spread_over_holders(items: list[tuple[int, ReadItem]], holders: Holders, tgt: Leaves, me: int
                        ) -> list[tuple[int, ReadItem, int]]:
    """``(target leaf, item, shard id)`` of this rank's read items, each replicated piece's slices sent by its
    holders: by this rank itself when it holds one (a local copy); else a big slice in row ranges, one per holder,
    and a small one whole by the holder this rank has asked fewest bytes of so far (ties broken by a rotation
    seeded with the key and this rank, so that consecutive receivers start on different holders). Decided by each
    receiver from its own slices only; the holders' totals even out over the receivers."""
    import zlib

    from oarlock.checkpoint.model.grid import data_file_name
    from oarlock.checkpoint.runtime.transfer import ALONE_BYTES

    out: list[tuple[int, ReadItem, int]] = []
    asked: dict[int, int] = {}
    todo = []
    for leaf, it in items:
        hs = holders.of(it)
        sid = holders.shard_id(it)
        if hs is None or len(hs) < 2:
            out.append((leaf, it, sid))
        elif me in hs:
            out.append((leaf, it._replace(file=data_file_name(me)), sid))
        else:
            todo.append((it.numel * tgt.shards[leaf].local_tensor.element_size(), leaf, it, sid, hs))
    todo.sort(key=lambda x: (-x[0], x[2].src_key, x[2].dst_box, x[1]))
    for nbytes, leaf, it, sid, hs in todo:
        n = len(hs)
        start = (zlib.crc32(it.src_key.encode()) + me) % n
        k = min(n, nbytes // (ALONE_BYTES if nbytes >= ALONE_BYTES else SPLIT_PART_BYTES))
        parts = split_rows(it, k) if k > 1 else None
        if parts is None:
            h = min(range(n), key=lambda j: (asked.get(hs[j], 0), (j - start) % n))
            parts, order = [it], [hs[h]]
        else:
            order = [hs[(start + j) % n] for j in range(k)]
        for part, h in zip(parts, order):
            asked[h] = asked.get(h, 0) + part.numel * (nbytes // max(it.numel, 1))
            out.append((leaf, part._replace(file=data_file_name(h)), sid))
    return out


def _local_index(src: Leaves, meta: CheckpointMetadata) -> dict:
    """``(key, None)`` -> the leaf of a grid-recorded key this rank holds; ``(key, (offset, flat range))`` -> the
    leaf of a listed shard."""
    out: dict = {}
    for i, sw in enumerate(src.shards):
        tm = meta.tensors.get(sw.key)
        if tm is None:
            continue
        if tm.grid is not None and tm._shards is None:
            out.setdefault((sw.key, None), i)
        out[(sw.key, (tuple(sw.global_offset), sw.flattened_range))] = i
    return out


# ---------------------------------------------------------------- moving the bytes
