"""The load plan: a pure function of (saved metadata, requested shards, mapping program) -> read items.

No files, no processes: :func:`plan_load` only does interval arithmetic (``docs/checkpoint-format.md``,
"Loading"; the planner/storage split follows torch.distributed.checkpoint). For each requested shard box
and each :class:`~oarlock.checkpoint.model.mapping.SliceMapping` of its key, the planner intersects the mapping's
destination box with the request, maps that part back to a source sub-box (through the inverse permutation),
and intersects the sub-box with the stored pieces of the source key. Each non-empty overlap is one
:class:`ReadItem`: which stored array to read, which box of it, where it lands in the target, and the
permutation and cast on the way.

Stored shards are indexed per key (:class:`KeyIndex`), so a request costs a few binary searches instead of a
scan over every stored shard: saved layouts that form a product grid (DTensor, TP, whole tensors) are looked up
cell by cell; anything else through a sorted window on the most-split dimension. Flattened shards (ZeRO flat
buffers) on either side are cut into at most ``2 * ndim - 1`` regular boxes that are each contiguous in the
flat tensor (:func:`~oarlock.checkpoint.model.boxes.flat_range_boxes`), so they plan like regular shards.
"""

from __future__ import annotations

import bisect
import gc
import itertools
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Sequence

from oarlock.checkpoint.errors import CheckpointError, CheckpointMismatchError, CheckpointTilingError
from oarlock.checkpoint.model.boxes import Box, box_intersection, box_volume, flat_range_boxes, make_box, numel
from oarlock.checkpoint.model.flatgrid import FlatGrid, FlatIndex
from oarlock.checkpoint.model.grid import GridIndex, cell_ranges
from oarlock.checkpoint.model.mapping import IdentityProgram, MappingProgram, SliceMapping, TensorSpec, final_dtype
from oarlock.checkpoint.model.metadata import CheckpointMetadata, TensorMeta
from oarlock.checkpoint.model.sharded import ShardDesc
from oarlock.utils import gc_paused


class StoredPiece(NamedTuple):
    """A regular box of stored data.

    ``box`` is in global coordinates (``origin`` its start, ``shape`` its extent). The data is a C-contiguous
    array of shape ``shape`` stored as tensor ``name`` of ``file``, starting ``flat_start`` elements into that
    tensor (0 for regular shards; the piece's place in the 1-D tensor for flattened shards).
    """

    box: Box
    file: str
    name: str
    flat_start: int
    origin: tuple[int, ...]
    shape: tuple[int, ...]


def _piece(box: Box, file: str, name: str, flat_start: int = 0) -> StoredPiece:
    return StoredPiece(box, file, name, flat_start, tuple(a for a, _ in box), tuple(b - a for a, b in box))


class ReadItem(NamedTuple):
    """Copy ``stored[src_box]`` (of the array ``file``/``name``, ``src_flat_start`` elements in, shape
    ``src_shape``) into ``target[dst_box]``, where ``target`` is the requested local tensor viewed as a
    ``dst_shape`` array starting ``dst_flat_start`` elements in (the whole local tensor for regular targets).
    ``permute`` and ``dtype`` are applied on the way (``torch.permute`` order; cast target name)."""

    dst_key: str
    dst_flat_start: int
    dst_shape: tuple[int, ...]
    dst_box: Box
    src_key: str
    file: str
    name: str
    src_flat_start: int
    src_shape: tuple[int, ...]
    src_box: Box
    permute: tuple[int, ...] | None = None
    dtype: str | None = None

    @property
    def numel(self) -> int:
        return box_volume(self.src_box)


#: ``(label, template)``: read items of one key held compactly. ``label`` is ``(dst_key, dst_flat_start, dst_shape,
#: src_key, dtype)``; ``template`` a list of ``(dst_box, file, src_flat_start, src_shape, src_box)``, one per stored
#: piece read, shared by every key of the same grid geometry (a model's layers), so a rank that reads millions of
#: pieces holds one template per geometry, not one object per piece.
ItemGroup = tuple[tuple, list]


def expand_group(label: tuple, template: list) -> list[ReadItem]:
    """The :class:`ReadItem` s of one :data:`ItemGroup` (the stored array's name is its key: grid-recorded keys)."""
    key, tflat, tshape, src_key, dtype = label
    new = tuple.__new__  # ReadItem(...) without the named tuple constructor's Python frame: millions at scale
    return [new(ReadItem, (key, tflat, tshape, f[0], src_key, f[1], src_key, f[2], f[3], f[4], None, dtype))
            for f in template]


@dataclass
class LoadPlan:
    """One rank's read items, and the requested keys the program cannot produce (``missing_keys``).

    ``groups``: with ``Planner.plan_rank(..., compact=True)``, the items of grid-recorded keys as
    :data:`ItemGroup` s (not in ``items``); :meth:`all_items` gives every item either way."""

    items: list[ReadItem] = field(default_factory=list)
    missing_keys: list[str] = field(default_factory=list)
    groups: list[ItemGroup] = field(default_factory=list)

    def all_items(self) -> list[ReadItem]:
        """``items`` followed by the items of ``groups``."""
        return self.items + [it for label, tmpl in self.groups for it in expand_group(label, tmpl)]

    def item_count(self) -> int:
        """Number of read items, without making the grouped ones."""
        return len(self.items) + sum(len(tmpl) for _, tmpl in self.groups)


# ---------------------------------------------------------------- stored-shard index

class KeyIndex:
    """The stored pieces of one key, indexed for box queries and checked to tile the global box exactly.

    Raises:
        CheckpointTilingError: naming the key and the box of the first gap, overlap, or out-of-bounds shard.
    """

    def __init__(self, meta: TensorMeta):
        self.key = meta.key
        self.global_shape = tuple(meta.global_shape)
        self.pieces: list[StoredPiece] = []
        for s in meta.primary_shards():
            if s.flattened_range is None:
                if numel(s.local_shape):
                    self.pieces.append(_piece(make_box(s.global_offset, s.local_shape), s.file, s.name))
            else:
                for off, ext, fs in flat_range_boxes(s.local_shape, *s.flattened_range):
                    if numel(ext):
                        gb = make_box([o + a for o, a in zip(s.global_offset, off)], ext)
                        self.pieces.append(_piece(gb, s.file, s.name, fs))
        self._grid: list[list[int]] | None = None
        self._cells: dict[tuple[int, ...], StoredPiece] = {}
        self._check_bounds()
        if not self._build_grid():
            self._build_window()
        self._check_tiling()

    # -- construction
    def _check_bounds(self) -> None:
        g = self.global_shape
        for p in self.pieces:
            if len(p.box) != len(g) or any(a < 0 or b > n for (a, b), n in zip(p.box, g)):
                raise CheckpointTilingError(f"stored shard of {self.key!r} with box {_fmt_box(p.box)} "
                                            f"(file {p.file}) lies outside the global shape {list(g)}")

    def _build_grid(self) -> bool:
        """Index a product-grid layout cell by cell; False if the pieces are not grid cells."""
        nd = len(self.global_shape)
        bounds = []
        for d in range(nd):
            bounds.append(sorted({p.box[d][0] for p in self.pieces} | {p.box[d][1] for p in self.pieces}
                                 | {0, self.global_shape[d]}))
        cells: dict[tuple[int, ...], StoredPiece] = {}
        for p in self.pieces:
            cell = []
            for d, (a, b) in enumerate(p.box):
                k = bisect.bisect_left(bounds[d], a)
                if bounds[d][k + 1] != b:
                    return False
                cell.append(k)
            cell_t = tuple(cell)
            if cell_t in cells:
                raise CheckpointTilingError(f"stored shards of {self.key!r} overlap in box {_fmt_box(p.box)} "
                                            f"(files {cells[cell_t].file} and {p.file})")
            cells[cell_t] = p
        self._grid, self._cells = bounds, cells
        return True

    def _build_window(self) -> None:
        nd = len(self.global_shape)
        self._dim = max(range(nd), key=lambda d: len({p.box[d][0] for p in self.pieces})) if nd else 0
        self.pieces.sort(key=lambda p: p.box)
        if nd:
            self.pieces.sort(key=lambda p: p.box[self._dim][0])
            self._starts = [p.box[self._dim][0] for p in self.pieces]
            self._maxlen = max((p.box[self._dim][1] - p.box[self._dim][0] for p in self.pieces), default=0)

    def _check_tiling(self) -> None:
        total = numel(self.global_shape)
        if self._grid is not None:
            ncells = numel(len(b) - 1 for b in self._grid)
            if len(self._cells) == ncells:
                return
            for cell in itertools.product(*(range(len(b) - 1) for b in self._grid)):
                if cell not in self._cells:
                    gap = tuple((self._grid[d][k], self._grid[d][k + 1]) for d, k in enumerate(cell))
                    raise CheckpointTilingError(f"stored shards of {self.key!r} leave a gap: box {_fmt_box(gap)} of "
                                                f"global shape {list(self.global_shape)} is in no shard")
            raise AssertionError("unreachable")
        for p in self.pieces:
            for q in self.query(p.box):
                if q is not p:
                    ov = box_intersection(p.box, q.box)
                    raise CheckpointTilingError(f"stored shards of {self.key!r} overlap in box {_fmt_box(ov)} "
                                                f"(files {p.file} and {q.file})")
        if sum(box_volume(p.box) for p in self.pieces) != total:
            gap = _find_gap([p.box for p in self.pieces], make_box((0,) * len(self.global_shape), self.global_shape))
            raise CheckpointTilingError(f"stored shards of {self.key!r} leave a gap: box {_fmt_box(gap)} of "
                                        f"global shape {list(self.global_shape)} is in no shard")

    # -- queries
    def query(self, box: Box) -> list[StoredPiece]:
        """Stored pieces that overlap ``box`` (global coordinates) in a non-empty box."""
        if not box:
            return list(self.pieces)
        if self._grid is not None:
            ranges = cell_ranges(self._grid, box)
            if ranges is None:
                return []
            cells = self._cells
            return [cells[c] for c in itertools.product(*ranges) if c in cells]
        d = self._dim
        lo = bisect.bisect_right(self._starts, box[d][0] - self._maxlen)
        hi = bisect.bisect_left(self._starts, box[d][1])
        return [p for p in self.pieces[lo:hi] if box_intersection(p.box, box) is not None]


def index_of(meta: TensorMeta) -> "KeyIndex | GridIndex":
    """The stored-shard index of one key: arithmetic over its grid rule for grid-recorded tensors (no object per
    shard), else a :class:`KeyIndex` over its listed shards (validated to tile the global box)."""
    if meta.grid is not None and meta._shards is None:
        if isinstance(meta.grid, FlatGrid):
            return FlatIndex(meta.key, meta.global_shape, meta.grid, _piece, flat_range_boxes)
        return GridIndex(meta.key, meta.global_shape, meta.grid, _piece)
    return KeyIndex(meta)


def _find_gap(boxes: list[Box], region: Box) -> Box:
    """A box inside ``region`` covered by none of ``boxes`` (recursive sweep over dim 0; error path only)."""
    if not region:
        return region
    (r0, r1), rest = region[0], region[1:]
    inside = [b for b in boxes if b[0][0] < r1 and b[0][1] > r0]
    cuts = sorted({r0, r1} | {max(r0, min(r1, x)) for b in inside for x in b[0]})
    for a, b in zip(cuts, cuts[1:]):
        slab = [bx[1:] for bx in inside if bx[0][0] <= a and bx[0][1] >= b]
        if not slab:
            return ((a, b),) + rest
        if rest:
            vol = sum(box_volume(tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(s, rest)))
                      for s in slab if box_intersection(s, rest) is not None)
            if vol < box_volume(rest):
                return ((a, b),) + _find_gap(slab, rest)
    return region  # pragma: no cover - only called when a gap exists


def _fmt_box(box: Box | None) -> str:
    if box is None:
        return "[]"
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def source_specs(metadata: CheckpointMetadata) -> dict[str, TensorSpec]:
    """``{key: TensorSpec(global shape, dtype)}`` of every stored tensor (what a mapping program compiles
    against)."""
    return {k: TensorSpec(tuple(t.global_shape), t.dtype) for k, t in metadata.tensors.items()}


# ---------------------------------------------------------------- planning

def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


class Planner:
    """Plans reads for any number of ranks against one checkpoint, sharing the stored-shard index and the
    program's mappings between ranks (what :func:`plan_load` uses).

    Args:
        metadata: the source checkpoint's metadata.
        program: the mapping program (default: :class:`IdentityProgram` over the stored tensors).
    """

    def __init__(self, metadata: CheckpointMetadata, program: MappingProgram | None = None):
        self.metadata = metadata
        self.program = program if program is not None else IdentityProgram(source_specs(metadata))
        self._dest_keys = set(self.program.destination_keys())
        self._index: dict[str, KeyIndex] = {}
        self._mappings: dict[str, list[SliceMapping]] = {}
        self._checked: set[tuple[str, tuple[int, ...], str]] = set()
        self._templates: dict[tuple, list[tuple]] = {}  # grid geometry -> planned items without keys
        self._groups: list[ItemGroup] | None = None  # where plan_rank(compact=True) puts templated items

    def index(self, key: str) -> KeyIndex:
        """The validated index of stored key ``key`` (built on first use)."""
        idx = self._index.get(key)
        if idx is None:
            if key not in self.metadata.tensors:
                raise CheckpointMismatchError(f"the mapping program reads key {key!r}, which the checkpoint does "
                                              "not hold")
            idx = self._index[key] = index_of(self.metadata.tensors[key])
        return idx

    def mappings(self, key: str) -> list[SliceMapping]:
        m = self._mappings.get(key)
        if m is None:
            m = self._mappings[key] = list(self.program.mappings_for(key))
        return m

    def _check_request(self, req: ShardDesc) -> None:
        sig = (req.key, req.global_shape, req.dtype)
        if sig in self._checked:
            return
        spec = self.program.destination_spec(req.key)
        if tuple(spec.shape) != tuple(req.global_shape):
            raise CheckpointMismatchError(
                f"key {req.key!r}: requested global shape {list(req.global_shape)} but the checkpoint gives "
                f"{list(spec.shape)}; to load it into another shape (transpose, split, concat) pass an AOA config "
                "(aoa_config=...)")
        for m in self.mappings(req.key):
            src_dtype = self.metadata.tensors[m.src_key].dtype if m.src_key in self.metadata.tensors else None
            eff = final_dtype(m.dtype) or src_dtype
            if eff is not None and eff != req.dtype:
                raise CheckpointMismatchError(
                    f"key {req.key!r}: stored as {eff} (from {m.src_key!r}) but the target tensor is {req.dtype}; "
                    f"casts happen only on request: add an AOA statement such as "
                    f"\"{m.src_key} -> {req.key}, dtype='{req.dtype}'\"")
        self._checked.add(sig)

    def plan_rank(self, requests: Sequence[ShardDesc], compact: bool = False) -> LoadPlan:
        """Read items for one rank's requested shards. ``compact``: items of grid-recorded keys are returned as
        :data:`ItemGroup` s in ``LoadPlan.groups`` (templates shared between keys) instead of in ``items``.

        Raises:
            CheckpointMismatchError: a requested global shape or dtype differs from what the program gives.
            CheckpointTilingError: the stored shards of a key read from do not tile its global box.
        """
        if not gc.isenabled():  # a load pauses it for its whole run: no context to enter per request
            return self._plan_rank(requests, compact)
        with gc_paused():
            return self._plan_rank(requests, compact)

    def _plan_rank(self, requests: Sequence[ShardDesc], compact: bool = False) -> LoadPlan:
        plan = LoadPlan()
        self._groups = plan.groups if compact else None
        for req in requests:
            if req.key not in self._dest_keys:
                plan.missing_keys.append(req.key)
                continue
            self._check_request(req)
            if req.flattened_range is None:
                targets = [(req.box, 0, req.local_shape)]
            else:
                targets = [(make_box([o + a for o, a in zip(req.global_offset, off)], ext), fs, ext)
                           for off, ext, fs in flat_range_boxes(req.local_shape, *req.flattened_range)]
            for tbox, tflat, tshape in targets:
                if box_volume(tbox) == 0:
                    continue
                torigin = [a for a, _ in tbox]
                for m in self.mappings(req.key):
                    self._plan_mapping(plan.items, req.key, tbox, torigin, tflat, tuple(tshape), m)
        return plan

    def _plan_mapping(self, out: list[ReadItem], key: str, tbox: Box, torigin: list[int], tflat: int,
                      tshape: tuple[int, ...], m: SliceMapping) -> None:
        inter = box_intersection(m.dst_box, tbox)
        if inter is None:
            return
        if m.permute is None and m.dst_box == m.src_box:  # common case (identity): no coordinate change
            idx = self.index(m.src_key)
            if idx._grid is not None:
                self._plan_grid(out, key, inter, torigin, tflat, tshape, m, idx)
                return
        nd = len(inter)
        perm = m.permute if m.permute is not None else tuple(range(len(m.src_box)))
        if len(m.src_box) != nd or any(m.dst_box[i][1] - m.dst_box[i][0] != m.src_box[perm[i]][1] - m.src_box[perm[i]][0]
                                       for i in range(nd) if i < len(perm) and 0 <= perm[i] < len(m.src_box)):
            self._plan_reshaped(out, key, inter, torigin, tflat, tshape, m, perm)
            return
        if len(perm) != nd or len(m.src_box) != nd:
            raise CheckpointError(f"mapping for {key!r} from {m.src_key!r}: permute {m.permute} does not fit "
                                  f"boxes of rank {nd} and {len(m.src_box)}")
        inv = _inverse(perm)
        # source sub-box feeding `inter`: destination dim i comes from source dim perm[i]
        sub = tuple((m.src_box[j][0] + inter[inv[j]][0] - m.dst_box[inv[j]][0],
                     m.src_box[j][0] + inter[inv[j]][1] - m.dst_box[inv[j]][0]) for j in range(nd))
        permute = m.permute if m.permute is not None and tuple(m.permute) != tuple(range(nd)) else None
        shift = [m.dst_box[i][0] - m.src_box[perm[i]][0] for i in range(nd)]  # src coordinate -> dst coordinate
        same_frame = permute is None and not any(shift)
        idx = self.index(m.src_key)
        if same_frame and idx._grid is not None:
            self._plan_grid(out, key, sub, torigin, tflat, tshape, m, idx)
            return
        for piece in idx.query(sub):
            ov = box_intersection(piece.box, sub)
            if ov is None:
                continue
            if same_frame:
                dst = tuple((a - o, b - o) for (a, b), o in zip(ov, torigin))
            else:
                dst = tuple((ov[perm[i]][0] + shift[i] - torigin[i], ov[perm[i]][1] + shift[i] - torigin[i])
                            for i in range(nd))
            out.append(ReadItem(key, tflat, tshape, dst, m.src_key, piece.file, piece.name, piece.flat_start,
                                piece.shape, tuple((a - o, b - o) for (a, b), o in zip(ov, piece.origin)),
                                permute, m.dtype))


    def _plan_reshaped(self, out: list[ReadItem], key: str, inter: Box, torigin: list[int], tflat: int,
                       tshape: tuple[int, ...], m: SliceMapping, perm: tuple[int, ...]) -> None:
        """A mapping whose boxes differ by unit axes (an AOA ``reshape=``): the non-unit axes of the destination
        box correspond, in order, to the non-unit axes of the permuted source box (equal extents); a unit axis
        on either side is fixed."""
        def ext(b: tuple[int, int]) -> int:
            return b[1] - b[0]

        if sorted(perm) != list(range(len(m.src_box))):
            raise CheckpointError(f"mapping for {key!r} from {m.src_key!r}: permute {m.permute} is not a "
                                  f"permutation of the {len(m.src_box)} source axes")
        src_axes = [j for j in perm if ext(m.src_box[j]) != 1]
        dst_axes = [i for i in range(len(m.dst_box)) if ext(m.dst_box[i]) != 1]
        if [ext(m.src_box[j]) for j in src_axes] != [ext(m.dst_box[i]) for i in dst_axes]:
            raise CheckpointError(f"mapping for {key!r} from {m.src_key!r}: destination box {_fmt_box(m.dst_box)} "
                                  f"is not source box {_fmt_box(m.src_box)} (permuted by {m.permute}) up to unit "
                                  "axes")
        pairs = list(zip(dst_axes, src_axes))
        sub = list(m.src_box)
        for i, j in pairs:
            a = m.src_box[j][0] - m.dst_box[i][0]
            sub[j] = (inter[i][0] + a, inter[i][1] + a)
        base = [(a - o, b - o) for (a, b), o in zip(inter, torigin)]
        permute = m.permute if m.permute is not None and tuple(m.permute) != tuple(range(len(perm))) else None
        for piece in self.index(m.src_key).query(tuple(sub)):
            ov = box_intersection(piece.box, tuple(sub))
            if ov is None:
                continue
            dst = list(base)
            for i, j in pairs:
                a = m.dst_box[i][0] - m.src_box[j][0] - torigin[i]
                dst[i] = (ov[j][0] + a, ov[j][1] + a)
            out.append(ReadItem(key, tflat, tshape, tuple(dst), m.src_key, piece.file, piece.name, piece.flat_start,
                                piece.shape, tuple((a - o, b - o) for (a, b), o in zip(ov, piece.origin)),
                                permute, m.dtype))

    def _plan_grid(self, out: list[ReadItem], key: str, sub: Box, torigin: list[int], tflat: int,
                   tshape: tuple[int, ...], m: SliceMapping, idx: KeyIndex) -> None:
        """Fast path (no permutation, same coordinates, grid-indexed source): the overlap of ``sub`` with each
        grid cell is computed per dimension once and combined, instead of per cell and dimension. For grid-recorded
        keys the result depends only on the geometry (global shape, grid rule, boxes), which the layers of a model
        share: it is computed once per geometry and re-labelled per key."""
        src_key, dtype = m.src_key, m.dtype
        if isinstance(idx, GridIndex):
            sig = (idx.global_shape, idx.grid, sub, tuple(torigin))
            tmpl = self._templates.get(sig)
            if tmpl is None:
                tmpl = self._templates[sig] = []
                self._grid_items(tmpl, sub, torigin, idx)
            # a template of a few thousand cells is re-labelled for every key of its geometry
            label = (key, tflat, tshape, src_key, dtype)
            if self._groups is not None:
                self._groups.append((label, tmpl))
            else:
                out.extend(expand_group(label, tmpl))
            return
        found: list[tuple] = []
        self._grid_items(found, sub, torigin, idx)
        out.extend([ReadItem(key, tflat, tshape, f[0], src_key, f[1], f[5], f[2], f[3], f[4], None, dtype)
                    for f in found])

    @staticmethod
    def _grid_items(out: list[tuple], sub: Box, torigin: list[int], idx: "KeyIndex | GridIndex") -> None:
        """``(dst box, file, flat start, stored shape, src box, name)`` of the grid cells overlapping ``sub``."""
        per_dim = []
        for d, (a, b) in enumerate(sub):
            bd = idx._grid[d]
            o = torigin[d]
            lo = bisect.bisect_right(bd, a) - 1
            hi = bisect.bisect_left(bd, b)
            col = []
            for k in range(max(lo, 0), hi):
                x0, x1 = max(a, bd[k]), min(b, bd[k + 1])
                if x1 > x0:
                    col.append((k, (x0 - bd[k], x1 - bd[k]), (x0 - o, x1 - o)))
            if not col:
                return
            per_dim.append(col)
        cells = idx._cells
        for combo in itertools.product(*per_dim):
            piece = cells.get(tuple(c[0] for c in combo))
            if piece is None:
                continue
            out.append((tuple(c[2] for c in combo), piece.file, piece.flat_start, piece.shape,
                        tuple(c[1] for c in combo), piece.name))


def plan_load(metadata: CheckpointMetadata, requests: Mapping[int, Sequence[ShardDesc]] | Sequence[ShardDesc],
              program: MappingProgram | None = None) -> dict[int, LoadPlan] | LoadPlan:
    """Plan a load: for each rank, which slices of which stored arrays to read and where each lands.

    Args:
        metadata: the checkpoint's metadata (any source format).
        requests: one rank's requested shards, or ``{rank: requested shards}`` for several ranks.
        program: mapping program; default :class:`IdentityProgram` (same keys, same global shapes).

    Returns:
        A :class:`LoadPlan` (or ``{rank: LoadPlan}``). Every element of every requested box whose key the
        program produces is written by exactly one read item when the stored shards tile their keys.

    Raises:
        CheckpointMismatchError, CheckpointTilingError: see :meth:`Planner.plan_rank`.
    """
    planner = Planner(metadata, program)
    if isinstance(requests, Mapping):
        return {r: planner.plan_rank(reqs) for r, reqs in requests.items()}
    return planner.plan_rank(requests)
