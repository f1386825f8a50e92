"""The save pipeline: prepare (describe, all-gather, validate, assign writes), write (one safetensors file per
rank, header first), commit (rank 0 writes ``metadata.json`` last and publishes the directory in one rename).

Every rank describes its shards; one all-gather gives every rank the global picture; a deterministic
assignment picks one writer per distinct shard box (replicas are written once, by the holder that has written
the fewest bytes so far, so DP replicas spread the writes); each rank writes one safetensors file and fsyncs it
into a hidden temporary directory holding an incomplete-marker; rank 0 writes ``metadata.json`` last and renames
the directory to its final name (:func:`oarlock.checkpoint.storage.publish_directory`). Each data file records in
its header the shard box of every tensor it holds, for the warm restart of :mod:`oarlock.checkpoint.comm`. The
layout on disk is described in ``docs/checkpoint-format.md``. Errors are agreed through
:class:`~oarlock.checkpoint.dist.DistWrapper`: every rank raises the same one, and nothing is published.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from oarlock.checkpoint.dist import DistWrapper
from oarlock.checkpoint.errors import CheckpointError, CheckpointMismatchError
from oarlock.checkpoint.integrity import CHECKSUMS_KEY, BlockHasher, make_record
from oarlock.checkpoint.metadata import METADATA_FILE, SAVE_ID_HEADER, CheckpointMetadata, ShardMeta, TensorMeta
from oarlock.checkpoint.plan import KeyIndex
from oarlock.checkpoint.safetensors_io import write_safetensors
from oarlock.checkpoint.sharded import ShardedWeight
from oarlock.checkpoint.storage import (INCOMPLETE_MARKER, hold_staging, publish_directory, release_staging,
                                        remove_stale_staging, staging_path)
from oarlock.checkpoint.storage import check_destination as storage_check_destination
from oarlock.checkpoint.traversal import Leaves, collect_leaves
from oarlock.utils import dtype_itemsize

# CheckpointMetadata.extra entry of the TP-degree-dependent layouts (the AOA engine's TP_LAYOUTS_KEY; save does not
# import the AOA package)
TP_LAYOUTS_KEY = "tp_layouts"

SHARDS_HEADER = "oarlock.shards"  # safetensors __metadata__ entry: {name: [offset, local shape, global shape, ...]}
WORLD_HEADER = "oarlock.world_size"  # ... and the size of the group that saved


def data_file_name(rank: int) -> str:
    """The data file rank ``rank`` writes: ``rank-XXXXX.safetensors``."""
    return f"rank-{rank:05d}.safetensors"


def shard_record(offset, local_shape, global_shape, dtype: str, flattened_range) -> list:
    """One tensor's entry in :data:`SHARDS_HEADER`: ``[offset, local shape, global shape, dtype, flat range]``."""
    return [list(offset), list(local_shape), list(global_shape), dtype,
            list(flattened_range) if flattened_range is not None else None]


def sharded_weight_record(sw: ShardedWeight) -> list:
    """:func:`shard_record` of a live shard (what a same-layout restart compares)."""
    d = sw.desc
    return shard_record(d.global_offset, d.local_shape, d.global_shape, d.dtype, d.flattened_range)


def new_save_id() -> str:
    """A fresh unique save id (written into ``metadata.json`` and every data file of one save)."""
    return uuid.uuid4().hex


def shard_header(shards: list[tuple], world: int, save_id: str | None = None) -> dict[str, str]:
    """The safetensors ``__metadata__`` entries of a data file: each shard it holds, the size of the group that
    saved it, and the id of the save (:data:`~oarlock.checkpoint.metadata.SAVE_ID_HEADER`, checked against
    ``metadata.json`` on load). ``shards``: ``(key, global_offset, local_shape, global_shape, dtype,
    flattened_range)`` in file order."""
    rec = {k: shard_record(off, ls, gs, dt, fr) for k, off, ls, gs, dt, fr in shards}
    out = {SHARDS_HEADER: json.dumps(rec, separators=(",", ":")), WORLD_HEADER: str(world)}
    if save_id is not None:
        out[SAVE_ID_HEADER] = save_id
    return out


def assign_writes(per_rank: list[list[tuple]], replicas: bool = False
                   ) -> tuple[dict[str, TensorMeta], dict[int, list[tuple]]]:
    """Deterministic save plan from every rank's shard descriptions.

    ``per_rank[r]`` lists ``(key, global_shape, dtype, offset, local_shape, flattened_range, nbytes)``. Each
    distinct stored box goes to one holder: largest boxes first, each to the holder with the fewest bytes
    assigned so far (ties: lowest rank), which spreads replicated tensors over their holders.

    With ``replicas`` every other holder also writes its copy, recorded with ``replica_id`` 1, 2, ... (the
    primary gets 0), so each rank's file holds everything it needs for a same-layout restart.

    Returns ``(tensors, writes)``: the metadata per key, and per rank the shard identities it writes.

    Raises:
        CheckpointMismatchError: ranks disagree on a key's global shape or dtype (naming key and ranks).
    """
    spec: dict[str, tuple[tuple, str, int]] = {}
    holders: dict[tuple, list[int]] = {}
    sizes: dict[tuple, int] = {}
    for r, descs in enumerate(per_rank):
        for key, gshape, dtype, off, lshape, fr, nbytes in descs:
            if key not in spec:
                spec[key] = (gshape, dtype, r)
            elif spec[key][:2] != (gshape, dtype):
                g0, d0, r0 = spec[key]
                raise CheckpointMismatchError(f"key {key!r}: rank {r0} saves global shape {list(g0)} {d0}, rank {r} "
                                              f"saves {list(gshape)} {dtype}")
            if nbytes == 0:
                continue
            ident = (key, off, lshape, fr)
            holders.setdefault(ident, []).append(r)
            sizes[ident] = nbytes
    load = [0] * len(per_rank)
    writes: dict[int, list[tuple]] = {}
    owner: dict[tuple, int] = {}
    for ident in sorted(holders, key=lambda i: (-sizes[i], i[0], i[1], i[3] or ())):
        r = min(holders[ident], key=lambda h: (load[h], h))
        load[r] += sizes[ident]
        owner[ident] = r
        writes.setdefault(r, []).append(ident)
    tensors = {key: TensorMeta(key, gshape, dtype) for key, (gshape, dtype, _) in spec.items()}
    if replicas:
        for ident in sorted(owner, key=lambda i: (i[0], i[1], i[3] or ())):
            for h in holders[ident]:
                if h != owner[ident]:
                    writes.setdefault(h, []).append(ident)
    per_file: dict[tuple[int, str], int] = {}
    for r, ids in writes.items():
        for ident in ids:
            per_file[(r, ident[0])] = per_file.get((r, ident[0]), 0) + 1
    for ident in sorted(owner, key=lambda i: (i[0], i[1], i[3] or ())):
        key, off, lshape, fr = ident
        rep = [owner[ident]] + ([h for h in holders[ident] if h != owner[ident]] if replicas else [])
        for k, h in enumerate(rep):
            name = stored_name(key, off, fr) if per_file[(h, key)] > 1 else key
            tensors[key].shards.append(ShardMeta(off, lshape, data_file_name(h), name, fr,
                                                 k if replicas else None))
    return tensors, writes


def stored_name(key: str, offset: tuple[int, ...], flattened_range: tuple[int, int] | None) -> str:
    """Name of a shard's tensor in a data file that holds several shards of ``key`` (``key@o0,o1`` and
    ``#start-stop`` for a flattened one); a file holding one shard of a key names it ``key``."""
    name = f"{key}@{','.join(str(o) for o in offset)}"
    return name + (f"#{flattened_range[0]}-{flattened_range[1]}" if flattened_range is not None else "")


def shard_id(sw: ShardedWeight) -> tuple:
    """``(key, global offset, flattened range)``: what tells a rank's shards of one key apart."""
    d = sw.desc
    return (d.key, tuple(d.global_offset), d.flattened_range)


def local_tensors(leaves: Leaves) -> dict[tuple, torch.Tensor]:
    """This rank's shard tensors by :func:`shard_id`, the ``local`` argument of :func:`write_and_commit`."""
    return {shard_id(sw): sw.local_tensor for sw in leaves.shards}


def check_destination(path: Path, sources: Sequence[str | os.PathLike] = (), *, overwrite: bool = False) -> None:
    """The destination rule of an oarlock checkpoint writer (:func:`oarlock.checkpoint.storage.check_destination`
    with format ``"oarlock"``), then the removal of temporary directories that crashed writes to ``path`` left
    (:func:`oarlock.checkpoint.storage.remove_stale_staging`; a live save's directory is never touched).

    Raises:
        CheckpointDestinationError: ``path`` is, contains or is inside one of ``sources``, or exists and is not
            an oarlock checkpoint holding only files oarlock wrote (nor an empty directory) and ``overwrite`` is
            not given."""
    storage_check_destination(path, "oarlock", sources, overwrite=overwrite)
    remove_stale_staging(path)


@dataclass
class SavePlan:
    """The outcome of :func:`prepare_save`, identical on every rank except ``leaves``."""

    path: Path
    rank: int
    world: int
    tmp: Path
    gathered: list[dict]
    tensors: dict[str, TensorMeta]
    writes: dict[int, list[tuple]]
    leaves: Leaves
    save_id: str | None = None
    tp_layouts: dict[str, dict] | None = None  # key -> TP-dependent layout record (metadata extra["tp_layouts"])
    overwrite: bool = False  # write into a destination holding entries oarlock did not write (they are kept)


def prepare_save(state_dict: Mapping[str, Any], path: str | os.PathLike, process_group: Any,
                 save_replicas: bool, overwrite: bool = False) -> SavePlan:
    """The collective half of a save: describe, all-gather, validate, and assign writes (raises on every rank
    alike). Tensor data is not touched."""
    path = Path(path)
    dist = DistWrapper(process_group)
    leaves = Leaves()

    def describe() -> dict:
        nonlocal leaves
        leaves = collect_leaves(state_dict)
        descs: list[tuple] = []
        mine: set[tuple] = set()
        for sw in leaves.shards:
            if sw.key == "__metadata__":
                raise CheckpointError(f"key {sw.key!r}: the name is reserved by the safetensors format (the header's "
                                      "metadata block) and cannot be saved; rename this key")
            if shard_id(sw) in mine:
                raise CheckpointError(f"rank {dist.rank} holds the shard of key {sw.key!r} at offset "
                                      f"{list(sw.global_offset)} twice")
            mine.add(shard_id(sw))
            d = sw.desc
            descs.append((d.key, d.global_shape, d.dtype, d.global_offset, d.local_shape, d.flattened_range,
                          d.numel * dtype_itemsize(d.dtype)))
        if dist.is_coordinator:
            check_destination(path, overwrite=overwrite)
        return {"descs": descs, "tmp": staging_path(path) if dist.is_coordinator else None,
                "save_id": new_save_id() if dist.is_coordinator else None,
                "objects": leaves.objects, "nested": leaves.nested,
                "tp_layouts": {sw.key: sw.tp_layout for sw in leaves.shards if sw.tp_layout}}

    gathered = dist.gather(describe)
    # computed from all-gathered data only: every rank reaches the same result or the same error
    tensors, writes = assign_writes([g["descs"] for g in gathered], save_replicas)
    for t in tensors.values():
        KeyIndex(t)  # validates that the shards tile the global box
    return SavePlan(path, dist.rank, dist.size, gathered[0]["tmp"], gathered, tensors, writes, leaves,
                    gathered[0]["save_id"], merge_tp_layouts([g["tp_layouts"] for g in gathered]), overwrite)


def merge_tp_layouts(per_rank: Sequence[Mapping[str, dict]]) -> dict[str, dict]:
    """The ``extra["tp_layouts"]`` record of a save: the union of the ranks' ``ShardedWeight.tp_layout`` s by key
    (the same record the AOA engine writes for ``convert --tp``; read back by
    :func:`oarlock.checkpoint.aoa.layout.recorded_layouts`).

    Raises:
        CheckpointError: two ranks give one key different records, or a record is not
            ``{"statement": "fused_ffn" | "fused_qkv_old", "tp": int >= 1, ...}`` (naming the key).
    """
    out: dict[str, dict] = {}
    for rank, layouts in enumerate(per_rank):
        for key, rec in layouts.items():
            if not isinstance(rec, Mapping) or rec.get("statement") not in ("fused_ffn", "fused_qkv_old") \
                    or type(rec.get("tp")) is not int or rec["tp"] < 1:
                raise CheckpointError(f"key {key!r}: tp_layout {rec!r} (rank {rank}) is not a record "
                                      "{'statement': 'fused_ffn' or 'fused_qkv_old', 'tp': degree, 'axis': axis}")
            if key in out and out[key] != dict(rec):
                raise CheckpointError(f"key {key!r}: ranks disagree on its TP layout: {out[key]} and {dict(rec)} "
                                      f"(rank {rank})")
            out[key] = dict(rec)
    return out


def _desc_tuple(sw: ShardedWeight) -> tuple:
    d = sw.desc
    return (d.global_offset, d.local_shape, d.global_shape, d.dtype, d.flattened_range)


def write_and_commit(plan: SavePlan, local: dict[Any, torch.Tensor], process_group: Any) -> None:
    """The data half of a save: write this rank's file from ``local`` (:func:`shard_id` -> tensor, see
    :func:`local_tensors`; a plain key -> tensor dict is accepted when the rank holds one shard per key), then
    commit (rank 0). Collective over ``process_group`` (two small all-gathers of error reports)."""
    dist = DistWrapper(process_group)
    tmp = plan.tmp
    held: list[int] = []

    def write() -> dict[str, Any]:
        held.append(hold_staging(tmp))  # locked until committed: a cleanup of stale directories skips it
        (tmp / INCOMPLETE_MARKER).touch()  # before any data file: a partial directory must never load
        ids = sorted({(i[0], i[1], i[3]) for i in plan.writes.get(plan.rank, [])},
                     key=lambda i: (i[0], i[1], i[2] or ()))
        if not ids:
            return {}
        mine = {shard_id(sw): sw for sw in plan.leaves.shards}
        file = data_file_name(plan.rank)
        names = {(t.key, s.global_offset, s.flattened_range): s.name for t in plan.tensors.values()
                 for s in t.shards if s.file == file}
        out = {names[i]: local[i] if i in local else local[i[0]] for i in ids}
        hasher = BlockHasher()
        write_safetensors(tmp / file, out, metadata=shard_header(
            [(names[i], *_desc_tuple(mine[i])) for i in ids], plan.world, plan.save_id),
            hasher=hasher)
        return {file: hasher.record}  # block checksums, recorded in the metadata

    def commit(records: list[dict[str, Any]]) -> None:
        if dist.is_coordinator:
            objects: dict[str, Any] = {}
            nested: dict[str, list] = {}
            for g in reversed(plan.gathered):  # rank 0's values win
                objects.update(g["objects"])
                nested.update(g["nested"])
            files = {f: r for rec in records for f, r in rec.items()}
            extra: dict[str, Any] = {CHECKSUMS_KEY: make_record(files)}
            if plan.tp_layouts:  # a load at another TP degree re-lays these keys out
                extra[TP_LAYOUTS_KEY] = plan.tp_layouts
            publish_directory(tmp, plan.path, CheckpointMetadata("oarlock", tensors=plan.tensors, objects=objects,
                                                                 nested=nested, save_id=plan.save_id,
                                                                 extra=extra),
                              fsync_files=False, overwrite=plan.overwrite)

    try:
        records = dist.gather(write)
        dist.run(commit, records)
    except BaseException:
        if dist.is_coordinator:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        for fd in held:
            release_staging(fd)
