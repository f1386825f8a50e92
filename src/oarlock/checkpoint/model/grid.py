"""Grid layouts: the shards of a tensor saved on a regular layout, recorded once instead of one record per shard.

A tensor saved from a DTensor (any mesh; ``Shard``/``Replicate`` placements, uneven extents, several mesh dims on
one tensor dim), from tensor-parallel ``torch.chunk`` pieces, or from whole replicated copies, has shards that
follow a rule: per tensor dimension, nested ``torch.chunk`` splits (outermost first, DTensor's ``Shard`` rule:
piece size ``ceil(L / n)``, trailing pieces may be empty), and a writer rank per cell that is an affine function
of the cell's digits plus, when the box has copies on several ranks, a replica chosen by rotation. Such a
tensor costs one small record in ``metadata.json`` whatever the number of ranks (``docs/checkpoint-format.md``,
"Grid records"), and the planner intersects boxes with it arithmetically (:class:`GridIndex`), never building
one object per shard.

Terms. A *level* is one nested split ``(dim, count)``; levels are ordered dims-major, then outermost first. A
cell's *digits* are its index at each level; its *cell index along a dim* is the row-major index of that dim's
digits; its *cell index* ``c`` is row-major over the dims. The writer of cell ``c`` is::

    base + sum(digit_i * strides[i])  +  replica_offset((c + rotate) mod R)

where ``replica_offset(j)`` takes the row-major digits of ``j`` over the replica counts
``replicas = ((R_0, stride_0), ...)`` (``R`` their product). The rotation spreads the writes of replicated boxes
over their holders (different tensors and cells pick different replicas) while every rank decides locally,
from its own placements, whether it is the writer.

Flattened shards have their own rule (:mod:`oarlock.checkpoint.model.flatgrid`), packed data files their layout
(:mod:`oarlock.checkpoint.model.packed`), and file names and record bounds live in
:mod:`oarlock.checkpoint.model.names`; their names are importable from here too.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import zlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from oarlock.checkpoint.errors import CheckpointFormatError
from oarlock.checkpoint.model.flatgrid import FlatGrid, FlatIndex, compress_flat
from oarlock.checkpoint.model.names import MAX_CELLS_PER_DIM, MAX_RANK, PACKED_ENTRY, data_file_name, rank_of_file
from oarlock.checkpoint.model.packed import PackedEntries, PackedLayout

__all__ = ["FlatGrid", "FlatIndex", "GridIndex", "GridLayout", "MAX_CELLS_PER_DIM", "MAX_RANK", "PACKED_ENTRY",
           "PackedEntries", "PackedLayout", "cell_ranges", "compress_flat", "compress_shards", "data_file_name",
           "dim_bounds", "rank_of_file"]


@functools.lru_cache(maxsize=8192)
def dim_bounds(length: int, counts: tuple[int, ...]) -> tuple[int, ...]:
    """Cut points of one tensor dimension of ``length`` split by nested ``torch.chunk`` counts ``counts``
    (outermost first): a non-decreasing tuple of ``prod(counts) + 1`` positions; cell ``e`` along the dimension
    is ``[bounds[e], bounds[e + 1])`` (empty for trailing pieces of uneven splits). Cached: layers of one model
    share their shapes, so a checkpoint has few distinct ``(length, counts)``."""
    pieces = [(0, int(length))]
    for n in counts:
        nxt = []
        for a, b in pieces:
            size = b - a
            q = -(-size // n) if size else 0
            for i in range(n):
                lo = min(a + i * q, b)
                nxt.append((lo, min(lo + q, b)))
        pieces = nxt
    return tuple([p[0] for p in pieces] + [int(length)])


@dataclass(frozen=True)
class GridLayout:
    """The stored shards of one tensor as a grid rule (see the module docstring).

    Attributes:
        chunks: per tensor dimension, the nested ``torch.chunk`` counts (outermost first; ``()``: not split).
        base: writer rank of the cell whose digits are all 0 (before the replica offset).
        strides: writer-rank stride of each level (dims-major, then nesting order).
        replicas: ``((count, stride), ...)`` of the mesh dimensions holding copies of every box.
        rotate: replica rotation (cell ``c`` is written by replica ``(c + rotate) mod R``).
    """

    chunks: tuple[tuple[int, ...], ...]
    base: int = 0
    strides: tuple[int, ...] = ()
    replicas: tuple[tuple[int, int], ...] = ()
    rotate: int = 0

    # ------------------------------------------------------------ construction

    @classmethod
    def from_placements(cls, global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Any], *,
                        mesh_base: int = 0, mesh_strides: Sequence[int] | None = None, key: str = ""
                        ) -> "GridLayout | None":
        """The grid of a DTensor with ``placements`` over a mesh of ``mesh_shape`` whose rank at mesh coordinate
        ``m`` is ``mesh_base + sum(m_k * mesh_strides[k])`` (default strides: row-major, as
        ``init_device_mesh`` builds them). ``placements``: per mesh dim ``("S", dim)`` / ``("R",)`` or torch's
        ``Shard(dim)`` / ``Replicate()``. ``key`` seeds the replica rotation (CRC-32 of the key), so that
        replicated tensors spread over their holders.

        Returns None when the layout is not a grid of this kind (``Partial``, ``_StridedShard`` or another
        placement type), so the caller lists the shards instead.
        """
        mesh_shape = tuple(int(n) for n in mesh_shape)
        if mesh_strides is None:
            mesh_strides = [math.prod(mesh_shape[k + 1:]) for k in range(len(mesh_shape))]
        nd = len(global_shape)
        per_dim: list[list[int]] = [[] for _ in range(nd)]  # mesh dims sharding each tensor dim, in mesh order
        reps = []
        for k, p in enumerate(placements):
            kind = _placement_kind(p)
            if kind is None:
                return None
            if kind == "R":
                if mesh_shape[k] > 1:
                    reps.append((mesh_shape[k], int(mesh_strides[k])))
                continue
            d = kind[1]
            if not -nd <= d < nd:
                return None
            per_dim[d % nd].append(k)
        chunks = tuple(tuple(mesh_shape[k] for k in ks) for ks in per_dim)
        strides = tuple(int(mesh_strides[k]) for ks in per_dim for k in ks)
        total = math.prod(r for r, _ in reps)
        rotate = zlib.crc32(key.encode()) % total if total > 1 else 0
        return cls(chunks, int(mesh_base), strides, tuple(reps), rotate)

    # ------------------------------------------------------------ geometry

    @property
    def levels(self) -> list[tuple[int, int]]:
        """``(dim, count)`` of every nested split, dims-major."""
        return [(d, n) for d, cs in enumerate(self.chunks) for n in cs]

    def cells_per_dim(self) -> tuple[int, ...]:
        return tuple(math.prod(cs) for cs in self.chunks)

    @property
    def ncells(self) -> int:
        return math.prod(self.cells_per_dim())

    @property
    def nreplicas(self) -> int:
        return math.prod(r for r, _ in self.replicas) if self.replicas else 1

    def bounds(self, global_shape: Sequence[int]) -> list[tuple[int, ...]]:
        """Per dim, the cut points (:func:`dim_bounds`)."""
        return [dim_bounds(int(n), tuple(cs)) for n, cs in zip(global_shape, self.chunks)]

    def cell_index(self, cell: Sequence[int]) -> int:
        """Row-major cell index of per-dim cell indices ``cell``."""
        c = 0
        for e, n in zip(cell, self.cells_per_dim()):
            c = c * n + int(e)
        return c

    def same_rule(self, other: Any) -> bool:
        """Equal cuts, strides and replicas, whatever the first writer (one mesh's layout on disjoint sub-meshes)."""
        return isinstance(other, GridLayout) and (self.chunks, self.strides, self.replicas) == \
            (other.chunks, other.strides, other.replicas)

    def writer(self, cell: Sequence[int]) -> int:
        """Writer rank of the cell with per-dim indices ``cell``."""
        r = self.base
        i = 0
        for d, cs in enumerate(self.chunks):
            e = int(cell[d])
            digits = []
            for n in reversed(cs):
                digits.append(e % n)
                e //= n
            for dig in reversed(digits):
                r += dig * self.strides[i]
                i += 1
        if self.replicas:
            r += self._replica_offset((self.cell_index(cell) + self.rotate) % self.nreplicas)
        return r

    def holders(self, cell: Sequence[int]) -> list[int]:
        """Every rank holding a copy of the cell's box (the writer among them)."""
        r0 = self.writer(cell)
        j0 = (self.cell_index(cell) + self.rotate) % self.nreplicas
        base = r0 - self._replica_offset(j0)
        return [base + self._replica_offset(j) for j in range(self.nreplicas)]

    def _replica_offset(self, j: int) -> int:
        off = 0
        for n, s in reversed(self.replicas):
            off += (j % n) * s
            j //= n
        return off

    def cells(self, global_shape: Sequence[int]) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """``(cell, offset, local shape)`` of every non-empty cell, in cell-index order (for small grids and
        compatibility views; the planner never calls it)."""
        bounds = self.bounds(global_shape)
        for cell in itertools.product(*(range(len(b) - 1) for b in bounds)):
            off = tuple(b[e] for b, e in zip(bounds, cell))
            shape = tuple(b[e + 1] - b[e] for b, e in zip(bounds, cell))
            if all(shape) or not shape:
                yield cell, off, shape

    def cell_of(self, global_shape: Sequence[int], offset: Sequence[int]) -> tuple[int, ...] | None:
        """The cell whose box starts at ``offset`` (non-empty cells only), or None."""
        out = []
        for b, o in zip(self.bounds(global_shape), offset):
            e = bisect.bisect_right(b, int(o)) - 1
            if e < 0 or e >= len(b) - 1 or b[e] != o or b[e + 1] == b[e]:
                return None
            out.append(e)
        return tuple(out)

    def files(self, global_shape: Sequence[int]) -> set[str]:
        """Data files holding a non-empty cell."""
        return {data_file_name(self.writer(cell)) for cell, _, _ in self.cells(global_shape)}

    # ------------------------------------------------------------ JSON

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"chunks": [list(c) for c in self.chunks],
                             "writers": {"base": self.base, "strides": list(self.strides)}}
        if self.replicas:
            d["writers"]["replicas"] = [list(r) for r in self.replicas]
            d["writers"]["rotate"] = self.rotate
        return d

    @classmethod
    def from_json(cls, d: Any, ndim: int, source: str) -> "GridLayout":
        """Parse and bound-check a ``grid`` record (hostile input: every count, stride and rank is checked).

        Raises:
            CheckpointFormatError: naming ``source`` (the file and key) and the field at fault.
        """
        def bad(why: str) -> CheckpointFormatError:
            return CheckpointFormatError(f"{source}: malformed grid record: {why}")

        if not isinstance(d, dict) or not isinstance(d.get("chunks"), list) or not isinstance(d.get("writers"), dict):
            raise bad("needs \"chunks\" (a list per dim) and \"writers\" (an object)")
        if len(d["chunks"]) != ndim:
            raise bad(f"\"chunks\" has {len(d['chunks'])} entries for a {ndim}-D tensor")
        chunks = []
        for cs in d["chunks"]:
            if not isinstance(cs, list) or not all(type(n) is int and n >= 1 for n in cs):
                raise bad(f"chunk counts {cs!r} must be a list of positive integers")
            if math.prod(cs) > MAX_CELLS_PER_DIM:
                raise bad(f"chunk counts {cs!r} give more than {MAX_CELLS_PER_DIM} cells in one dimension")
            chunks.append(tuple(cs))
        w = d["writers"]
        nlev = sum(len(c) for c in chunks)
        base, strides = w.get("base"), w.get("strides")
        reps, rot = w.get("replicas", []), w.get("rotate", 0)
        if type(base) is not int or not 0 <= base < MAX_RANK:
            raise bad(f"writers.base {base!r} must be a rank")
        if not isinstance(strides, list) or len(strides) != nlev or not all(type(s) is int for s in strides):
            raise bad(f"writers.strides {strides!r} must be {nlev} integers (one per chunk level)")
        if not isinstance(reps, list) or not all(isinstance(r, list) and len(r) == 2 and type(r[0]) is int
                                                 and r[0] >= 1 and type(r[1]) is int for r in reps):
            raise bad(f"writers.replicas {reps!r} must be [[count, stride], ...]")
        if type(rot) is not int or rot < 0:
            raise bad(f"writers.rotate {rot!r} must be a non-negative integer")
        g = cls(tuple(chunks), base, tuple(strides), tuple((r[0], r[1]) for r in reps), rot)
        # every writer and holder must be a rank: the extremes of an affine map are at the corners
        lo = hi = base
        for (dim, n), s in zip(g.levels, g.strides):
            lo, hi = lo + min(0, (n - 1) * s), hi + max(0, (n - 1) * s)
        for n, s in g.replicas:
            lo, hi = lo + min(0, (n - 1) * s), hi + max(0, (n - 1) * s)
        if lo < 0 or hi >= MAX_RANK:
            raise bad(f"writer ranks range over [{lo}, {hi}], outside [0, {MAX_RANK})")
        return g


def _placement_kind(p: Any) -> tuple | str | None:
    """``"R"``, ``("S", dim)`` or None (anything else) for a placement given as a tuple or a torch object."""
    if isinstance(p, (tuple, list)):
        if len(p) == 1 and p[0] == "R":
            return "R"
        if len(p) == 2 and p[0] == "S" and type(p[1]) is int:
            return ("S", p[1])
        return None
    try:
        from torch.distributed.tensor import Replicate, Shard
    except ImportError:  # pragma: no cover
        return None
    if type(p) is Replicate:
        return "R"
    if type(p) is Shard:  # exactly Shard: _StridedShard (FSDP2 over TP) orders its pieces differently
        return ("S", int(p.dim))
    return None


def compress_shards(global_shape: Sequence[int], shards: Sequence[Any], key: str) -> GridLayout | None:
    """The grid equal to a listed shard set, or None. ``shards``: :class:`~oarlock.checkpoint.model.metadata.ShardMeta`
    s. Recognised: regular (not flattened), primary shards named by the key in ``rank-XXXXX.safetensors`` files,
    whose boxes are the non-empty cells of one-level ``torch.chunk`` splits per dim (the layouts of TP conversions,
    FSDP/DTensor ``Shard`` saves read back, DCP's regular chunk lists) with an affine writer per cell. The result
    is checked to reproduce every shard exactly."""
    nd = len(global_shape)
    if not shards:
        return None
    writers: dict[tuple[int, ...], int] = {}
    starts: list[set[int]] = [set() for _ in range(nd)]
    for s in shards:
        if s.flattened_range is not None or s.replica_id or s.name != key:
            return None
        r = rank_of_file(s.file)
        if r is None:
            return None
        for d in range(nd):
            starts[d].add(s.global_offset[d])
    # one-level split per dim: the count is the number of distinct starts, unless uneven chunks left empty cells
    counts = []
    for d in range(nd):
        L = int(global_shape[d])
        n = len(starts[d])
        found = None
        for cand in ([n] if n <= 1 else range(n, min(L, 4 * n) + 1)):
            b = dim_bounds(L, (cand,) if cand > 1 else ())
            if {x for x, y in zip(b, b[1:]) if y > x} == starts[d]:
                found = cand
                break
        if found is None:
            return None
        counts.append(found)
    chunks = tuple((n,) if n > 1 else () for n in counts)
    probe = GridLayout(chunks)
    bounds = probe.bounds(global_shape)
    for s in shards:
        cell = probe.cell_of(global_shape, s.global_offset) if nd else ()
        if cell is None or tuple(bounds[d][cell[d] + 1] - bounds[d][cell[d]] for d in range(nd)) != tuple(s.local_shape):
            return None
        if cell in writers:
            return None
        writers[cell] = rank_of_file(s.file)
    ncells = sum(1 for _ in probe.cells(global_shape))
    if len(writers) != ncells:
        return None  # a gap: leave it to the tiling check of the listed form
    # affine writers: base at the first cell, one stride per split dim
    first = min(writers)
    base = writers[first]
    strides = []
    for d in range(nd):
        if not chunks[d]:
            continue
        nxt = list(first)
        nxt[d] += 1
        nxt_t = tuple(nxt)
        strides.append(writers[nxt_t] - base if nxt_t in writers else 0)
    # the first cell need not be all zeros only when trailing cells are empty; digits start at 0 by construction
    base -= sum(e * s for e, s in zip((first[d] for d in range(nd) if chunks[d]), strides))
    g = GridLayout(chunks, base, tuple(strides))
    if base < 0 or any(g.writer(c) != w for c, w in writers.items()):
        return None
    return g


def cell_ranges(bounds: Sequence[Sequence[int]], box: Any) -> list[range] | None:
    """Per dim, the range of cell indices whose cut-point interval ``[bounds[d][e], bounds[d][e + 1])`` meets
    ``box``'s extent; None when some dim meets none."""
    ranges = []
    for bd, (a, b) in zip(bounds, box):
        lo = bisect.bisect_right(bd, a) - 1
        hi = bisect.bisect_left(bd, b)
        if hi <= lo:
            return None
        ranges.append(range(max(lo, 0), hi))
    return ranges


class GridIndex:
    """Stored pieces of a grid-recorded key, for the planner: the interface of
    :class:`oarlock.checkpoint.planning.load.KeyIndex` (``_grid`` cut points per dim, ``_cells.get(cell)``, ``query``)
    computed arithmetically; nothing is built per shard. Tiling holds by construction."""

    def __init__(self, key: str, global_shape: Sequence[int], grid: GridLayout, piece_factory: Any):
        self.key = key
        self.global_shape = tuple(int(n) for n in global_shape)
        self.grid = grid
        self._grid = grid.bounds(self.global_shape)
        self._cells = _CellMap(self, piece_factory)

    @property
    def pieces(self) -> list[Any]:
        """Every stored piece (materialised: only for small grids and checks)."""
        return [self._cells.get(c) for c, _, _ in self.grid.cells(self.global_shape)]

    def query(self, box: Any) -> list[Any]:
        """Stored pieces overlapping ``box`` (global coordinates) in a non-empty box."""
        if not box:
            return [p for p in (self._cells.get(()),) if p is not None]
        ranges = cell_ranges(self._grid, box)
        if ranges is None:
            return []
        out = []
        for c in itertools.product(*ranges):
            p = self._cells.get(c)
            if p is not None and all(min(b, y) > max(a, x) for (a, b), (x, y) in zip(p.box, box)):
                out.append(p)
        return out


class _CellMap:
    """``cell -> stored piece`` computed on demand (None for empty cells)."""

    def __init__(self, index: GridIndex, factory: Any):
        self.index = index
        self.factory = factory

    def get(self, cell: tuple[int, ...]) -> Any:
        bounds = self.index._grid
        box = tuple((b[e], b[e + 1]) for b, e in zip(bounds, cell))
        if any(y <= x for x, y in box):
            return None
        return self.factory(box, data_file_name(self.index.grid.writer(cell)), self.index.key)
