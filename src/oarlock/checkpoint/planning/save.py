"""Save planning, pure functions of the ranks' descriptions: the shard records of a data file's header, how each rank
describes what it holds (DTensor grid rules, flat-partition rules, listed shards), the layout rank 0 builds from the
distinct descriptions (one writer per distinct box, byte-balanced over replicas), and the order a rank writes its
pieces in. :mod:`oarlock.checkpoint.runtime.save` runs them across ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import uuid
import weakref
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from oarlock.checkpoint.errors import CheckpointError, CheckpointMismatchError
from oarlock.checkpoint.model.flatgrid import FlatGrid
from oarlock.checkpoint.model.grid import GridLayout
from oarlock.checkpoint.model.metadata import ShardMeta, TensorMeta
from oarlock.checkpoint.model.names import (RESERVED_NAME, SAVE_ID_HEADER, SHARDS_DIGEST_HEADER, SHARDS_HEADER,
                                           WORLD_HEADER, data_file_name)
from oarlock.checkpoint.model.sharded import ShardedWeight
from oarlock.checkpoint.model.traversal import Leaves
from oarlock.checkpoint.planning.load import index_of

# ``dist`` arguments below are :class:`~oarlock.checkpoint.runtime.dist.DistWrapper` objects: planning reads a
# rank's place in its group (rank, group membership), never communicates
DistWrapper = Any
from oarlock.utils import dtype_itemsize

#: dtensor_grid's memo. Mesh and group are held weakly: a mesh holds its process groups (``_pg_registry``), and a
#: module-level reference kept the group's gloo threads running past ``destroy_process_group()`` into interpreter
#: finalization (see :func:`_cache_key`).
_GRID_MEMO: dict[tuple, tuple[tuple, GridLayout | None]] = {}


# CheckpointMetadata.extra entry of the TP-degree-dependent layouts (the AOA engine's TP_LAYOUTS_KEY; save does not
# import the AOA package)
TP_LAYOUTS_KEY = "tp_layouts"








def shard_record(offset, local_shape, global_shape, dtype: str, flattened_range) -> list:
    """One tensor's entry in :data:`SHARDS_HEADER`: ``[offset, local shape, global shape, dtype, flat range]``."""
    return [list(offset), list(local_shape), list(global_shape), dtype,
            list(flattened_range) if flattened_range is not None else None]


def sharded_weight_record(sw: ShardedWeight) -> list:
    """:func:`shard_record` of a live shard (what a same-layout restart compares)."""
    d = sw.desc
    return shard_record(d.global_offset, d.local_shape, d.global_shape, d.dtype, d.flattened_range)


def shards_digest(records: Mapping[str, list]) -> str:
    """SHA-256 (hex) of a data file's shard records ``{name: shard_record}``, in canonical JSON (sorted names)."""
    return hashlib.sha256(json.dumps(dict(records), sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def new_save_id() -> str:
    """A fresh unique save id (written into ``metadata.json`` and every data file of one save)."""
    return uuid.uuid4().hex


def shard_header(shards: list[tuple], world: int, save_id: str | None = None, digest: bool = False
                 ) -> dict[str, str]:
    """The safetensors ``__metadata__`` entries of a data file: its shards (what a same-layout restart compares),
    the size of the group that saved it, and the id of the save
    (:data:`~oarlock.checkpoint.model.metadata.SAVE_ID_HEADER`,
    checked against ``metadata.json`` on load). ``shards``: ``(name, global_offset, local_shape, global_shape,
    dtype, flattened_range)``. The shards are recorded in full (:data:`SHARDS_HEADER`), or with ``digest`` (packed
    files, whose headers must not grow with the number of tensors) as the SHA-256 of that record
    (:data:`SHARDS_DIGEST_HEADER`, :func:`shards_digest`)."""
    rec = {k: shard_record(off, ls, gs, dt, fr) for k, off, ls, gs, dt, fr in shards}
    if digest:
        out = {SHARDS_DIGEST_HEADER: shards_digest(rec), WORLD_HEADER: str(world)}
    else:
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
            name = stored_name(key, off, fr) if per_file[(h, key)] > 1 or key == RESERVED_NAME else key
            tensors[key].shards.append(ShardMeta(off, lshape, data_file_name(h), name, fr,
                                                 k if replicas else None))
    return tensors, writes


def stored_name(key: str, offset: tuple[int, ...], flattened_range: tuple[int, int] | None) -> str:
    """Name of a shard's tensor in a data file that holds several shards of ``key`` (``key@o0,o1`` and
    ``#start-stop`` for a flattened one); a file holding one shard of a key names it ``key``, except for the key
    ``__metadata__`` (:data:`~oarlock.checkpoint.storage.safetensors.RESERVED_NAME`, which safetensors keeps for its
    header block), always stored under this name."""
    name = f"{key}@{','.join(str(o) for o in offset)}"
    return name + (f"#{flattened_range[0]}-{flattened_range[1]}" if flattened_range is not None else "")


def shard_id(sw: ShardedWeight) -> tuple:
    """``(key, global offset, flattened range)``: what tells a rank's shards of one key apart."""
    d = sw.desc
    return (d.key, tuple(d.global_offset), d.flattened_range)


def local_tensors(leaves: Leaves) -> dict[tuple, torch.Tensor]:
    """This rank's shard tensors by :func:`shard_id`, the ``local`` argument of :func:`write_and_commit`."""
    return {shard_id(sw): sw.local_tensor for sw in leaves.shards}


@dataclass
class RankRecord:
    """What one rank contributes to the layout of a save (no tensor data).

    For states made of DTensors and replicated tensors the record is the same on every rank of a mesh: a DTensor
    is described by its grid rule (:class:`~oarlock.checkpoint.model.grid.GridLayout`), a whole tensor by its box,
    neither by who holds it. Ranks with equal records form one *class*; only one member of each class sends its
    record to the coordinator (:func:`prepare_save`), so coordination costs O(tensors x classes), not
    O(tensors x ranks).

    Attributes:
        tensors: ``(key, global_shape, dtype, grid or None)`` per key, in traversal order.
        listed: ``(key, global_shape, dtype, offset, local_shape, flattened_range, nbytes)`` of every shard not
            described by a grid (plain tensors, ShardedWeights, flat ranges).
        objects, nested, tp_layouts: JSON values, state-dict paths, TP layouts (see :func:`merge_tp_layouts`).
    """

    tensors: list[tuple] = field(default_factory=list)
    listed: list[tuple] = field(default_factory=list)
    objects: dict[str, Any] = field(default_factory=dict)
    nested: dict[str, list] = field(default_factory=dict)
    tp_layouts: dict[str, dict] = field(default_factory=dict)

    def fingerprint(self) -> str:
        """SHA-256 of the record's canonical JSON: equal records, equal fingerprints."""
        return self.spec_fingerprint() + self.data_fingerprint()

    def spec_fingerprint(self) -> str:
        """Of the part shared by the ranks of a mesh (tensor specs and grids, TP layouts, nesting)."""
        doc = [[(k, list(g), dt, gr.to_json() if gr is not None else None) for k, g, dt, gr in self.tensors],
               self.nested, self.tp_layouts]
        return hashlib.sha256(json.dumps(doc, sort_keys=True, default=list).encode()).hexdigest()[:32]

    def data_fingerprint(self) -> str:
        """Of the rank's listed shards and JSON values (rank-local for per-rank RNG states)."""
        doc = [self.listed, self.objects]
        return hashlib.sha256(json.dumps(doc, sort_keys=True, default=list).encode()).hexdigest()[:32]

    def listed_fingerprint(self) -> str:
        """Of the rank's listed shards only (what the write assignment depends on; JSON values such as a step
        counter change every save without changing the plan)."""
        return hashlib.sha256(json.dumps(self.listed, sort_keys=True, default=list).encode()).hexdigest()[:32]

    def objects_fingerprint(self) -> str:
        """Of the rank's JSON values."""
        return hashlib.sha256(json.dumps(self.objects, sort_keys=True, default=list).encode()).hexdigest()[:32]


@dataclass
class SavePlan:
    """The outcome of :func:`prepare_save` on one rank.

    ``writes[rank]`` lists the shard identities ``(key, offset, local_shape, flattened_range)`` this rank writes
    and ``names`` their tensor names in its data file. ``tensors`` (the checkpoint's metadata), ``objects``,
    ``nested`` and ``tp_layouts`` are filled on the coordinator (rank 0), which commits; other ranks hold None.
    """

    path: Path
    rank: int
    world: int
    tmp: Path
    writes: dict[int, list[tuple]]
    names: dict[tuple, str]
    leaves: Leaves
    save_id: str | None = None
    tensors: dict[str, TensorMeta] | None = None
    objects: dict[str, Any] | None = None
    nested: dict[str, list] | None = None
    tp_layouts: dict[str, dict] | None = None  # key -> TP-dependent layout record (metadata extra["tp_layouts"])
    overwrite: bool = False  # write into a destination holding entries oarlock did not write (they are kept)
    reused: bool = False  # the layout is the previous save's (see :func:`prepare_save`)
    check_on_write: bool = False  # the coordinator checks the destination in write_and_commit (reused plans)


def _mesh_affine(mesh: Any, dist: DistWrapper) -> tuple[tuple[int, ...], int, tuple[int, ...]] | None:
    """``(mesh shape, base, strides)`` when the group rank at mesh coordinate ``m`` is ``base + sum(m * strides)``
    (true of meshes built by ``init_device_mesh`` and their sub-meshes), else None."""
    m = mesh.mesh
    return _affine_ranks(m.reshape(-1).tolist(), tuple(int(n) for n in m.shape), dist)


def _affine_ranks(ranks: list[int], shape: tuple[int, ...], dist: DistWrapper
                  ) -> tuple[tuple[int, ...], int, tuple[int, ...]] | None:
    """:func:`_mesh_affine` of global ``ranks`` laid out row-major in ``shape``: their ranks in the save's group
    must be ``base + sum(m * strides)`` at coordinate ``m``; None when they are not, or one is outside the group."""
    if dist.group is not None and dist.active:
        import torch.distributed as tdist

        try:
            ranks = [tdist.get_group_rank(dist.group, r) for r in ranks]
        except (ValueError, RuntimeError):  # a mesh rank outside the save's group
            return None
    t = torch.tensor(ranks, dtype=torch.int64).reshape(shape) if shape else torch.tensor(ranks[0])
    base = int(ranks[0])
    strides = []
    for k, n in enumerate(shape):
        idx = [0] * len(shape)
        idx[k] = 1 if n > 1 else 0
        strides.append(int(t[tuple(idx)]) - base if n > 1 else 0)
    expect = torch.full(shape, base, dtype=torch.int64)
    for k, (n, st) in enumerate(zip(shape, strides)):
        view = [1] * len(shape)
        view[k] = n
        expect = expect + (torch.arange(n, dtype=torch.int64) * st).reshape(view)
    if not torch.equal(expect, t):
        return None
    return shape, base, tuple(strides)


def dtensor_grid(sw: ShardedWeight, dist: DistWrapper, cache: dict) -> GridLayout | None:
    """The grid rule of a DTensor shard, cross-checked against the box torch gave this rank; None when the layout
    is not a grid (the shard is then listed). Remembered per (mesh, group, placements, box): a training loop saves
    the same DTensors again and again, and the answer depends on nothing else."""
    mesh, placements = sw.placement_layout
    d = sw.desc
    memo_key = (id(mesh), id(dist.group), dist.rank, tuple(placements), d.global_shape, d.global_offset,
                d.local_shape)
    hit = _GRID_MEMO.get(memo_key)
    if hit is not None and hit[0][0]() is mesh and hit[0][1]() is dist.group:  # the objects, not an old id
        grid = hit[1]
    else:
        grid = _dtensor_grid(sw, dist, cache)
        if len(_GRID_MEMO) >= 8192:
            _GRID_MEMO.clear()
        _GRID_MEMO[memo_key] = ((weakref.ref(mesh), _weak(dist.group)), grid)
    if grid is not None and grid.replicas:
        # the replica rotation is the key's own (the memo is shared by every key of one geometry): without it every
        # same-shaped replicated tensor was written, and sent by a live reshard, by the same holders
        rot = zlib.crc32(d.key.encode()) % grid.nreplicas
        if rot != grid.rotate:
            grid = dataclasses.replace(grid, rotate=rot)
    return grid


def _weak(obj: Any) -> Any:
    """A weak reference to ``obj``, or a callable returning None for None (no group: a single process)."""
    return weakref.ref(obj) if obj is not None else (lambda: None)


def _dtensor_grid(sw: ShardedWeight, dist: DistWrapper, cache: dict) -> GridLayout | None:
    mesh, placements = sw.placement_layout
    aff = cache.get(id(mesh), False)
    if aff is False:
        aff = cache[id(mesh)] = _mesh_affine(mesh, dist)
    if aff is None:
        return None
    shape, base, strides = aff
    d = sw.desc
    grid = GridLayout.from_placements(d.global_shape, shape, placements, mesh_base=base, mesh_strides=strides,
                                      key=d.key)
    if grid is None:
        return None
    if d.numel:
        cell = grid.cell_of(d.global_shape, d.global_offset) if d.global_shape else ()
        if cell is None:
            return None
        bounds = grid.bounds(d.global_shape)
        if tuple(b[e + 1] - b[e] for b, e in zip(bounds, cell)) != tuple(d.local_shape) \
                or dist.rank not in grid.holders(cell):
            return None
    return grid


def _group_affine(group: Any, dist: DistWrapper) -> tuple[int, int, int] | None:
    """``(size, base, stride)`` when rank ``i`` of process group ``group`` is rank ``base + i * stride`` of the
    save's group, else None (a rank outside the save's group, or no affine map)."""
    if not dist.active:
        return (1, dist.rank, 1)
    import torch.distributed as tdist

    try:
        ranks = tdist.get_process_group_ranks(group if group is not None else tdist.group.WORLD)
    except (ValueError, RuntimeError):
        return None
    aff = _affine_ranks(ranks, (len(ranks),), dist) if ranks else None
    if aff is None:
        return None
    (size,), base, (stride,) = aff
    return size, base, stride or 1  # (a one-rank group has no step: 1, as a flat rule's writers need one)


def flat_partition_grid(sw: ShardedWeight, dist: DistWrapper, cache: dict) -> FlatGrid | None:
    """The flat grid rule of a flattened shard with a :class:`~oarlock.checkpoint.model.sharded.FlatPartition`, made on
    this rank alone and cross-checked against its own range; None when the shard cannot be one (a box that is not
    the whole tensor, a group that does not map affinely onto the save's ranks): it is then listed."""
    fp, d = sw.flat_partition, sw.desc
    n = math.prod(d.global_shape)
    if fp is None or n == 0 or any(d.global_offset) or tuple(d.local_shape) != tuple(d.global_shape):
        return None
    gkey = ("flat", id(fp.group))
    aff = cache.get(gkey, False)
    if aff is False:
        aff = cache[gkey] = _group_affine(fp.group, dist)
    if aff is None:
        return None
    size, base, stride = aff
    grid, j0 = FlatGrid.of_partition(n, fp.buffer_offset, fp.partition_size, base, stride)
    k = grid.count(n)
    if j0 + k > size or base + fp.index * stride != dist.rank:
        return None  # the buffer outgrows the group, or this rank is not the group's partition ``index``
    a, b = d.flattened_range
    if b > a and (not j0 <= fp.index < j0 + k or grid.shard(n, fp.index - j0) != (a, b)):
        return None
    return grid


def describe_rank(leaves: Leaves, dist: DistWrapper, save_replicas: bool = False
                  ) -> tuple[RankRecord, list[tuple]]:
    """This rank's :class:`RankRecord`, and the grid shards it writes itself (decided locally: it is the writer
    of its own cell). With ``save_replicas`` everything is listed (every holder writes its copy).

    Raises:
        CheckpointError: a shard held twice by this rank.
    """
    rec = RankRecord(objects=leaves.objects, nested=leaves.nested)
    writes: list[tuple] = []
    mine: set[tuple] = set()
    kinds: dict[str, bool] = {}  # key -> described by a grid
    cache: dict = {}
    for sw in leaves.shards:
        if shard_id(sw) in mine:
            raise CheckpointError(f"rank {dist.rank} holds the shard of key {sw.key!r} at offset "
                                  f"{list(sw.global_offset)} twice")
        mine.add(shard_id(sw))
        d = sw.desc
        grid = None
        # a grid names every stored tensor by its key: the reserved name needs listed shards (stored_name)
        if not save_replicas and sw.key not in kinds and sw.key != RESERVED_NAME:
            if sw.placement_layout is not None:
                grid = dtensor_grid(sw, dist, cache)
            elif sw.flat_partition is not None:
                grid = flat_partition_grid(sw, dist, cache)
        if sw.key not in kinds:
            rec.tensors.append((d.key, tuple(d.global_shape), d.dtype, grid))
            kinds[sw.key] = grid is not None
        elif kinds[sw.key]:
            raise CheckpointError(f"rank {dist.rank} holds key {sw.key!r} as a DTensor and as another shard")
        if sw.tp_layout:
            rec.tp_layouts[sw.key] = sw.tp_layout
        if isinstance(grid, FlatGrid):  # flat_partition_grid checked that a non-empty range is this rank's shard
            if d.numel:
                writes.append((d.key, tuple(d.global_offset), tuple(d.local_shape), d.flattened_range))
        elif grid is not None:
            cell = grid.cell_of(d.global_shape, d.global_offset) if d.global_shape else ()
            if d.numel and cell is not None and grid.writer(cell) == dist.rank:
                writes.append((d.key, tuple(d.global_offset), tuple(d.local_shape), None))
        else:
            rec.listed.append((d.key, tuple(d.global_shape), d.dtype, tuple(d.global_offset), tuple(d.local_shape),
                               d.flattened_range, d.numel * dtype_itemsize(d.dtype)))
    return rec, writes


@dataclass
class SaveLayout:
    """The coordinator's plan (:func:`build_layout`): the metadata per key, the listed shards each rank writes
    with their tensor names, and the merged JSON values."""

    tensors: dict[str, TensorMeta]
    listed_writes: dict[int, list[tuple[tuple, str]]]
    objects: dict[str, Any]
    nested: dict[str, list]
    tp_layouts: dict[str, dict]
    grid_skip: dict[int, list[str]] = field(default_factory=dict)
    """per rank, grid keys it holds but does not write (another sub-mesh's copy is recorded)"""


def build_layout(classes: Sequence[tuple[RankRecord, Sequence[int]]], world: int, replicas: bool = False
                 ) -> SaveLayout:
    """The save's layout from one record per class of ranks (``(record, member ranks)``, each class's members
    sharing the record): grid keys recorded once with their rule, listed shards assigned by
    :func:`assign_writes` (one writer per distinct box, byte-balanced), objects merged (rank 0's values win).

    Raises:
        CheckpointMismatchError: ranks disagree on a key's global shape, dtype or grid (naming key and ranks).
        CheckpointTilingError: listed shards of a key do not tile it.
    """
    classes = sorted(((rec, sorted(int(m) for m in members)) for rec, members in classes), key=lambda c: c[1][0])
    # classes sharing one tensor list (ranks that differ only in listed shards or objects, e.g. per-rank RNG
    # states) are walked once: the work is O(tensors x distinct tensor lists), not O(tensors x ranks)
    by_spec: dict[int, tuple[RankRecord, list[int]]] = {}
    for rec, members in classes:
        by_spec.setdefault(id(rec.tensors), (rec, []))[1].extend(members)
    spec: dict[str, tuple[tuple, str, int]] = {}
    grids: dict[str, list[tuple[GridLayout, int]]] = {}
    candidates: dict[tuple[str, GridLayout], list[int]] = {}
    order: list[str] = []
    per_rank: list[list[tuple]] = [[] for _ in range(world)]
    listed_keys: dict[str, int] = {}
    for rec, members in sorted(by_spec.values(), key=lambda c: min(c[1])):
        members = sorted(members)
        r = members[0]
        for key, gshape, dtype, grid in rec.tensors:
            gshape = tuple(gshape)
            if key not in spec:
                spec[key] = (gshape, dtype, r)
                order.append(key)
            elif spec[key][:2] != (gshape, dtype):
                g0, d0, r0 = spec[key]
                raise CheckpointMismatchError(f"key {key!r}: rank {r0} saves global shape {list(g0)} {d0}, rank {r} "
                                              f"saves {list(gshape)} {dtype}")
            if grid is not None:
                found = grids.setdefault(key, [])
                if grid not in (g for g, _ in found):
                    found.append((grid, r))
                candidates.setdefault((key, grid), []).extend(members)
            else:
                listed_keys.setdefault(key, r)
    for rec, members in classes:
        for m in members:
            if not 0 <= m < world:
                raise CheckpointError(f"class member rank {m} outside a group of {world}")
            per_rank[m] = rec.listed
    skip: dict[int, list[str]] = {}
    chosen: dict[str, GridLayout | FlatGrid] = {}
    for key in order:
        found = grids.get(key)
        if found and all(isinstance(g, FlatGrid) for g, _ in found) and (
                key in listed_keys or any(not g.same_rule(found[0][0]) for g, _ in found)):
            # some ranks' shards could not be one rule (listed), or the rules differ: the rules give every shard
            # and its writer exactly, so the key is listed as if no rank had sent a rule and its holders write
            # named entries (ranks of one group that disagree are named by _demote_flat; copies cut differently
            # in disjoint groups overlap and fail the tiling check, as their listed ranges always did)
            _demote_flat(key, spec[key][:2], found, candidates, per_rank, skip)
            listed_keys.setdefault(key, found[0][1])
            del grids[key]
    for key in order:
        if key in grids and key in listed_keys:
            raise CheckpointMismatchError(f"key {key!r}: rank {grids[key][0][1]} saves it as a grid (a DTensor or a "
                                          f"flat partition), rank {listed_keys[key]} as a plain tensor or "
                                          "ShardedWeight")
        found = grids.get(key)
        if not found:
            continue
        g0, r0 = found[0]
        for g, r in found[1:]:
            # DTensors on disjoint sub-meshes holding the same boxes (TP meshes of different DP replicas): one
            # mesh's copy is recorded, spread over the copies by key; the other meshes' ranks do not write it
            if not g.same_rule(g0):
                raise CheckpointMismatchError(f"key {key!r}: ranks {r0} and {r} save it with different grid rules "
                                              "(DTensor meshes or placements, or flat buffer partitions)")
        pick = sorted(found, key=lambda x: x[0].base)[zlib.crc32(key.encode()) % len(found)][0]
        chosen[key] = pick
        for g, _ in found:
            if g != pick:
                for m in candidates[(key, g)]:
                    skip.setdefault(m, []).append(key)
    listed, writes = assign_writes(per_rank, replicas)
    tensors: dict[str, TensorMeta] = {}
    for key in order:
        gshape, dtype, _ = spec[key]
        if key in chosen:
            tensors[key] = TensorMeta(key, gshape, dtype, grid=chosen[key])
        else:
            tensors[key] = listed[key]
            index_of(tensors[key])  # validates that the shards tile the global box
    names = {(s.file, key, s.global_offset, s.flattened_range): s.name for key, t in listed.items() for s in t.shards}
    listed_writes = {r: [(i, names[(data_file_name(r), i[0], i[1], i[3])]) for i in ids] for r, ids in writes.items()}
    objects: dict[str, Any] = {}
    nested: dict[str, list] = {}
    for rec, _ in reversed(classes):  # the lowest rank's values win
        objects.update(rec.objects)
        nested.update(rec.nested)
    return SaveLayout(tensors, listed_writes, objects, nested, merge_tp_layouts([rec.tp_layouts for rec, _ in classes]),
                      skip)


def _demote_flat(key: str, spec: tuple[tuple, str], found: list[tuple[FlatGrid, int]],
                 candidates: dict[tuple[str, Any], list[int]], per_rank: list[list[tuple]],
                 skip: dict[int, list[str]]) -> None:
    """Turn the flat grid rules ranks sent for ``key`` into the listed shards they stand for (one per shard, on its
    writer's list), and tell the rules' senders not to write the key as a packed piece (:func:`build_layout`)."""
    gshape, dtype = spec
    n = math.prod(gshape)
    zeros = (0,) * len(gshape)
    copied: set[int] = set()
    claimed: dict[int, tuple[FlatGrid, int]] = {}  # writer rank -> (rule, a rank that sent it)
    for g, sender in found:
        for i in range(g.count(n)):
            a, b = g.shard(n, i)
            w = g.writer(i)
            if not 0 <= w < len(per_rank):
                raise CheckpointError(f"key {key!r}: flat rule {g!r} names writer rank {w} outside a group of "
                                      f"{len(per_rank)}")
            other = claimed.setdefault(w, (g, sender))
            if other[0] != g:  # copies of one buffer in disjoint groups never share a writer: these ranks disagree
                raise CheckpointMismatchError(
                    f"key {key!r}: ranks {other[1]} and {sender} describe its flat buffer partition differently "
                    f"(FlatPartition buffer_offset / partition_size): rank {other[1]}'s cuts it after element "
                    f"{other[0].first} and then every {other[0].step} elements, rank {sender}'s after {g.first} "
                    f"and every {g.step}, and both give rank {w} a shard")
            if w not in copied:  # class members share one list object: copy before adding to it
                per_rank[w] = list(per_rank[w])
                copied.add(w)
            per_rank[w].append((key, gshape, dtype, zeros, gshape, (a, b), (b - a) * dtype_itemsize(dtype)))
        for m in candidates[(key, g)]:
            skip.setdefault(m, []).append(key)


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


def desc_tuple(sw: ShardedWeight) -> tuple:
    d = sw.desc
    return (d.global_offset, d.local_shape, d.global_shape, d.dtype, d.flattened_range)


def write_order(plan: SavePlan) -> list[tuple]:
    """The :func:`shard_id` s this rank writes, in the order of its data file (an asynchronous save stages them
    in this order, so the writer can start on the first tensor while the next are being copied)."""
    ids = sorted({(i[0], i[1], i[3]) for i in plan.writes.get(plan.rank, [])}, key=lambda i: (i[0], i[1], i[2] or ()))
    # the packed pieces (grid shards, by key) come first in the file, then the named entries
    return [i for i in ids if plan.names.get(i) is None] + [i for i in ids if plan.names.get(i) is not None]
