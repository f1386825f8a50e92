"""``save_state_dict`` / ``load_state_dict``: sharded checkpoints with automatic resharding
(FlexCheckpoint spec sections 3.1, 3.2, 4.1 and 4.3, with the corrections of section 8.2).

Save: every rank describes its shards; one all-gather gives every rank the global picture; a deterministic
assignment picks one writer per distinct shard box (replicas are written once, by the holder that has written
the fewest bytes so far, so DP replicas spread the writes); each rank writes one safetensors file and fsyncs
it; rank 0 writes ``metadata.json`` last and renames the temporary directory to its final name.

Load: each rank reads the metadata itself, plans its reads with :mod:`oarlock.checkpoint.plan` (a pure
function), and reads exactly the byte ranges its own shards need, straight into the target tensors when no
permutation or cast is involved. Ranks exchange only small descriptions (two ``all_gather_object`` calls, so
errors are raised on every rank alike); on a shared filesystem tensor data never crosses the network, as with
torch.distributed.checkpoint. With node-local disks (a rank cannot see some file it needs) each file is read
once and slices are shipped between ranks, and a same-layout restart reads only local files: see
:mod:`oarlock.checkpoint.comm`. ``save_replicas`` and ``async_save``: see :func:`save_state_dict`.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from oarlock.checkpoint import errors as _errors
from oarlock.checkpoint.errors import CheckpointError, CheckpointMismatchError
from oarlock.checkpoint.mapping import MappingProgram, TensorSpec, box_slices, cast_tensor
from oarlock.checkpoint.metadata import METADATA_FILE, CheckpointMetadata, ShardMeta, TensorMeta
from oarlock.checkpoint.plan import KeyIndex, Planner, ReadItem, source_specs
from oarlock.checkpoint.sharded import (ShardDesc, ShardedWeight, _all_gather_objects, _group_rank, _group_size,
                                        _is_dtensor, flat_key, iter_leaves)
from oarlock.checkpoint.storage import (INCOMPLETE_MARKER, CheckpointReader, open_checkpoint,
                                        write_safetensors, publish_directory)
from oarlock.utils import dtype_itemsize, numel

AOA_MODULE = "oarlock.checkpoint.aoa"


@dataclass
class LoadReport:
    """What a load did not match (filled when ``strict=False``; with ``strict=True`` these raise).

    Attributes:
        missing_keys: requested keys (on any rank) the checkpoint or mapping program cannot provide; their
            targets are left untouched.
        unexpected_keys: stored keys that no rank requested (and no mapping read).
        bytes_read: bytes this rank read from the checkpoint's data files.
        comm_method: how data reached this rank: ``"direct"`` (own byte-range reads), ``"warm"`` (own file
            only, no communication), ``"grouped_send_recv"`` or ``"broadcast"`` (see :mod:`oarlock.checkpoint.comm`).
        files_read: data files this rank opened.
        bytes_sent, bytes_received: tensor bytes this rank sent to / received from other ranks.
        messages_sent: point-to-point sends (or broadcasts as the source) this rank issued.
    """

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    bytes_read: int = 0
    comm_method: str = "direct"
    files_read: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    skipped_keys: list[str] = field(default_factory=list)
    """requested keys an AOA config deliberately does not load (``_ -> key``, or named like a key dropped with
    ``key -> _``): left untouched, and no error under ``strict=True``."""


# ---------------------------------------------------------------- state dict traversal

@dataclass
class _Leaves:
    shards: list[ShardedWeight] = field(default_factory=list)
    objects: dict[str, Any] = field(default_factory=dict)
    object_paths: dict[str, tuple] = field(default_factory=dict)
    nested: dict[str, list] = field(default_factory=dict)


def _collect(state_dict: Mapping[str, Any]) -> _Leaves:
    """Split a nested state dict into shards (tensors, DTensors, ShardedWeights) and JSON objects.

    Raises:
        CheckpointError: two leaves with the same flat key, or a leaf that is neither a tensor nor JSON data.
    """
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    out = _Leaves()
    seen: dict[str, tuple] = {}
    for path, leaf in iter_leaves(state_dict):
        key = leaf.key if isinstance(leaf, ShardedWeight) else flat_key(path)
        if key in seen:
            raise CheckpointError(f"state_dict key {key!r} occurs twice (at {list(seen[key])} and {list(path)})")
        seen[key] = path
        if len(path) > 1 or not isinstance(path[0], str) or path[0] != key:
            out.nested[key] = list(path)
        if isinstance(leaf, ShardedWeight):
            out.shards.append(leaf)
        elif _is_dtensor(leaf):
            sw = ShardedWeight.from_dtensor(key, leaf)
            if sw is not None:
                out.shards.append(sw)
        elif isinstance(leaf, torch.Tensor):
            out.shards.append(ShardedWeight.replicated(key, leaf.detach()))
        else:
            try:
                json.dumps(leaf, allow_nan=True)
            except (TypeError, ValueError):
                raise CheckpointError(f"state_dict key {key!r}: a {type(leaf).__name__} is neither a tensor nor "
                                      "JSON data (int, float, str, bool, None, lists and dicts of those)") from None
            out.objects[key] = leaf
            out.object_paths[key] = path
    return out


def _raise_gathered(errs: list[Any], rank: int) -> None:
    """Raise on every rank when any rank failed: the rank's own error, else the first other one."""
    failures = [(r, e) for r, e in enumerate(errs) if e is not None]
    if not failures:
        return
    mine = errs[rank]
    r, (cls_name, msg) = (rank, mine) if mine is not None else failures[0]
    cls = getattr(_errors, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
        cls = CheckpointError
    raise cls(msg if r == rank else f"rank {r}: {msg}")


def _err(e: BaseException) -> tuple[str, str]:
    return (type(e).__name__ if isinstance(e, CheckpointError) else "CheckpointError",
            str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}")


# ---------------------------------------------------------------- save

def _data_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def _assign_writes(per_rank: list[list[tuple]], replicas: bool = False
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
    for ident in sorted(owner, key=lambda i: (i[0], i[1], i[3] or ())):
        key, off, lshape, fr = ident
        tensors[key].shards.append(ShardMeta(off, lshape, _data_file(owner[ident]), key, fr, 0 if replicas else None))
        if replicas:
            for k, h in enumerate((h for h in holders[ident] if h != owner[ident]), 1):
                writes.setdefault(h, []).append(ident)
                tensors[key].shards.append(ShardMeta(off, lshape, _data_file(h), key, fr, k))
    return tensors, writes


def save_state_dict(state_dict: Mapping[str, Any], path: str | os.PathLike, *, process_group: Any = None,
                    save_replicas: bool = False, async_save: bool = False) -> Any:
    """Save a (possibly sharded) state dict as an oarlock checkpoint directory. Collective over
    ``process_group`` (default: the world when torch.distributed is initialised; else a single process).

    Args:
        state_dict: nested dicts/lists whose leaves are tensors (whole, replicated on every rank), DTensors
            (their local shard; replicas written once), :class:`ShardedWeight` s (keyed by their ``key``), or
            small JSON values (ints, floats, strings, ...: stored in ``metadata.json``, rank 0's copy wins).
            Nested keys are joined with ``.``; the path is kept so loads can rebuild the nesting.
        path: the checkpoint directory to create. Its parent is created if needed. An existing oarlock
            checkpoint there is replaced (only after the new one is complete); any other existing path is an
            error.

    On disk: ``rank-XXXXX.safetensors`` data files (only ranks with something to write) and ``metadata.json``
    (JSON, see :mod:`oarlock.checkpoint.metadata`). Everything is written into a hidden temporary directory
    next to ``path`` holding an incomplete-marker file, fsynced, and renamed to ``path`` only when complete,
    so an interrupted save never leaves a directory that loads and never touches other checkpoints.

        save_replicas: every rank also writes the replicas it holds (``replica_id >= 1`` in the metadata), so a
            restart in the same layout reads only its own file with no communication (see
            :func:`oarlock.checkpoint.comm.try_warm_start`). Costs disk space for every replica.
        async_save: return at once with an :class:`~oarlock.checkpoint.async_save.AsyncSaveHandle` and write in
            the background (see :func:`oarlock.checkpoint.async_save.async_save`).

    Raises:
        CheckpointError: (on every rank alike) bad leaves, disagreeing shapes/dtypes, shards that do not tile a
            tensor exactly (:class:`~oarlock.checkpoint.plan.CheckpointTilingError`), an existing non-checkpoint
            ``path``, or an I/O failure on any rank (the temporary directory is removed).
    """
    from oarlock.checkpoint.async_save import async_save as _async, wait_pending

    if async_save:
        return _async(state_dict, path, process_group=process_group, save_replicas=save_replicas)
    wait_pending()  # an earlier async save commits first
    plan = _prepare_save(state_dict, path, process_group, save_replicas)
    _write_and_commit(plan, {sw.key: sw.local_tensor for sw in plan.leaves.shards}, process_group)
    return None


@dataclass
class _SavePlan:
    path: Path
    rank: int
    world: int
    tmp: Path
    gathered: list[dict]
    tensors: dict[str, TensorMeta]
    writes: dict[int, list[tuple]]
    leaves: _Leaves


def _prepare_save(state_dict: Mapping[str, Any], path: str | os.PathLike, process_group: Any,
                  save_replicas: bool) -> _SavePlan:
    """The collective half of a save: describe, all-gather, validate, and assign writes (raises on every rank
    alike). Tensor data is not touched."""
    path = Path(path)
    rank, world = _group_rank(process_group), _group_size(process_group)
    err = None
    descs: list[tuple] = []
    leaves = _Leaves()
    try:
        leaves = _collect(state_dict)
        mine: dict[str, ShardedWeight] = {}
        for sw in leaves.shards:
            if sw.key in mine:
                raise CheckpointError(f"rank {rank} holds two shards of key {sw.key!r}")
            mine[sw.key] = sw
            d = sw.desc
            descs.append((d.key, d.global_shape, d.dtype, d.global_offset, d.local_shape, d.flattened_range,
                          d.numel * dtype_itemsize(d.dtype)))
        if rank == 0 and path.exists() and not (path.is_dir() and ((path / METADATA_FILE).is_file()
                                                                   or not any(path.iterdir()))):
            raise CheckpointError(f"{path}: exists and is not an oarlock checkpoint; refusing to replace it")
    except Exception as e:  # reported to every rank below
        err = _err(e)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:12]}" if rank == 0 else None
    gathered = _all_gather_objects({"descs": descs, "err": err, "tmp": tmp, "objects": leaves.objects,
                                    "nested": leaves.nested}, process_group)
    _raise_gathered([g["err"] for g in gathered], rank)
    tmp = gathered[0]["tmp"]
    try:
        tensors, writes = _assign_writes([g["descs"] for g in gathered], save_replicas)
        for t in tensors.values():
            KeyIndex(t)  # validates that the shards tile the global box
    except CheckpointError as e:
        _raise_gathered([_err(e)] * world, rank)  # every rank computed the same error
    return _SavePlan(path, rank, world, tmp, gathered, tensors, writes, leaves)


def _desc_tuple(sw: ShardedWeight) -> tuple:
    d = sw.desc
    return (d.global_offset, d.local_shape, d.global_shape, d.dtype, d.flattened_range)


def _write_and_commit(plan: _SavePlan, local: dict[str, torch.Tensor], process_group: Any) -> None:
    """The data half of a save: write this rank's file from ``local`` (key -> tensor), then commit (rank 0).
    Collective over ``process_group`` (two small all-gathers of error reports)."""
    rank, tmp = plan.rank, plan.tmp
    err = None
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / INCOMPLETE_MARKER).touch()  # before any data file: a partial directory must never load
        ids = {(i[0], i[1]) for i in plan.writes.get(rank, [])}
        if ids:
            from oarlock.checkpoint.comm import shard_header

            mine = {sw.key: sw for sw in plan.leaves.shards}
            keys = [k for k, _ in sorted(ids)]
            write_safetensors(tmp / _data_file(rank), {k: local[k] for k in keys},
                              metadata=shard_header([(k, *_desc_tuple(mine[k])) for k in keys], plan.world))
    except Exception as e:
        err = _err(e)
    errs = _all_gather_objects(err, process_group)
    if any(e is not None for e in errs):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _raise_gathered(errs, rank)
    err = None
    if rank == 0:
        try:
            _commit(tmp, plan.path, plan.gathered, plan.tensors)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            err = _err(e)
    _raise_gathered(_all_gather_objects(err, process_group), rank)


def _commit(tmp: Path, path: Path, gathered: list[dict], tensors: dict[str, TensorMeta]) -> None:
    """Rank 0: write metadata.json, drop the marker, fsync, and rename ``tmp`` to ``path``."""
    objects: dict[str, Any] = {}
    nested: dict[str, list] = {}
    for g in reversed(gathered):  # rank 0's values win
        objects.update(g["objects"])
        nested.update(g["nested"])
    publish_directory(tmp, path, CheckpointMetadata("oarlock", tensors=tensors, objects=objects, nested=nested))


# ---------------------------------------------------------------- load

def _compile_aoa(aoa_config: Any, source: dict[str, TensorSpec], destination: dict[str, TensorSpec],
                 meta: CheckpointMetadata | None = None, destination_shards: dict[str, int] | None = None
                 ) -> MappingProgram:
    try:
        from oarlock.checkpoint.aoa import compile_aoa, shard_counts
    except ImportError as e:
        if e.name not in (AOA_MODULE, None) and not str(e).startswith(f"import of {AOA_MODULE}"):
            raise
        raise CheckpointError("aoa_config was given but the AOA engine (oarlock.checkpoint.aoa) is not available "
                              "in this installation; load without aoa_config or install an oarlock with AOA") from None
    from oarlock.checkpoint.aoa.layout import relayout_config

    # a key saved in a TP-blocked layout at another degree: re-laid out, or an error naming the statement
    aoa_config = relayout_config(aoa_config, meta, destination_shards or {}) if meta is not None else aoa_config
    # TP shard counts (distinct global offsets) on both sides: fused_ffn / fused_qkv_old layouts depend on them
    return compile_aoa(aoa_config, source, destination, source_shards=shard_counts(meta) if meta is not None else None,
                       destination_shards=destination_shards)


def load_state_dict(state_dict: Mapping[str, Any], path: str | os.PathLike, *, process_group: Any = None,
                    aoa_config: Any = None, strict: bool = True, program: MappingProgram | None = None,
                    comm_method: str = "auto") -> LoadReport:
    """Load a checkpoint in place into the tensors of ``state_dict``, whatever layout either side has.
    Collective over ``process_group`` (default: the world when torch.distributed is initialised).

    Args:
        state_dict: nested dicts/lists of pre-allocated targets: tensors (the whole tensor), DTensors (their
            local shard), :class:`ShardedWeight` s (their box or flat range), and JSON values (replaced by the
            saved value in their container).
        path: any source :func:`~oarlock.checkpoint.storage.open_checkpoint` reads: an oarlock checkpoint, a
            HuggingFace directory or ``.safetensors`` file, a Paddle FlexCheckpoint directory.
        aoa_config: an AOA config (``{"aoa_statements": [...], ...}`` or a list of statement strings), compiled
            by ``oarlock.checkpoint.aoa.compile_aoa(aoa_config, source_specs, destination_specs)`` into a
            mapping program (renames, transposes, splits, concats, casts).
        strict: raise on missing or unexpected keys; else report them in the returned :class:`LoadReport`.
        program: an already-compiled :class:`~oarlock.checkpoint.mapping.MappingProgram` (instead of
            ``aoa_config``). Default: the identity (same keys, global shapes and dtypes).
        comm_method: ``"auto"`` (direct byte-range reads when every rank sees every file it needs, as on a
            shared filesystem; else grouped send/recv), ``"grouped_send_recv"`` or ``"broadcast"``: see
            :mod:`oarlock.checkpoint.comm`. With node-local disks each rank passes its own directory as ``path``;
            each needed file is then read by exactly one rank and slices travel to the ranks that need them.
            A same-layout restart (each rank's request equals what its own data file holds, e.g. after
            ``save_state_dict(..., save_replicas=True)``) reads only local files and moves no data.

    Returns:
        A :class:`LoadReport` (missing and unexpected keys, bytes this rank read).

    Raises:
        CheckpointMismatchError: requested global shape differs from the saved one (names key, both shapes and
            the AOA hint), dtype differs without a requested cast, missing/unexpected keys under ``strict``.
        CheckpointTilingError: the stored shards of a key do not tile its global box (names key and box).
        CheckpointFormatError: unreadable source. CheckpointError: ``aoa_config`` without the AOA engine.
        Every rank raises alike; no target is written before the whole plan is built and validated.
    """
    if aoa_config is not None and program is not None:
        raise CheckpointError("pass either aoa_config or program to load_state_dict, not both")
    from oarlock.checkpoint import comm

    comm.check_comm_method(comm_method)
    rank = _group_rank(process_group)
    if aoa_config is None and program is None:
        warm = comm.try_warm_start(state_dict, path, process_group, _data_file(rank))
        if warm is not None:
            return warm
    view = comm.gather_view(path, process_group) if _group_size(process_group) > 1 else None
    err = None
    leaves = _Leaves()
    descs: list[ShardDesc] = []
    try:
        leaves = _collect(state_dict)
        descs = [sw.desc for sw in leaves.shards]
    except Exception as e:
        err = _err(e)
    wanted = {"err": err, "tensors": {d.key: (d.global_shape, d.dtype) for d in descs},
              "offsets": {d.key: d.global_offset for d in descs if d.numel} if program is None else {},
              "objects": sorted(leaves.objects)}
    gathered = _all_gather_objects(wanted, process_group)
    _raise_gathered([g["err"] for g in gathered], rank)

    err = None
    reader: CheckpointReader | None = None
    plans: list[list[ReadItem]] = []
    missing: set[str] = set()
    skipped: set[str] = set()
    unexpected: list[str] = []
    used: set[str] = set()
    try:
        reader = comm.open_view(path, view, rank) if view is not None else open_checkpoint(path)
        meta = reader.metadata
        dest_all: dict[str, TensorSpec] = {}
        for g in gathered:
            for k, (shape, dt) in g["tensors"].items():
                dest_all.setdefault(k, TensorSpec(tuple(shape), dt))
        if aoa_config is None and program is None and meta.extra.get("tp_layouts"):
            aoa_config = []  # keys saved in a TP-blocked layout: compiled below, re-laid out if needed
        if aoa_config is not None:
            offsets: dict[str, set] = {}
            for g in gathered:
                for k, off in g["offsets"].items():
                    offsets.setdefault(k, set()).add(tuple(off))
            program = _compile_aoa(aoa_config, source_specs(meta), dest_all, meta,
                                   {k: len(v) for k, v in offsets.items()})
        planner = Planner(meta, program)
        for d in descs:
            if d.key in meta.objects and d.key not in meta.tensors and aoa_config is None and program is None:
                raise CheckpointMismatchError(f"key {d.key!r}: the checkpoint holds a {type(meta.objects[d.key]).__name__} "
                                              "object, the target is a tensor")
            p = planner.plan_rank([d])
            plans.append(p.items)
            missing.update(p.missing_keys)
        skipped = missing & set(getattr(planner.program, "skipped", ()) or ())
        missing -= skipped
        for k in leaves.objects:
            if k not in meta.objects:
                missing.add(k)
        # what the whole group reads, for the unexpected-key check
        dest_keys = set(planner.program.destination_keys())
        for k in dest_all:
            if k in dest_keys:
                used.update(m.src_key for m in planner.mappings(k))
        used.update(getattr(planner.program, "deleted_keys", ()) or ())
        wanted_objects = {k for g in gathered for k in g["objects"]}
        unexpected = sorted([k for k in meta.tensors if k not in used]
                            + [k for k in meta.objects if k not in wanted_objects and k not in dest_all])
    except Exception as e:
        err = _err(e)
    status = _all_gather_objects({"err": err, "missing": sorted(missing), "skipped": sorted(skipped)}, process_group)
    try:
        _raise_gathered([s["err"] for s in status], rank)
    except BaseException:
        if reader is not None:
            reader.close()
        raise
    assert reader is not None
    all_missing = sorted({k for s in status for k in s["missing"]})
    if strict and (all_missing or unexpected):
        reader.close()
        parts = []
        if all_missing:
            parts.append(f"missing keys (requested, not in the checkpoint): {_fmt_keys(all_missing)}")
        if unexpected:
            parts.append(f"unexpected keys (in the checkpoint, not requested): {_fmt_keys(unexpected)}")
        dropped = _dropped_data(unexpected, used)
        if dropped:  # strict=False would silently lose these tensors: never suggest it
            hint = (f" ({_fmt_keys(dropped, 5)} belong to modules this load reads, e.g. biases: loading without them "
                    "gives wrong numbers. Map them with an AOA statement (a preset built from the model's "
                    "config.json maps biases, see docs/aoa.md), or drop them deliberately with 'KEY -> _')")
        else:
            hint = " (pass strict=False to load the rest and get them in the returned LoadReport)"
        raise CheckpointMismatchError(f"{path}: " + "; ".join(parts) + hint)

    report = LoadReport(all_missing, unexpected, skipped_keys=sorted({k for s in status for k in s["skipped"]}))
    with reader, torch.no_grad():
        work = [(it, sw.local_tensor) for sw, items in zip(leaves.shards, plans)
                for it in sorted(items, key=lambda it: (it.file, it.name, it.src_flat_start, it.src_box))]
        st = comm.execute(reader, work, comm_method=comm_method, view=view, group=process_group,
                          direct=_execute_work)
        report.bytes_read, report.comm_method, report.files_read = st.bytes_read, st.method, st.files_read
        report.bytes_sent, report.bytes_received, report.messages_sent = st.bytes_sent, st.bytes_received, st.messages_sent
        for k, value in ((k, reader.metadata.objects[k]) for k in leaves.objects if k in reader.metadata.objects):
            _set_path(state_dict, leaves.object_paths[k], value)
    return report


def _dropped_data(unexpected: list[str], used: set[str]) -> list[str]:
    """Unexpected keys that sit in a module whose other tensors the load reads (``q_proj.bias`` next to a read
    ``q_proj.weight``): data a non-strict load would silently drop, unlike another pipeline stage's layers."""
    modules = {k.rsplit(".", 1)[0] for k in used if "." in k}
    return [k for k in unexpected if "." in k and k.rsplit(".", 1)[0] in modules]


def _fmt_keys(keys: list[str], limit: int = 20) -> str:
    s = ", ".join(repr(k) for k in keys[:limit])
    return s + (f" ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def _set_path(root: Any, path: tuple, value: Any) -> None:
    node = root
    for p in path[:-1]:
        node = node[p]
    if isinstance(node, tuple):
        raise CheckpointError(f"cannot load object {flat_key(path)!r} into a tuple; use a list")
    node[path[-1]] = value


def _execute_work(reader: CheckpointReader, work: list[tuple[ReadItem, torch.Tensor]]) -> int:
    """Run ``(read item, target)`` pairs in the given order; returns the bytes read."""
    return sum(_execute(reader, target, [it]) for it, target in work)


def _execute(reader: CheckpointReader, target: torch.Tensor, items: list[ReadItem]) -> int:
    """Run one target's read items; returns the bytes read."""
    nbytes = 0
    items = sorted(items, key=lambda it: (it.file, it.name, it.src_flat_start, it.src_box))
    for it in items:
        if it.dst_flat_start or target.dim() != len(it.dst_shape):
            view = target.reshape(-1)[it.dst_flat_start:it.dst_flat_start + numel(it.dst_shape)].view(it.dst_shape)
        else:
            view = target
        dst = view[box_slices(it.dst_box)]
        if it.permute is None and it.dtype is None:
            reader.read_box(it.src_key, it.file, it.name, it.src_flat_start, it.src_shape, it.src_box, out=dst)
        else:
            t = reader.read_box(it.src_key, it.file, it.name, it.src_flat_start, it.src_shape, it.src_box)
            if it.permute is not None:
                t = t.permute(*it.permute)
            dst.copy_(cast_tensor(t, it.dtype))
        nbytes += it.numel * dtype_itemsize(reader.metadata.tensors[it.src_key].dtype)
    return nbytes
