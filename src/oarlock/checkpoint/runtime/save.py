"""The save pipeline: prepare (describe, all-gather, validate, assign writes), write (one safetensors file per
rank, header first), commit (rank 0 writes ``metadata.json`` last and publishes the directory in one rename).

Every rank describes its shards; one all-gather gives every rank the global picture; a deterministic
assignment picks one writer per distinct shard box (replicas are written once, by the holder that has written
the fewest bytes so far, so DP replicas spread the writes); each rank writes one safetensors file and fsyncs it
into a hidden temporary directory holding an incomplete-marker; rank 0 writes ``metadata.json`` last and renames
the directory to its final name (:func:`oarlock.checkpoint.storage.publish_directory`). Each data file records in
its header the shard box of every tensor it holds, for the warm restart of :mod:`oarlock.checkpoint.runtime.comm`. The
layout on disk is described in ``docs/checkpoint-format.md``. Errors are agreed through
:class:`~oarlock.checkpoint.runtime.dist.DistWrapper`: every rank raises the same one, and nothing is published.
"""

from __future__ import annotations

import copy
import os
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from oarlock.checkpoint.runtime.dist import DistWrapper
from oarlock.checkpoint.runtime.dist import error_report
from oarlock.checkpoint.model.grid import data_file_name
from oarlock.checkpoint.integrity import CHECKSUMS_KEY, BlockHasher, make_record, write_digests, DIGESTS_SUFFIX
from oarlock.checkpoint.model.metadata import CheckpointMetadata
from oarlock.checkpoint.storage.safetensors import write_safetensors
from oarlock.checkpoint.storage import commit_for, location
from oarlock.checkpoint.model.traversal import Leaves, collect_leaves
from oarlock.checkpoint.planning.save import (RankRecord, SHARDS_DIGEST_HEADER, SHARDS_HEADER, SaveLayout, SavePlan,
                                              TP_LAYOUTS_KEY, WORLD_HEADER, desc_tuple, assign_writes, build_layout,
                                              describe_rank, dtensor_grid, flat_partition_grid, local_tensors,
                                              merge_tp_layouts, new_save_id, shard_header, shard_id, shard_record,
                                              sharded_weight_record, shards_digest, stored_name, write_order)

# the save pipeline's names, and the planning names it is built on
__all__ = ['PlanCache', 'RankRecord', 'SHARDS_DIGEST_HEADER', 'SHARDS_HEADER', 'SaveLayout', 'SavePlan',
           'TP_LAYOUTS_KEY', 'WORLD_HEADER', 'assign_writes', 'build_layout', 'check_destination', 'data_file_name',
           'describe_rank', 'dtensor_grid', 'exchange_fingerprints', 'flat_partition_grid', 'local_tensors',
           'merge_tp_layouts', 'new_save_id', 'plan_cache', 'prepare_save', 'shard_header', 'shard_id',
           'shard_record', 'sharded_weight_record', 'shards_digest', 'stored_name', 'write_and_commit', 'write_order']


def check_destination(path: Path, sources: Sequence[str | os.PathLike] = (), *, overwrite: bool = False) -> None:
    """The destination rule of an oarlock checkpoint writer (:func:`oarlock.checkpoint.storage.check_destination`
    with format ``"oarlock"``), then the removal of temporary directories that crashed writes to ``path`` left
    (:func:`oarlock.checkpoint.storage.remove_stale_staging`; a live save's directory is never touched).

    Raises:
        CheckpointDestinationError: ``path`` is, contains or is inside one of ``sources``, or exists and is not
            an oarlock checkpoint holding only files oarlock wrote (nor an empty directory) and ``overwrite`` is
            not given. A prefix in an object store is checked when the save starts
            (:func:`~oarlock.checkpoint.storage.prepare_object_destination`)."""
    path = location(path)
    commit_for(path).check_save_destination(path, sources, overwrite=overwrite)




@dataclass
class _CachedPlan:
    """What a save may reuse from the previous save over the same group (:func:`prepare_save`)."""

    fps: list[tuple[str, str]]  # every rank's (spec, listed) fingerprints, in group-rank order
    token: str  # the save id of the save that built the plan: every rank must hold the same one
    listed: list  # this rank's listed writes ``[(shard identity, stored name)]``
    skipped: list  # grid keys this rank holds but does not write
    layout: SaveLayout | None  # rank 0 only
    objects_fps: list[str]  # every rank's JSON-values fingerprint at that save
    objects: dict[str, Any] | None  # rank 0: the merged JSON values at that save


class PlanCache:
    """The plans of the last saves, by process group and ``save_replicas`` (a handful of entries).

    ``hits`` and ``misses`` count the saves that reused a plan or built one (observable by tests and
    benchmarks); :meth:`clear` forgets every plan."""

    MAX_ENTRIES = 8

    def __init__(self) -> None:
        self.entries: dict[tuple, _CachedPlan] = {}
        self.hits = 0
        self.misses = 0

    def clear(self) -> None:
        self.entries.clear()

    def put(self, key: tuple, plan: _CachedPlan) -> None:
        self.entries.pop(key, None)
        while len(self.entries) >= self.MAX_ENTRIES:
            self.entries.pop(next(iter(self.entries)))
        self.entries[key] = plan


plan_cache = PlanCache()


def _cache_key(process_group: Any, dist: DistWrapper, save_replicas: bool) -> tuple:
    """The plan cache's key: a weak reference to the group object (a new group with the same ranks is a new group;
    the default group is named by its current object, so a re-initialised world never meets an old plan) and
    ``save_replicas`` (it changes the write assignment for equal records).

    Weak, because a cache that kept the group alive kept its gloo threads running past ``destroy_process_group()``
    into interpreter finalization, where one of them freeing a finished collective's tensor needs the GIL and
    aborts the process ("terminate called without an active exception", about 1 run in 5 of save + destroy)."""
    group = process_group
    if group is None and dist.active:
        import torch.distributed as tdist

        group = tdist.group.WORLD
    return (None if group is None else weakref.ref(group), dist.size, bool(save_replicas))


def _merge_objects(parts: Mapping[int, dict[str, Any]]) -> dict[str, Any]:
    """JSON values of several ranks merged, the lowest rank's value winning for each key; a deep copy, so the
    values written at commit are those of the save call even when the caller's containers change later (an
    asynchronous save commits after the training went on)."""
    out: dict[str, Any] = {}
    for r in sorted(parts, reverse=True):
        out.update(parts[r])
    return copy.deepcopy(out)


def prepare_save(state_dict: Mapping[str, Any], path: str | os.PathLike, process_group: Any,
                 save_replicas: bool, overwrite: bool = False, *, leaves: "Leaves | Exception | None" = None
                 ) -> SavePlan:
    """The collective half of a save: describe, agree, plan the writes (raises on every rank alike). Tensor data is
    not touched. ``leaves``: the state's leaves already collected (:func:`collect_leaves`; an asynchronous save
    takes them at the call and plans later), or the exception collecting them raised on this rank (reported to
    every rank like any planning error); None collects them from ``state_dict`` here.

    Coordination (``docs/checkpoint-format.md``, "Who writes what"): one all-gather of a fixed-size fingerprint per
    rank; one member of each class of equal fingerprints sends its :class:`RankRecord` to rank 0, which builds the
    layout (:func:`build_layout`) and scatters to each rank its listed writes with the temporary path and the save
    id. Grid shards need no message: each rank knows from its placements whether it writes its own cell. A rank
    receives O(world) bytes of fingerprints and its own writes, never the other ranks' shard lists.

    Plan reuse: when every rank's fingerprints (tensor specs and grids, nesting, TP layouts, listed shards) equal
    those of the previous save over the same group and every rank holds that save's plan (its token travels with
    the fingerprint), the previous plan is reused: JSON values travel only when some rank's changed (from the
    first rank of each distinct set), the save id and temporary directory come from rank 0's nonce, and rank 0
    checks the destination when it writes. ``SavePlan.reused`` tells which path was taken; :data:`plan_cache`
    counts them.
    """
    path = location(path)
    dist = DistWrapper(process_group)
    record, grid_writes, err, fps = None, [], None, None
    ckey = _cache_key(process_group, dist, save_replicas)
    cached = plan_cache.entries.get(ckey)
    given, leaves = leaves, Leaves()
    try:
        if isinstance(given, Exception):
            raise given
        leaves = collect_leaves(state_dict) if given is None else given
        record, grid_writes = describe_rank(leaves, dist, save_replicas)
        fps = (record.spec_fingerprint(), record.listed_fingerprint(), record.objects_fingerprint(),
               cached.token if cached is not None else None, uuid.uuid4().hex)
    except Exception as e:  # reported to every rank in the exchange below
        err = e
    both = exchange_fingerprints(dist, err, fps)
    # (a save that writes in place takes the full path: its destination protocol runs at planning, before any
    # rank writes under the final location)
    if cached is not None and not commit_for(path).writes_in_place and all(b[1][3] == cached.token for b in both) \
            and [tuple(b[1][:2]) for b in both] == cached.fps:
        return _reuse_plan(cached, both, record, grid_writes, leaves, path, dist, overwrite)
    first_spec: dict[str, int] = {}
    first_listed: dict[str, int] = {}
    first_objects: dict[str, int] = {}
    for r, (_, (fs, fl, fo, _, _)) in enumerate(both):
        first_spec.setdefault(fs, r)
        first_listed.setdefault(fl, r)
        first_objects.setdefault(fo, r)
    # the first rank of each distinct spec sends its tensor list, the first of each distinct listed part its listed
    # shards, the first of each distinct JSON part its values: rank 0 receives each distinct part once
    mine = ((record.tensors, record.nested, record.tp_layouts) if first_spec[fps[0]] == dist.rank else None,
            record.listed if first_listed[fps[1]] == dist.rank else None,
            record.objects if first_objects[fps[2]] == dist.rank else None)
    parts = dist.gather_from(mine, set(first_spec.values()) | set(first_listed.values())
                             | set(first_objects.values()))
    layout, out, cerr = None, None, None
    if dist.is_coordinator:
        try:
            classes: dict[tuple[str, str], tuple[RankRecord, list[int]]] = {}
            for r, (_, (fs, fl, _, _, _)) in enumerate(both):
                if (fs, fl) not in classes:
                    spec_rec, listed_rec = parts[first_spec[fs]][0], parts[first_listed[fl]][1]
                    classes[(fs, fl)] = (RankRecord(spec_rec[0], listed_rec, {}, spec_rec[1], spec_rec[2]), [])
                classes[(fs, fl)][1].append(r)
            layout = build_layout(list(classes.values()), dist.size, save_replicas)
            layout.objects = _merge_objects({r: parts[r][2] for r in set(first_objects.values())})
            tmp, save_id = commit_for(path).staging_path(path), new_save_id()
            commit_for(path).prepare_save(path, dist.size, save_id, overwrite=overwrite)
            out = [(None, tmp, save_id, layout.listed_writes.get(r, []), layout.grid_skip.get(r, []))
                   for r in range(dist.size)]
        except Exception as e:
            cerr = e
            out = [(error_report(e, 0), None, None, None, None)] * dist.size
    rep, tmp, save_id, listed, skipped = dist.scatter_from(out)
    if rep is not None:
        dist.raise_reports([rep], cerr)
    plan_cache.misses += 1
    plan_cache.put(ckey, _CachedPlan([tuple(b[1][:2]) for b in both], save_id, listed, skipped, layout,
                                     [b[1][2] for b in both], layout.objects if layout is not None else None))
    return _make_plan(path, dist, tmp, save_id, grid_writes, listed, skipped, leaves, layout, overwrite)


def _reuse_plan(cached: _CachedPlan, both: list, record: RankRecord, grid_writes: list, leaves: Leaves, path: Path,
                dist: DistWrapper, overwrite: bool) -> SavePlan:
    """The reuse path of :func:`prepare_save`: only JSON values that changed since the cached save travel (from the
    first rank of each changed record), then rank 0 checks the destination and broadcasts the temporary path and
    save id."""
    ofps = [b[1][2] for b in both]
    objects = cached.objects
    if ofps != cached.objects_fps:
        first: dict[str, int] = {}
        for r, fo in enumerate(ofps):
            first.setdefault(fo, r)
        senders = set(first.values())
        parts = dist.gather_from(record.objects if dist.rank in senders else None, senders)
        objects = _merge_objects(parts) if dist.is_coordinator else None
    # the save id and the temporary directory come from rank 0's nonce, which every rank already has: no further
    # message; rank 0 checks the destination when it writes (:func:`write_and_commit`, agreed like a write error)
    save_id = both[0][1][4]
    tmp = commit_for(path).staging_path(path, save_id)
    layout = None
    if cached.layout is not None:
        layout = SaveLayout(cached.layout.tensors, cached.layout.listed_writes, objects or {}, cached.layout.nested,
                            cached.layout.tp_layouts, cached.layout.grid_skip)
    cached.objects_fps, cached.objects = ofps, objects
    plan_cache.hits += 1
    plan = _make_plan(path, dist, tmp, save_id, grid_writes, cached.listed, cached.skipped, leaves, layout,
                      overwrite)
    plan.reused = True
    plan.check_on_write = True
    return plan


_FP_FIELDS = 5  # spec, listed, objects, cached plan token, nonce: 32 hex digits each


_FP_BYTES = 1 + 32 * _FP_FIELDS


def _fp_text(f: str | None) -> str:
    return (f or "").ljust(32, "-")[:32]


def _fp_of(text: str) -> str | None:
    return None if text == "-" * 32 else text


_NO_NONCE = (1 << 63) - 1


def _fp_words(f: str | None) -> list[int]:
    """A fingerprint's 32 ASCII characters as four 8-byte integers (non-negative: ASCII has no top bit)."""
    text = _fp_text(f)
    return [int.from_bytes(text[8 * c:8 * c + 8].encode("ascii"), "big") for c in range(4)]


def _fp_from_words(words: Sequence[int]) -> str | None:
    return _fp_of(b"".join(w.to_bytes(8, "big") for w in words).decode("ascii"))


def _agree_fingerprints(dist: DistWrapper, err: BaseException | None, fps: tuple | None) -> list[tuple] | None:
    """The common case of :func:`exchange_fingerprints`: one
    :meth:`~oarlock.checkpoint.runtime.dist.DistWrapper.min_max`
    of 21 ints (42 int64s on the wire) whatever the number of ranks: a failure flag, the first four fingerprints as
    :func:`_fp_words`, and rank 0's nonce (the other ranks pass the largest int64, so the minimum is rank 0's).
    When no rank failed and every rank's first four fingerprints are equal (a regular layout: one class), returns
    the exchange's result; otherwise None (the caller all-gathers)."""
    n = 4 * (_FP_FIELDS - 1)
    words = [0] * n if err is not None else [w for f in fps[:4] for w in _fp_words(f)]
    nonce = _fp_words(fps[4] if fps is not None else None) if dist.rank == 0 else [_NO_NONCE] * 4
    lo, hi = dist.min_max([int(err is not None)] + words + nonce)
    if hi[0] or lo[1:1 + n] != hi[1:1 + n]:
        return None
    common = tuple(_fp_from_words(lo[1 + 4 * k:5 + 4 * k]) for k in range(_FP_FIELDS - 1))
    return [(None, (*common, _fp_from_words(lo[1 + n:]) if r == 0 else None)) for r in range(dist.size)]


def exchange_fingerprints(dist: DistWrapper, err: BaseException | None, fps: tuple | None) -> list[tuple]:
    """The fixed-size exchange that opens every save. First one ``all_reduce`` of 336 bytes whatever the world
    size (:func:`_agree_fingerprints`): when every rank's tensor specs, listed shards, JSON values and cached-plan token fingerprints agree (a
    regular layout), that is all. Otherwise one all-gather of ``1 + 5 x 32`` bytes per rank (a failure flag and
    the fingerprints of :func:`prepare_save`); only when some rank failed, a further exchange of the error
    reports, raised alike on every rank. Returns ``[(None, fps)]`` per rank in group-rank order (a missing token is
    ``None``; only rank 0's nonce is kept when the ranks agree, the only one :func:`prepare_save` uses)."""
    if dist.active:
        agreed = _agree_fingerprints(dist, err, fps)
        if agreed is not None:
            return agreed
    row = bytearray(_FP_BYTES)
    if err is None:
        row[1:] = "".join(_fp_text(f) for f in fps).encode("ascii")
    else:
        row[0] = 1
    if not dist.active:
        rows = [bytes(row)]
    else:
        import torch.distributed as tdist

        dev = dist.comm_device()
        mine = torch.frombuffer(row, dtype=torch.uint8).to(dev)
        out = [torch.empty(_FP_BYTES, dtype=torch.uint8, device=dev) for _ in range(dist.size)]
        tdist.all_gather(out, mine, group=dist.group)
        rows = [bytes(t.cpu().numpy().tobytes()) for t in out]
    if any(r[0] for r in rows):
        reports = dist.all_gather_object(None if err is None else error_report(err, dist.rank))
        dist.raise_reports(reports, err)
    both = []
    for r in rows:
        text = r[1:].decode("ascii")
        both.append((None, tuple(_fp_of(text[32 * k:32 * (k + 1)]) for k in range(_FP_FIELDS))))
    return both


def _make_plan(path: Path, dist: DistWrapper, tmp: Path, save_id: str, grid_writes: list, listed: list,
               skipped: list, leaves: Leaves, layout: SaveLayout | None, overwrite: bool) -> SavePlan:
    if skipped:
        grid_writes = [i for i in grid_writes if i[0] not in set(skipped)]
    own = list(grid_writes) + [i for i, _ in listed]
    names: dict[tuple, str | None] = {(i[0], i[1], i[3]): None for i in grid_writes}  # None: packed
    names.update({(i[0], i[1], i[3]): n for i, n in listed})
    plan = SavePlan(path, dist.rank, dist.size, tmp, {dist.rank: own}, names, leaves, save_id, overwrite=overwrite)
    if layout is not None:
        plan.tensors, plan.objects, plan.nested, plan.tp_layouts = (layout.tensors, layout.objects, layout.nested,
                                                                    layout.tp_layouts)
    return plan


def write_and_commit(plan: SavePlan, local: Mapping[Any, torch.Tensor], process_group: Any,
                     ready: Callable[[tuple], torch.Tensor] | None = None) -> None:
    """The data half of a save: write this rank's file from ``local`` (:func:`shard_id` -> tensor, see
    :func:`local_tensors`; a plain key -> tensor dict is accepted when the rank holds one shard per key), then
    commit (rank 0). Collective over ``process_group``: an agreement on the writes (one all-reduce of a flag), each
    file's size and digests-file checksum gathered to rank 0 only, and an agreement on the commit.

    ``ready(shard_id)``, when given, is called just before each tensor's bytes are written and returns the tensor
    to write in place of ``local[shard_id]`` (same shape and dtype: the pipelined snapshot of an asynchronous
    save, ``local`` then only giving shapes and dtypes); an exception it raises fails the save on every rank."""
    dist = DistWrapper(process_group)
    tmp = plan.tmp
    held: list[int] = []

    commit = commit_for(plan.path)

    def write() -> dict[str, Any]:
        held.append(commit.begin_write(tmp))  # a staging directory is locked and marked incomplete first
        if plan.check_on_write and dist.is_coordinator:  # a reused plan: the check planning did not make
            check_destination(plan.path, overwrite=plan.overwrite)
        ids = write_order(plan)
        if not ids:
            return {}
        mine = {shard_id(sw): sw for sw in plan.leaves.shards}
        file = data_file_name(plan.rank)
        # grid shards go into the packed entry in key order (located from the grid records, so the file's header
        # stays a few hundred bytes whatever the number of tensors); listed shards keep named entries
        stored = {i: i[0] if plan.names[i] is None else plan.names[i] for i in ids}  # packed pieces: the key
        packed = [i for i in ids if plan.names[i] is None]
        named = [i for i in ids if plan.names[i] is not None]
        data = {i: local[i] if i in local else local[i[0]] for i in ids}
        by_name = {stored[i]: i for i in ids}
        hasher = BlockHasher()
        header = shard_header([(stored[i], *desc_tuple(mine[i])) for i in ids], plan.world, plan.save_id,
                              digest=bool(packed))
        write_safetensors(tmp / file, {stored[i]: data[i] for i in named}, metadata=header, hasher=hasher,
                          packed={stored[i]: data[i] for i in packed},
                          ready=None if ready is None else (lambda name: ready(by_name[name])))
        # the block checksums go into a digests file beside the data file: rank 0 receives a few dozen bytes per
        # file, not 8 per 4 MiB block of the checkpoint (2 MiB for a 70B model's weights and AdamW moments)
        return {file: write_digests(tmp, file, hasher.record)}

    def publish(records: list[dict[str, Any]]) -> None:
        if dist.is_coordinator:
            files = {f: r for rec in records for f, r in rec.items()}
            extra: dict[str, Any] = {CHECKSUMS_KEY: make_record(files)}
            if plan.tp_layouts:  # a load at another TP degree re-lays these keys out
                extra[TP_LAYOUTS_KEY] = plan.tp_layouts
            meta = CheckpointMetadata("oarlock", tensors=plan.tensors, objects=plan.objects or {},
                                      nested=plan.nested or {}, save_id=plan.save_id, extra=extra)
            commit.publish_save(tmp, plan.path, meta, [*files, *(f + DIGESTS_SUFFIX for f in files)],
                                overwrite=plan.overwrite)

    try:
        rec = dist.run(write)
        records = dist.gather_to(rec)
        dist.run(publish, records)
    except BaseException:
        if dist.is_coordinator:
            commit.abort_save(tmp)
        raise
    finally:
        for handle in held:
            commit.end_write(handle)
