"""Shards of global tensors: :class:`ShardedWeight`, its hashable :class:`ShardDesc`, and the constructors that
describe replicated, axis-sharded and DTensor parameters (terms: ``docs/checkpoint-format.md``).

A shard is an axis-aligned *box* of a global tensor: ``global_offset`` (start per dimension) and ``local_shape``
(extent per dimension); scalars have ``()`` for both. A *flattened* shard (ZeRO / FSDP1 flat buffers) holds only
the elements ``[flattened_range.start, flattened_range.stop)`` of the row-major flattening of its box as a 1-D
tensor. :func:`~oarlock.checkpoint.model.boxes.flat_range_boxes` cuts such a range into at most ``2 * ndim - 1``
regular boxes, each contiguous in flat order, so the planner treats flattened shards like a few regular ones. The
box arithmetic lives in :mod:`oarlock.checkpoint.model.boxes` (its functions are importable from here too).
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from oarlock.checkpoint.errors import CheckpointError
from oarlock.checkpoint.model.boxes import (Box, box_intersection, box_shift, box_volume, flat_range_boxes, make_box,
                                            numel, stored_numel)
from oarlock.utils import dtype_name

__all__ = ["FlatPartition", "ShardDesc", "ShardedWeight", "TP_LAYOUT_ATTR", "box_intersection", "box_shift",
           "box_volume", "flat_range_boxes", "is_dtensor", "is_sharded_tensor", "make_box", "sharded_state_dict",
           "sharded_tensor_shards", "to_sharded_weight"]

# Attribute of a parameter (or any tensor) naming its TP-degree-dependent stored layout; see ShardedWeight.tp_layout.
TP_LAYOUT_ATTR = "tp_layout"


# ---------------------------------------------------------------- shard descriptions

@dataclass(frozen=True)
class ShardDesc:
    """Hashable description of one shard (what the planner and the AOA engine see; no data).

    Attributes:
        key: tensor key.
        local_shape: extent of the shard's box per dimension.
        global_shape: shape of the whole tensor.
        global_offset: start of the box per dimension.
        dtype: canonical dtype name (``"float32"``, ``"bfloat16"``, ...).
        flattened_range: ``(start, stop)`` within the box's row-major flattening for flattened shards, else None.
    """

    key: str
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    dtype: str
    flattened_range: tuple[int, int] | None = None

    @property
    def box(self) -> Box:
        """The shard's box in global coordinates."""
        return make_box(self.global_offset, self.local_shape)

    @property
    def numel(self) -> int:
        """Elements the shard's local tensor holds."""
        return stored_numel(self.local_shape, self.flattened_range)


@dataclass(frozen=True)
class FlatPartition:
    """Where a flattened shard lies in a flat buffer split evenly over a process group (ZeRO stage 1/2 optimizer
    states, FSDP1 flat parameters): the buffer concatenates the row-major flattenings of several tensors, and
    group rank ``i`` holds its elements ``[i * partition_size, (i + 1) * partition_size)`` (ZeRO: Rajbhandari et
    al. 2020, arXiv 1910.02054, section 5). With it a save records the tensor as one flat grid rule, decided on
    each rank from its own shard, so the ranks' descriptions are equal and no rank sends its flat ranges to the
    coordinator (``docs/checkpoint-format.md``, "Who writes what").

    Attributes:
        buffer_offset: element of the buffer where the box's flattening starts (>= 0).
        partition_size: elements per partition (>= 1; the buffer is padded to ``group size x partition_size``).
        index: the partition this rank holds (its rank in ``group``).
        group: the process group the buffer is split over (``None``: the default group).
    """

    buffer_offset: int
    partition_size: int
    index: int
    group: Any = field(default=None, compare=False, hash=False)

    def span(self, n: int) -> tuple[int, int]:
        """The elements ``[a, b)`` of an ``n``-element flattening inside partition ``index`` (``a == b`` when it
        holds none of them)."""
        lo = self.index * self.partition_size - self.buffer_offset
        a, b = min(max(lo, 0), n), min(max(lo + self.partition_size, 0), n)
        return (a, b) if b > a else (a, a)


@dataclass
class ShardedWeight:
    """One rank's shard of a global tensor, with the tensor itself.

    ``local_tensor`` has shape ``local_shape`` (regular shard) or is 1-D with ``stop - start`` elements holding
    ``flattened_range`` of the box's row-major flattening (flattened shard). Loading writes into it in place.

    ``tp_layout``: set when the global tensor is stored in a tensor-parallel-degree-dependent layout (the rows of a
    fused gate/up weight as TP-rank blocks): ``{"statement": "fused_ffn", "tp": degree, "axis": 0}``, the record
    ``oarlock convert --tp`` writes for such keys. A save records it in the checkpoint metadata
    (``extra["tp_layouts"]``) so that a load at another degree re-lays the tensor out (``docs/aoa.md``,
    "TP-dependent layouts"). :func:`to_sharded_weight` takes it from a tensor's ``tp_layout`` attribute
    (:data:`TP_LAYOUT_ATTR`).

    Raises:
        CheckpointError: naming the key when shapes, offsets and the tensor disagree, or the box leaves the
            global shape.
    """

    key: str
    local_tensor: torch.Tensor
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    flattened_range: slice | tuple[int, int] | None = None
    tp_layout: dict | None = None
    placement_layout: Any = field(default=None, repr=False, compare=False)
    """``(device_mesh, placements)`` of the DTensor this shard came from (set by :meth:`from_dtensor`): lets a save
    record the tensor as one grid rule and decide locally whether this rank writes it
    (:mod:`oarlock.checkpoint.model.grid`)."""
    flat_partition: FlatPartition | None = field(default=None, repr=False, compare=False)
    """For a flattened shard of an evenly split flat buffer: where it lies in the buffer (:class:`FlatPartition`).
    A save then records the tensor as one flat grid rule instead of listing every rank's range."""

    def __post_init__(self) -> None:
        self.local_shape = tuple(int(x) for x in self.local_shape)
        self.global_shape = tuple(int(x) for x in self.global_shape)
        self.global_offset = tuple(int(x) for x in self.global_offset)
        fr = self.flattened_range
        if isinstance(fr, slice):
            fr = (fr.start or 0, fr.stop)
        self.flattened_range = (int(fr[0]), int(fr[1])) if fr is not None else None
        if not isinstance(self.local_tensor, torch.Tensor):
            raise CheckpointError(f"ShardedWeight {self.key!r}: local_tensor must be a torch.Tensor, "
                                  f"got {type(self.local_tensor).__name__}")
        if not (len(self.local_shape) == len(self.global_shape) == len(self.global_offset)):
            raise CheckpointError(f"ShardedWeight {self.key!r}: local_shape {self.local_shape}, global_shape "
                                  f"{self.global_shape} and global_offset {self.global_offset} differ in rank")
        for d, (o, n, g) in enumerate(zip(self.global_offset, self.local_shape, self.global_shape)):
            if o < 0 or n < 0 or o + n > g:
                raise CheckpointError(f"ShardedWeight {self.key!r}: box offset {self.global_offset} + shape "
                                      f"{self.local_shape} leaves global shape {self.global_shape} in dim {d}")
        if self.flattened_range is None:
            if tuple(self.local_tensor.shape) != self.local_shape:
                raise CheckpointError(f"ShardedWeight {self.key!r}: local_tensor has shape "
                                      f"{tuple(self.local_tensor.shape)}, local_shape says {self.local_shape}")
        else:
            a, b = self.flattened_range
            if not 0 <= a <= b <= numel(self.local_shape):
                raise CheckpointError(f"ShardedWeight {self.key!r}: flattened_range {self.flattened_range} is not "
                                      f"inside the box of {numel(self.local_shape)} elements")
            if self.local_tensor.dim() != 1 or self.local_tensor.numel() != b - a:
                raise CheckpointError(f"ShardedWeight {self.key!r}: a flattened shard needs a 1-D local_tensor of "
                                      f"{b - a} elements, got shape {tuple(self.local_tensor.shape)}")
        fp = self.flat_partition
        if fp is not None:
            if self.flattened_range is None:
                raise CheckpointError(f"ShardedWeight {self.key!r}: a flat_partition needs a flattened_range")
            if fp.buffer_offset < 0 or fp.partition_size < 1 or fp.index < 0:
                raise CheckpointError(f"ShardedWeight {self.key!r}: malformed {fp!r} (needs buffer_offset >= 0, "
                                      "partition_size >= 1, index >= 0)")
            a, b = self.flattened_range
            want = fp.span(numel(self.local_shape))
            if (b > a or want[1] > want[0]) and (a, b) != want:
                raise CheckpointError(f"ShardedWeight {self.key!r}: flattened_range {self.flattened_range} is not "
                                      f"partition {fp.index} of {fp.partition_size} elements of a buffer where the "
                                      f"tensor starts at element {fp.buffer_offset} (that partition holds {want})")

    @property
    def desc(self) -> ShardDesc:
        """The hashable :class:`ShardDesc` of this shard.

        Raises:
            CheckpointError: the tensor's dtype is not one oarlock checkpoints store (naming the key)."""
        try:
            dt = dtype_name(self.local_tensor.dtype)
        except ValueError:
            raise CheckpointError(f"key {self.key!r}: dtype {self.local_tensor.dtype} is not supported by oarlock "
                                  "checkpoints (supported: float64/32/16, bfloat16, float8_e4m3fn/e5m2, "
                                  "int64/32/16/8, uint64/32/16/8, bool, complex64)") from None
        return ShardDesc(self.key, self.local_shape, self.global_shape, self.global_offset, dt,
                         self.flattened_range)

    @property
    def box(self) -> Box:
        return make_box(self.global_offset, self.local_shape)

    # ------------------------------------------------------------ constructors

    @classmethod
    def replicated(cls, key: str, tensor: torch.Tensor) -> "ShardedWeight":
        """The whole tensor (offset zeros, local shape = global shape); every holder is a replica."""
        shape = tuple(tensor.shape)
        return cls(key, tensor, shape, shape, (0,) * len(shape))

    @classmethod
    def shard_along_axis(cls, key: str, tensor: torch.Tensor, axis: int, *, process_group: Any = None,
                         sizes: Sequence[int] | None = None, rank: int | None = None) -> "ShardedWeight":
        """This rank's piece of a tensor split along ``axis`` over the ranks of ``process_group`` in rank order.

        ``sizes`` gives every rank's extent along ``axis`` (uneven splits). Without it the extents are
        all-gathered from the group (a collective: every rank of the group must call), so uneven splits need no
        extra bookkeeping; without a process group the tensor is the whole axis. ``rank`` overrides this
        process's position in the group (for building descriptions of other ranks in tests).

        Raises:
            CheckpointError: bad axis, or ``sizes`` that do not match the local tensor.
        """
        nd = tensor.dim()
        if not -nd <= axis < nd or nd == 0:
            raise CheckpointError(f"ShardedWeight {key!r}: axis {axis} out of range for a {nd}-D tensor")
        axis %= nd
        if rank is None or sizes is None:
            own, gathered = _group_extents(key, process_group, int(tensor.shape[axis]), gather=sizes is None)
            rank = own if rank is None else rank
            sizes = gathered if sizes is None else sizes
        sizes = [int(s) for s in sizes]
        if not 0 <= rank < len(sizes) or sizes[rank] != tensor.shape[axis]:
            raise CheckpointError(f"ShardedWeight {key!r}: rank {rank} holds {tensor.shape[axis]} along axis "
                                  f"{axis}, sizes say {sizes}")
        gshape = list(tensor.shape)
        gshape[axis] = sum(sizes)
        offset = [0] * nd
        offset[axis] = sum(sizes[:rank])
        return cls(key, tensor, tuple(tensor.shape), tuple(gshape), tuple(offset))

    @classmethod
    def from_dtensor(cls, key: str, dtensor: Any) -> "ShardedWeight | None":
        """This rank's shard of a ``torch.distributed.tensor.DTensor`` (any mesh and placements: uneven
        ``Shard``, several mesh dims sharding one tensor dim, ``Replicate``; replicated boxes become replicas).

        The box comes from torch's own ``compute_local_shape_and_global_offset`` and is cross-checked against
        the local tensor. Returns None on ranks outside the DTensor's mesh (they hold nothing).

        Raises:
            CheckpointError: a ``Partial`` placement (reduce it first), or a local tensor whose shape disagrees
                with the placements.
        """
        mesh, placements = dtensor.device_mesh, tuple(dtensor.placements)
        gshape = tuple(dtensor.shape)
        box = _dtensor_box(mesh, placements, gshape, _process_rank())
        if box is None:
            return None
        if box is _PARTIAL:
            raise CheckpointError(f"DTensor {key!r} has a Partial placement ({placements}); reduce it "
                                  "(e.g. redistribute to Replicate) before saving or loading")
        local_shape, offset = box
        with torch.no_grad():  # the local tensor itself, not a view through autograd (half of this call's time)
            local = dtensor.to_local()
        if tuple(local.shape) != tuple(local_shape):
            raise CheckpointError(f"DTensor {key!r}: local tensor has shape {tuple(local.shape)} but placements "
                                  f"{placements} on mesh {tuple(mesh.shape)} give {tuple(local_shape)}")
        if cls is not ShardedWeight:
            return cls(key, local, tuple(local_shape), gshape, tuple(offset), placement_layout=(mesh, placements))
        # the box comes from torch's own placement arithmetic and the local shape was just checked against it: the
        # checks of __post_init__ would repeat them (a third of this call's time, which a save or an async save's
        # stall pays per DTensor: 2,000 DTensors of a 70B state took 26 ms)
        sw = object.__new__(ShardedWeight)
        sw.__dict__.update(key=key, local_tensor=local, local_shape=tuple(local_shape), global_shape=gshape,
                           global_offset=tuple(offset), flattened_range=None, tp_layout=None,
                           placement_layout=(mesh, placements))
        return sw


_PARTIAL = object()


def _group_extents(key: str, process_group: Any, extent: int, gather: bool) -> tuple[int, list[int]]:
    """This process's rank in ``process_group`` and, with ``gather``, every rank's ``extent`` in group-rank order
    (``[extent]`` without one): the one exchange the data model makes, an ``all_gather_object`` of an int that
    :meth:`ShardedWeight.shard_along_axis` documents as a collective. Made with torch.distributed itself: the
    communication layer (:mod:`oarlock.checkpoint.runtime.dist`) builds on this package, not the other way round.

    Raises:
        CheckpointError: a ``process_group`` was given but torch.distributed is no longer initialised.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise CheckpointError(f"ShardedWeight {key!r}: a process_group was given but torch.distributed is not "
                                  "initialised (was the group destroyed?)")
        return 0, [extent]
    rank, size = dist.get_rank(process_group), dist.get_world_size(process_group)
    if not gather or size == 1:
        return rank, [extent]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, extent, group=process_group)
    return rank, out


def _process_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else -1


#: _dtensor_box's cache: (id(mesh), placements, shape, rank) -> (weak reference to the mesh, box).
_BOX_CACHE: dict[tuple, tuple[Any, Any]] = {}


def _dtensor_box(mesh: Any, placements: tuple, gshape: tuple[int, ...], rank: int) -> Any:
    """``(local shape, global offset)`` of this rank's box of a DTensor (torch's own
    ``compute_local_shape_and_global_offset``), None off the mesh, ``_PARTIAL`` for a Partial placement. Cached:
    the tensors of a model share a few (mesh, placements, shape) triples, and torch's computation costs a
    millisecond or more per call, which dominated describing a state of thousands of DTensors. ``rank`` (this
    process's global rank) is part of the key because equal meshes compare equal across process groups.

    The mesh is held weakly (an entry counts only for the very mesh object it was made for): a mesh holds its
    process groups (``DeviceMesh._pg_registry``), and a module-level cache that kept it kept the group's gloo
    threads running past ``destroy_process_group()`` into interpreter finalization (docs/checkpoint-format.md,
    "Ending a multi-rank script")."""
    key = (id(mesh), placements, gshape, rank)
    hit = _BOX_CACHE.get(key)
    if hit is not None and hit[0]() is mesh:
        return hit[1]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if mesh.get_coordinate() is None:
        box = None
    elif any(p.is_partial() for p in placements):
        box = _PARTIAL
    else:
        local_shape, offset = compute_local_shape_and_global_offset(gshape, mesh, placements)
        box = tuple(int(x) for x in local_shape), tuple(int(x) for x in offset)
    if len(_BOX_CACHE) >= 4096:
        _BOX_CACHE.clear()
    _BOX_CACHE[key] = (weakref.ref(mesh), box)
    return box


def is_dtensor(x: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor``."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(x, DTensor)


def is_sharded_tensor(x: Any) -> bool:
    """True for torch's (legacy) ``ShardedTensor``, which may hold several local shards per rank.

    Never imports torch's module: importing it after ``init_process_group`` imports ``torch.distributed.nn``,
    whose functions take ``group=group.WORLD`` as default arguments and so keep that process group alive past
    ``destroy_process_group()``; its gloo threads then run into interpreter finalization and abort the process
    about one run in three ("terminate called without an active exception"; 8 of 20 runs of two gloo ranks
    doing nothing but that import and a few all-reduces). A ShardedTensor exists only once its module is loaded."""
    mod = sys.modules.get("torch.distributed._shard.sharded_tensor")
    return mod is not None and isinstance(x, mod.ShardedTensor)


def sharded_tensor_shards(key: str, st: Any) -> list[ShardedWeight]:
    """One :class:`ShardedWeight` per local shard of a torch ``ShardedTensor`` (its ``local_shards()``, each with
    ``metadata.shard_offsets`` / ``shard_sizes``); the local tensors are shared, so loads write in place."""
    gshape = tuple(st.size())
    return [ShardedWeight(key, sh.tensor, tuple(sh.metadata.shard_sizes), gshape, tuple(sh.metadata.shard_offsets))
            for sh in st.local_shards()]


def to_sharded_weight(key: str, leaf: Any) -> ShardedWeight | None:
    """``leaf`` as this rank's :class:`ShardedWeight` under ``key`` (the one place a state-dict leaf becomes a
    shard): a ShardedWeight as is (its own key), a DTensor as its local shard (None on ranks outside its mesh), a
    tensor as a whole replicated box (detached).
    A tensor's ``tp_layout`` attribute (:data:`TP_LAYOUT_ATTR`, set by
    :func:`oarlock.models.parallel.parallelize_llama` on fused gate/up weights) becomes the shard's ``tp_layout``.

    Raises:
        TypeError: ``leaf`` is not a tensor (callers turn it into their own error).
    """
    if isinstance(leaf, ShardedWeight):
        return leaf
    layout = getattr(leaf, TP_LAYOUT_ATTR, None)
    if is_dtensor(leaf):
        sw = ShardedWeight.from_dtensor(key, leaf)
    elif isinstance(leaf, torch.Tensor):
        sw = ShardedWeight.replicated(key, leaf.detach())
    else:
        raise TypeError(f"{key!r}: a {type(leaf).__name__} is not a tensor")
    if sw is not None and isinstance(layout, dict):
        sw.tp_layout = dict(layout)
    return sw


def sharded_state_dict(module: torch.nn.Module, prefix: str = "") -> dict[str, ShardedWeight]:
    """Flat ``{key: ShardedWeight}`` for every entry of ``module.state_dict()`` (parameters and persistent
    buffers). DTensor entries become their local shard (see :meth:`ShardedWeight.from_dtensor`; skipped on
    ranks outside the mesh); plain tensors are whole, replicated boxes. The local tensors share storage with
    the module, so loading into the result updates the module in place."""
    out: dict[str, ShardedWeight] = {}
    for name, t in module.state_dict(prefix=prefix, keep_vars=True).items():
        if isinstance(t, torch.Tensor):
            sw = to_sharded_weight(name, t)
            if sw is not None:
                out[name] = sw
    return out
