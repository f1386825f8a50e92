"""Live resharding: move tensors from the layout the ranks of a running job hold (``sources``) into another
layout they want filled in place (``targets``), in memory, between the ranks of one process group
(``docs/live-resharding.md``). The weight synchronisation of reinforcement learning is the main use: a trainer
in FSDP/TP/EP pushes its new weights into an inference engine in another TP layout after every step.

The pieces are those of a load through a checkpoint, with the sources' description playing the metadata's role:

1. *Describe the sources* as a save would (:func:`~oarlock.checkpoint.save.describe_rank`): a DTensor is one grid
   rule per mesh, ZeRO flat ranges one flat rule, other shards are listed; ranks with equal descriptions form one
   class and one member of each sends it to rank 0, which builds the layout
   (:func:`~oarlock.checkpoint.save.build_layout`: one holder of each replicated box is picked, byte-balanced)
   and broadcasts it. The "file" of a stored piece names the rank that sends it.
2. *Plan* each rank's targets against it exactly as a load does (:class:`~oarlock.checkpoint.plan.Planner`,
   through AOA when a config is given): every slice of a target gets one source slice and its sender.
3. *Ask*: each receiver sends each of its senders the list of slices it wants (one ``all_to_all`` of counts,
   then one message per pair that has something to move); no rank learns the other ranks' plans.
4. *Move* the bytes in bounded, double-buffered rounds (:mod:`oarlock.checkpoint.transfer`), cast to the
   target dtype by the sender, permuted into place by the receiver; slices a rank sends itself are copied.

:class:`WeightSync` keeps the plan (steps 1-3) and replays step 4 after a fixed-size fingerprint check.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from oarlock.checkpoint import transfer
from oarlock.checkpoint.dist import DistWrapper, error_report
from oarlock.checkpoint.errors import CheckpointError, CheckpointMismatchError
from oarlock.checkpoint.executor import destination_view, place, source_shaped_view
from oarlock.checkpoint.grid import rank_of_file
from oarlock.checkpoint.mapping import MappingProgram, box_extent, box_slices
from oarlock.checkpoint.metadata import CheckpointMetadata
from oarlock.checkpoint.plan import Planner, ReadItem, source_specs
from oarlock.checkpoint.sharded import ShardedWeight, box_volume
from oarlock.checkpoint.traversal import Leaves, collect_leaves
from oarlock.utils import dtype_name, gc_paused, numel, torch_dtype

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
class _Send:
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
class _Recv:
    """A slice this rank receives: target ``leaf``, its read item (cast already done by the sender), bytes."""

    leaf: int
    item: ReadItem
    nbytes: int


@dataclass
class _Plan:
    fingerprint: str
    sends: dict[int, list[_Send]]
    recvs: dict[int, list[_Recv]]
    local: list[tuple[_Send, _Recv]]
    chunk_bytes: int
    missing: list[str]
    unexpected: list[str]
    skipped: list[str]


def _strip_layouts(leaves: Leaves) -> None:
    """Forget DTensor meshes and flat partitions (their ranks are the job's own, not a joined group's): the
    shards are then described one by one, which is always right."""
    for sw in leaves.shards:
        sw.placement_layout = None
        sw.flat_partition = None


def _fingerprint(src: Leaves, tgt: Leaves, dw: DistWrapper, settings: tuple) -> str:
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


def _quick_signature(state: Any) -> list:
    """Identity of every tensor leaf and its storage (object, data pointer, shape, dtype): equal signatures mean
    the same tensors as last run, so their descriptions (and the fingerprint) still hold. A DTensor's placements
    cannot change without a new DTensor object."""
    from oarlock.checkpoint.traversal import iter_leaves

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
    from oarlock.checkpoint.save import RankRecord, build_layout, describe_rank

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
            meta = CheckpointMetadata("oarlock", tensors=layout.tensors,
                                      extra={"tp_layouts": layout.tp_layouts} if layout.tp_layouts else {})
            out = (None, meta.to_json())
        except Exception as e:
            out = (error_report(e, dw.rank), None)
    rep, doc = dw.broadcast_object(out, 0)
    if rep is not None:
        dw.raise_reports([rep])
    return CheckpointMetadata.from_json(doc, source="the live sources' layout")


def _source_view(t: torch.Tensor, flat_start: int, shape: tuple[int, ...], box: tuple) -> torch.Tensor:
    """``box`` of the stored piece of ``shape`` that starts ``flat_start`` elements into local tensor ``t``."""
    if flat_start or t.dim() != len(shape):
        t = t.reshape(-1)[flat_start:flat_start + numel(shape)].view(shape)
    return t[box_slices(box)]


def _row_bytes(box: tuple, dtype: torch.dtype) -> int:
    """Bytes of one row (the trailing dims) of a slice with ``box``: the unit a big slice's chunks are cut in."""
    return numel(b - a for a, b in box[1:]) * dtype.itemsize if box else dtype.itemsize


def _aligned(buf: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``buf`` (bytes) where it can be viewed as ``t``'s dtype: copied when it starts at an odd offset (a slice
    packed after an odd-sized one)."""
    return buf.clone() if buf.data_ptr() % t.element_size() else buf


def _encode(items: list[tuple[ReadItem, torch.dtype]], key_ids: dict[str, int], shard_ids: Any) -> list[int]:
    """A receiver's request to one sender, as int64s: per slice ``key, shard (-1: grid), flat start, wire dtype,
    ndim, shape..., box starts..., box stops...``."""
    out: list[int] = []
    for it, dt in items:
        nd = len(it.src_shape)
        out += [key_ids[it.src_key], shard_ids(it.src_key, it.name), it.src_flat_start,
                _WIRE_DTYPES.index(dtype_name(dt)), nd, *it.src_shape]
        out += [a for a, _ in it.src_box] + [b for _, b in it.src_box]
    return out


def _decode(words: list[int], peer: int, keys: list[str], meta: CheckpointMetadata, local: dict,
            src: Leaves, me: int) -> list[_Send]:
    """A request from receiver ``peer``, checked against what this rank holds (a peer is never trusted with an
    index: every key, shard, range and box is bounds-checked).

    Raises:
        CheckpointError: naming the peer and the slice at fault.
    """
    from oarlock.checkpoint.grid import data_file_name

    out: list[_Send] = []
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
            if sid >= len(shards) or shards[sid].file != mine:
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
        out.append(_Send(leaf, key, flat, shape, box, dt, box_volume(box) * dt.itemsize))
    return out


def _plan(src: Leaves, tgt: Leaves, dw: DistWrapper, aoa_config: Any, program: MappingProgram | None,
          strict: bool, bucket_bytes: int, fingerprint: str) -> _Plan:
    """Collective: steps 1-3 of the module docstring. Raises on every rank alike, before any target byte is
    written (mismatched shapes or dtypes, missing or unexpected keys under ``strict``, bad AOA)."""
    from oarlock.checkpoint.load import (compile_aoa_for_load, destination_request, fmt_keys, gather_requests,
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
        if cfg is not None:
            program = compile_aoa_for_load(cfg, source_specs(meta), dest_all, meta, counts)
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
    shard_index: dict[str, dict[str, int]] = {}

    def shard_ids(key: str, name: str) -> int:
        tm = meta.tensors[key]
        if tm.grid is not None and tm._shards is None:
            return -1
        idx = shard_index.get(key)
        if idx is None:
            idx = shard_index[key] = {s.name: j for j, s in enumerate(tm.shards)}
        return idx[name]

    # what this rank receives, by sender; the slices it holds itself are copied
    recvs: dict[int, list[_Recv]] = {}
    wanted: dict[int, list[tuple[ReadItem, torch.dtype]]] = {}
    for leaf, it in sorted(state["items"], key=lambda x: (rank_of_file(x[1].file), x[1].src_key, x[1].name,
                                                          x[1].src_flat_start, x[1].src_box, x[0])):
        sender = rank_of_file(it.file)
        dt = tgt.shards[leaf].local_tensor.dtype
        recvs.setdefault(sender, []).append(_Recv(leaf, it._replace(dtype=None), it.numel * dt.itemsize))
        wanted.setdefault(sender, []).append((it, dt))
    words = {s: _encode(w, key_ids, shard_ids) for s, w in wanted.items()}
    local_index = _local_index(src, meta)
    me = dw.rank

    def exchange() -> dict[int, list[_Send]]:
        counts = transfer.all_to_all_counts(dw, [len(words.get(r, ())) if r != me else 0 for r in range(dw.size)])
        dev = dw.comm_device()
        out_bufs = [(torch.tensor(words[r], dtype=torch.int64, device=dev), r) for r in sorted(words)
                    if r != me and words[r]]
        in_bufs = [(torch.empty(c, dtype=torch.int64, device=dev), r) for r, c in enumerate(counts) if c and r != me]
        for w in transfer.post(dw, out_bufs, in_bufs):
            w.wait()
        sends = {r: _decode(b.cpu().tolist(), r, keys, meta, local_index, src, me) for b, r in in_bufs}
        if me in words:
            sends[me] = _decode(words[me], me, keys, meta, local_index, src, me)
        return sends

    sends = dw.run(exchange)
    local = list(zip(sends.pop(me, []), recvs.pop(me, [])))
    fan = max(len(sends), len(recvs))
    fan = int(dw.all_max_tensor(torch.tensor([fan], dtype=torch.int64))[0]) if dw.active else fan
    return _Plan(fingerprint, sends, recvs, local, transfer.chunk_bytes_for(bucket_bytes, fan), missing,
                 unexpected, skipped)


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

class _Mover:
    """Step 4 on one rank: local copies, then the rounds (see :mod:`oarlock.checkpoint.transfer`)."""

    def __init__(self, plan: _Plan, src: Leaves, tgt: Leaves, dw: DistWrapper, verify: bool,
                 report: ReshardReport, bucket_bytes: int):
        self.plan, self.src, self.tgt, self.dw, self.verify, self.report = plan, src, tgt, dw, verify, report
        self.dev = dw.comm_device()
        c = plan.chunk_bytes
        self.out_chunks = {r: transfer.cut_stream([s.nbytes for s in ss], c, units=[_row_bytes(s.box, s.dtype)
                                                                                      for s in ss])
                           for r, ss in plan.sends.items()}
        self.in_chunks = {r: transfer.cut_stream([x.nbytes for x in xs], c, units=[self._unit(x) for x in xs])
                          for r, xs in plan.recvs.items()}
        self.packed: dict[tuple[int, int], torch.Tensor] = {}  # (receiver, slice) -> bytes, while it straddles
        self.staged: dict[tuple[int, int], torch.Tensor] = {}  # (sender, slice) -> bytes being assembled
        self.bad: set[str] = set()
        self.staging = 0  # bytes of send staging made so far (a round's share is its growth while it is packed)
        self.recv_staging = 0  # the same for receive buffers
        self.bucket_bytes = bucket_bytes

    def _unit(self, x: _Recv) -> int:
        return _row_bytes(x.item.src_box, self.tgt.shards[x.leaf].local_tensor.dtype)

    # -- sender side
    def _slice_rows(self, s: _Send, a: int, b: int) -> torch.Tensor:
        """Bytes ``[a, b)`` of a slice's stream form (row-aligned for slices that travel alone; the whole slice
        otherwise), cast and gathered into contiguous memory only when it has to be (counted as staging)."""
        v = _source_view(self.src.shards[s.leaf].local_tensor, s.flat_start, s.shape, s.box)
        whole = a == 0 and b == s.nbytes
        if not whole:
            u = _row_bytes(s.box, s.dtype)
            v = v[a // u:b // u]
        src = v
        if v.dtype != s.dtype:
            v = v.to(s.dtype)
        if v.device != self.dev:
            v = v.to(self.dev)
        out = transfer.as_bytes(v.contiguous())
        if out.data_ptr() != src.data_ptr() or v is not src:
            self.staging += out.numel()  # a cast, a device move or a gather of a strided slice
        return out

    def _small_bytes(self, r: int, i: int, s: _Send) -> torch.Tensor:
        """The whole stream form of a small slice (packed with others), kept while it straddles two chunks."""
        got = self.packed.get((r, i))
        if got is None:
            v = _source_view(self.src.shards[s.leaf].local_tensor, s.flat_start, s.shape, s.box)
            got = self.packed[(r, i)] = transfer.as_bytes(v.to(device=self.dev, dtype=s.dtype).contiguous())
        return got

    def _pack(self, r: int, k: int) -> torch.Tensor:
        segs = self.out_chunks[r][k]
        slices = self.plan.sends[r]
        n = segs[-1].offset + segs[-1].stop - segs[-1].start
        if len(segs) == 1 and slices[segs[0].index].nbytes >= transfer.ALONE_BYTES:
            sg = segs[0]  # a big slice's rows: from the source, gathered only if strided
            out = self._slice_rows(slices[sg.index], sg.start, sg.stop)
            if self.verify:
                out = torch.cat([out, torch.zeros(transfer._HASH_BYTES, dtype=torch.uint8, device=self.dev)])
                self.staging += out.numel()
        else:
            out = torch.empty(n + (transfer._HASH_BYTES if self.verify else 0), dtype=torch.uint8, device=self.dev)
            self.staging += out.numel()
            for sg in segs:
                out[sg.offset:sg.offset + sg.stop - sg.start] = self._small_bytes(r, sg.index, slices[sg.index])[
                    sg.start:sg.stop]
                if sg.stop == slices[sg.index].nbytes:
                    self.packed.pop((r, sg.index), None)
        if self.verify:
            out[n:] = torch.tensor([transfer.chunk_hash(out[:n])], dtype=torch.int64).view(torch.uint8)
            if transfer._tamper is not None:
                transfer._tamper(self.dw.rank, r, k, out)
        self.report.messages_sent += 1
        self.report.bytes_sent += n
        return out

    # -- receiver side
    def _direct(self, x: _Recv) -> torch.Tensor | None:
        """The target's bytes this slice fills, when they are contiguous and need no permutation."""
        t = self.tgt.shards[x.leaf].local_tensor
        if x.item.permute is not None or t.device != self.dev:
            return None
        v = destination_view(x.item, t)
        return transfer.as_bytes(v) if v.is_contiguous() else None

    def _recv_buffer(self, s: int, k: int) -> torch.Tensor:
        segs = self.in_chunks[s][k]
        n = segs[-1].offset + segs[-1].stop - segs[-1].start
        if len(segs) == 1 and not self.verify:
            sg = segs[0]
            d = self._direct(self.plan.recvs[s][sg.index])
            if d is not None:
                return d[sg.start:sg.stop]
        self.recv_staging += n
        return torch.empty(n + (transfer._HASH_BYTES if self.verify else 0), dtype=torch.uint8, device=self.dev)

    def _unpack(self, s: int, k: int, buf: torch.Tensor) -> None:
        segs = self.in_chunks[s][k]
        xs = self.plan.recvs[s]
        n = segs[-1].offset + segs[-1].stop - segs[-1].start
        self.report.messages_received += 1
        self.report.bytes_received += n
        if self.verify:
            sent = int(buf[n:].cpu().clone().view(torch.int64)[0])
            if sent != transfer.chunk_hash(buf[:n]):
                self.bad.update(xs[sg.index].item.dst_key for sg in segs)
                for sg in segs:
                    self.staged.pop((s, sg.index), None)
                return
        for sg in segs:
            x = xs[sg.index]
            if x.item.dst_key in self.bad:
                continue
            part = buf[sg.offset:sg.offset + sg.stop - sg.start]
            d = self._direct(x)
            if d is not None:
                if d.data_ptr() + sg.start != part.data_ptr():
                    d[sg.start:sg.stop].copy_(part)
                continue
            t = self.tgt.shards[x.leaf].local_tensor
            whole = sg.start == 0 and sg.stop == x.nbytes
            if not whole and x.nbytes >= transfer.ALONE_BYTES and x.item.permute is None:
                u = self._unit(x)  # whole rows of a big slice: straight into their rows of the target
                rows = source_shaped_view(x.item, t)[sg.start // u:sg.stop // u]
                rows.copy_(_aligned(part, t).view(t.dtype).view(rows.shape))
                continue
            st = part if whole else self.staged.get((s, sg.index))
            if st is None:
                st = self.staged[(s, sg.index)] = torch.empty(x.nbytes, dtype=torch.uint8, device=self.dev)
            if not whole:
                st[sg.start:sg.stop].copy_(part)
            if sg.stop == x.nbytes:
                self.staged.pop((s, sg.index), None)
                place(_aligned(st, t).view(t.dtype).view(box_extent(x.item.src_box)), x.item, t)

    # -- the whole transfer
    def run(self) -> None:
        """Post rounds in order while the staging of the rounds in flight is within the bound (zero-copy rounds
        cost none, so they all go out at once), copy this rank's own slices while the first rounds are on the
        wire, then wait for and unpack the rounds in order. Every rank posts round ``k`` before it waits for
        round ``k``, so the rounds complete whatever each rank's window. (Packing the next round in a thread
        was tried: no faster on the benchmark, and it held a round more of staging.)"""
        from collections import deque

        rep = self.report
        rounds = max([len(c) for c in self.out_chunks.values()] + [len(c) for c in self.in_chunks.values()] + [0])
        rep.rounds = rounds
        budget = self.bucket_bytes

        def pack_round(k: int) -> tuple[list, int]:
            with torch.no_grad():
                before = self.staging
                sends = [(self._pack(r, k), r) for r in sorted(self.out_chunks) if k < len(self.out_chunks[r])]
                return sends, self.staging - before

        with torch.no_grad():
            flight: deque = deque()
            held = 0
            nxt = 0

            def start(k: int) -> tuple[int, list, list, int]:
                sends, staged = pack_round(k)
                before = self.recv_staging
                recvs = [(self._recv_buffer(s, k), s) for s in sorted(self.in_chunks) if k < len(self.in_chunks[s])]
                return k, transfer.post(self.dw, sends, recvs), recvs, staged + self.recv_staging - before

            def fill() -> None:
                nonlocal nxt, held
                while nxt < rounds and (not flight or held < budget) and len(flight) < 64:
                    got = start(nxt)
                    flight.append(got)
                    held += got[3]
                    rep.staging_peak_bytes = max(rep.staging_peak_bytes, held + self._assembling())
                    nxt += 1

            fill()
            local = 0
            for s, x in self.plan.local:  # while the first rounds travel
                v = _source_view(self.src.shards[s.leaf].local_tensor, s.flat_start, s.shape, s.box)
                t = self.tgt.shards[x.leaf].local_tensor
                place(v if v.dtype == t.dtype else v.to(t.dtype), x.item, t)
                local += x.nbytes
            while flight:
                k, works, recvs, staged = flight.popleft()
                for w in works:
                    w.wait()
                for buf, s in recvs:
                    self._unpack(s, k, buf)
                held -= staged
                del works, recvs
                fill()
        rep.bytes_local += local
        rep.bytes_sent += local
        rep.bytes_received += local

    def _assembling(self) -> int:
        """Staging that outlives a round: small slices straddling two chunks, on either end."""
        return sum(t.numel() for t in self.staged.values()) + sum(t.numel() for t in self.packed.values())


# ---------------------------------------------------------------- public API

class WeightSync:
    """Plan once, replay every step: a live reshard from ``sources`` into ``targets`` kept ready for repeated
    :meth:`run` calls (the weight sync of an RL loop). Collective over ``process_group``: every rank builds one
    and calls :meth:`run` the same number of times.

    The first :meth:`run` plans (:func:`reshard_state_dict`); later runs check one fixed-size fingerprint of every
    rank's keys, shapes, dtypes, boxes, placements, devices and group (one ``all_reduce`` of a flag, nothing per
    shard) and, when no rank's changed, only move bytes; any change re-plans. The state dicts are read again at
    every run, so tensors replaced by new ones of the same description are picked up.

    Args: as :func:`reshard_state_dict`.

    Attributes:
        plan_reused: whether the last :meth:`run` replayed the previous plan.
        torn: True on a rank whose targets a failed run may have written part of (cleared by a later successful
            run); an inference engine must not serve from torn weights.
    """

    def __init__(self, sources: Mapping[str, Any], targets: Mapping[str, Any], *, process_group: Any = None,
                 aoa_config: Any = None, program: MappingProgram | None = None, strict: bool = True,
                 bucket_bytes: int | None = None, verify: bool = False):
        if aoa_config is not None and program is not None:
            raise CheckpointError("pass either aoa_config or program, not both")
        if bucket_bytes is None:
            bucket_bytes = transfer.DEFAULT_BUCKET_BYTES
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise CheckpointError(f"bucket_bytes must be a positive int (bytes), got {bucket_bytes!r}")
        self.sources, self.targets = sources, targets
        self.process_group, self.aoa_config, self.program = process_group, aoa_config, program
        self.strict, self.bucket_bytes, self.verify = strict, bucket_bytes, verify
        self._plan: _Plan | None = None
        self._described: tuple | None = None  # (quick signature, (source leaves, target leaves, fingerprint))
        self.plan_reused = False
        self.torn = False

    def run(self) -> ReshardReport:
        """Move the sources' current values into the targets (collective).

        Returns:
            this rank's :class:`ReshardReport`.

        Raises:
            CheckpointMismatchError: (every rank, before any byte moves) a target's global shape or dtype differs
                from what its sources give, or missing/unexpected keys under ``strict``.
            AOAError: a bad AOA config.
            CheckpointError: the transfer failed on some rank (a peer died, a timeout, a chunk whose hash did not
                match with ``verify=True``, naming the keys): raised on every rank, :attr:`torn` set where targets
                may hold a mix of old and new values.
        """
        t0 = time.perf_counter()
        dw = transfer.wrapper_for(self.process_group)
        with gc_paused():
            settings = (repr(self.aoa_config), id(self.program), self.strict, self.bucket_bytes, self.verify)
            quick = (_quick_signature(self.sources), _quick_signature(self.targets), id(self.process_group),
                     settings)
            if self._described is not None and self._described[0] == quick:
                src, tgt, fp = self._described[1]  # the same tensor objects as last run: described already
            else:
                src, tgt = collect_leaves(self.sources), collect_leaves(self.targets)
                if isinstance(dw, transfer.PeerDistWrapper):
                    _strip_layouts(src)
                    _strip_layouts(tgt)
                fp = _fingerprint(src, tgt, dw, settings)
                self._described = (quick, (src, tgt, fp))
            same = self._plan is not None and self._plan.fingerprint == fp
            try:
                reuse = dw.all_true(same) if dw.active else same
            except RuntimeError as e:  # the group itself is broken (a peer died before this run)
                raise CheckpointError(f"live reshard failed on rank {dw.rank} before any byte moved: "
                                      f"{type(e).__name__}: {e}") from e
            if not reuse:
                self._plan = None
                self._plan = _plan(src, tgt, dw, self.aoa_config, self.program, self.strict, self.bucket_bytes, fp)
        plan = self._plan
        rep = ReshardReport(list(plan.missing), list(plan.unexpected), list(plan.skipped), plan_reused=reuse)
        rep.plan_seconds = time.perf_counter() - t0
        self.plan_reused = reuse
        if plan.recvs or plan.local:
            self.torn = True
        mover = _Mover(plan, src, tgt, dw, self.verify, rep, self.bucket_bytes)
        err: BaseException | None = None
        try:
            mover.run()
            if mover.bad:
                raise CheckpointError(f"live reshard: chunks received by rank {dw.rank} do not match the hash their "
                                      f"sender took (verify=True): keys {sorted(mover.bad)} hold corrupted bytes")
        except Exception as e:
            err = e
        try:
            dw.check(err)
        except CheckpointError as e:
            raise CheckpointError(f"{e}{self._torn_note()}") from e
        except Exception as e:  # the group itself failed (a dead peer, a timeout)
            raise CheckpointError(f"live reshard failed on rank {dw.rank}: {type(e).__name__}: {e}"
                                  f"{self._torn_note()}") from e
        self.torn = False
        rep.seconds = time.perf_counter() - t0
        return rep

    def _torn_note(self) -> str:
        return " (this rank's targets are torn: part old, part new values; run again)" if self.torn else ""


def reshard_state_dict(sources: Mapping[str, Any], targets: Mapping[str, Any], *, process_group: Any = None,
                       aoa_config: Any = None, program: MappingProgram | None = None, strict: bool = True,
                       bucket_bytes: int | None = None, verify: bool = False) -> ReshardReport:
    """Collective: fill every rank's ``targets`` in place from the tensors the ranks hold in ``sources``, in memory.

    Each rank passes what it holds and what it wants (either may be ``{}``): nested dicts of tensors (whole, treated
    as replicated), DTensors on any mesh and placements, :class:`~oarlock.checkpoint.ShardedWeight` s (ZeRO flat
    ranges included); JSON values are left alone (tensors only move). Target keys are matched to source keys through
    AOA exactly as a load matches checkpoint keys (rename, fused qkv/ffn, split, transpose, cast, macros, presets).
    Bytes go from one holder straight to each rank that needs them (``batch_isend_irecv``: NCCL for CUDA, gloo for
    CPU); no rank gathers a tensor it does not hold as a target; replicated sources are spread over their holders by
    bytes. Staging is bounded by ``bucket_bytes`` plus the largest slice that straddles a chunk.

    Args:
        sources, targets: this rank's state dicts (targets are written in place).
        process_group: a ``torch.distributed`` group (None: the default group, or one process), or a
            :class:`~oarlock.checkpoint.transfer.PeerGroup` from :func:`~oarlock.checkpoint.join_group`.
        aoa_config / program: how target keys map to source keys (docs/aoa.md); default: same keys.
        strict: raise on missing or unexpected keys (before any byte moves).
        bucket_bytes: staging bound in bytes (default :data:`~oarlock.checkpoint.transfer.DEFAULT_BUCKET_BYTES`,
            256 MiB): two rounds of chunks in flight stay within it.
        verify: hash every chunk on both sides (XXH3-64) and fail naming the keys of a chunk that differs.

    Returns:
        this rank's :class:`ReshardReport`.

    Raises:
        as :meth:`WeightSync.run`.
    """
    return WeightSync(sources, targets, process_group=process_group, aoa_config=aoa_config, program=program,
                      strict=strict, bucket_bytes=bucket_bytes, verify=verify).run()
