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

#: Largest number of cells one grid record may describe (hostile-input bound: a record is expanded lazily, but
#: a single dimension's cut points are materialised and cached).
MAX_CELLS_PER_DIM = 1 << 20
MAX_RANK = 1 << 24


def data_file_name(rank: int) -> str:
    """The data file rank ``rank`` writes: ``rank-XXXXX.safetensors``."""
    return f"rank-{rank:05d}.safetensors"


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
    """The grid equal to a listed shard set, or None. ``shards``: :class:`~oarlock.checkpoint.metadata.ShardMeta`
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


def rank_of_file(name: str) -> int | None:
    """The rank whose data file is ``name`` (:func:`data_file_name`), or None for any other name."""
    if name.startswith("rank-") and name.endswith(".safetensors"):
        digits = name[5:-12]
        if digits.isdigit() and len(digits) >= 5 and (len(digits) == 5 or digits[0] != "0"):
            if data_file_name(int(digits)) == name:
                return int(digits)
    return None


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
    :class:`oarlock.checkpoint.plan.KeyIndex` (``_grid`` cut points per dim, ``_cells.get(cell)``, ``query``)
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


@dataclass(frozen=True)
class FlatGrid:
    """The flattened shards of one tensor cut from an even split of a flat buffer (ZeRO-1/2 partitions, FSDP1
    flat parameters): shard ``i`` holds elements ``[cut(i - 1), cut(i))`` of the tensor's row-major flattening,
    with ``cut(-1) = 0``, ``cut(i) = first + i * step`` and the last shard ending at the tensor's numel; it is
    written by rank ``base + i * stride`` under the key's name (``docs/checkpoint-format.md``, "Grid records").

    Attributes:
        first: end of shard 0 (elements), ``1 <= first <= numel``.
        step: length of every shard but the first and last (the buffer's partition size).
        base, stride: writer rank of shard 0, and the rank step between consecutive shards.
    """

    first: int
    step: int
    base: int = 0
    stride: int = 1

    def count(self, n: int) -> int:
        """Number of shards of a tensor of ``n`` elements."""
        return 1 + (-(-(n - self.first) // self.step) if n > self.first else 0)

    def shard(self, n: int, i: int) -> tuple[int, int]:
        """Element range ``[a, b)`` of shard ``i``."""
        a = 0 if i == 0 else self.first + (i - 1) * self.step
        return a, min(n, self.first + i * self.step)

    def shard_of(self, n: int, e: int) -> int:
        """Index of the shard holding element ``e``."""
        return 0 if e < self.first else 1 + (e - self.first) // self.step

    def writer(self, i: int) -> int:
        return self.base + i * self.stride

    def files(self, global_shape: Sequence[int]) -> set[str]:
        n = math.prod(global_shape)
        return {data_file_name(self.writer(i)) for i in range(self.count(n))} if n else set()

    @classmethod
    def of_partition(cls, n: int, buffer_offset: int, partition_size: int, base: int = 0, stride: int = 1
                     ) -> tuple["FlatGrid", int]:
        """The rule of an ``n``-element tensor (``n >= 1``) whose flattening starts at element ``buffer_offset``
        of a flat buffer cut into partitions of ``partition_size`` elements, partition ``j`` written by rank
        ``base + j * stride``; and the partition holding the tensor's shard 0 (shard ``i`` is partition
        ``that + i``)."""
        j0 = buffer_offset // partition_size
        first = min(n, (j0 + 1) * partition_size - buffer_offset)
        return cls(first, partition_size, base + j0 * stride, stride), j0

    def same_rule(self, other: Any) -> bool:
        """Equal cuts and rank step, whatever the first writer (copies of one flat buffer in several groups)."""
        return isinstance(other, FlatGrid) and (self.first, self.step, self.stride) == \
            (other.first, other.step, other.stride)

    def to_json(self) -> dict[str, Any]:
        return {"first": self.first, "step": self.step, "base": self.base, "stride": self.stride}

    @classmethod
    def from_json(cls, d: Any, global_shape: Sequence[int], source: str) -> "FlatGrid":
        """Parse and bound-check a ``flat`` record.

        Raises:
            CheckpointFormatError: naming ``source`` and the field at fault.
        """
        n = math.prod(global_shape)
        vals = {k: d.get(k) for k in ("first", "step", "base", "stride")} if isinstance(d, dict) else {}
        if not vals or not all(type(v) is int for v in vals.values()):
            raise CheckpointFormatError(f"{source}: malformed flat record {d!r}: needs integer first, step, base, "
                                        "stride")
        g = cls(**vals)
        if not (1 <= g.first <= n and g.step >= 1 and 0 <= g.base < MAX_RANK):
            raise CheckpointFormatError(f"{source}: malformed flat record {d!r} for {n} elements")
        k = g.count(n)
        if k > MAX_CELLS_PER_DIM or not 0 <= g.writer(k - 1) < MAX_RANK or (k > 1 and g.stride == 0):
            raise CheckpointFormatError(f"{source}: malformed flat record {d!r}: {k} shards, writers "
                                        f"{g.base}..{g.writer(k - 1)}")
        return g


def compress_flat(global_shape: Sequence[int], shards: Sequence[Any], key: str) -> FlatGrid | None:
    """The :class:`FlatGrid` equal to listed flattened shards (whole-tensor boxes, the key's name, consecutive
    ranges of equal interior length, affine writers), or None."""
    n = math.prod(global_shape)
    if not shards or n == 0:
        return None
    rs = []
    for s in shards:
        if s.flattened_range is None or s.replica_id or s.name != key or any(s.global_offset) \
                or tuple(s.local_shape) != tuple(global_shape):
            return None
        r = rank_of_file(s.file)
        if r is None:
            return None
        rs.append((s.flattened_range[0], s.flattened_range[1], r))
    rs.sort()
    if rs[0][0] != 0 or rs[-1][1] != n or any(a[1] != b[0] for a, b in zip(rs, rs[1:])):
        return None
    if any(b <= a for a, b, _ in rs):
        return None
    first = rs[0][1]
    step = max([b - a for a, b, _ in rs[1:]] or [n])
    stride = rs[1][2] - rs[0][2] if len(rs) > 1 else 1
    g = FlatGrid(first, step, rs[0][2], stride)
    if g.count(n) != len(rs) or any(g.shard(n, i) != (a, b) or g.writer(i) != r for i, (a, b, r) in enumerate(rs)):
        return None
    return g


class FlatIndex:
    """Stored pieces of a key recorded by a :class:`FlatGrid`, for the planner (``query`` only): the shards a box's
    flat span touches are found arithmetically and cut into regular pieces (``flat_range_boxes``) on demand."""

    def __init__(self, key: str, global_shape: Sequence[int], grid: FlatGrid, piece_factory: Any, cut: Any):
        self.key = key
        self.global_shape = tuple(int(n) for n in global_shape)
        self.grid = grid
        self._grid = None  # not a product grid: the planner uses query()
        self._factory = piece_factory
        self._cut = cut  # oarlock.checkpoint.sharded.flat_range_boxes
        self._n = math.prod(self.global_shape)
        self._cache: dict[int, list[Any]] = {}

    def _pieces(self, i: int) -> list[Any]:
        p = self._cache.get(i)
        if p is None:
            a, b = self.grid.shard(self._n, i)
            file = data_file_name(self.grid.writer(i))
            p = self._cache[i] = [self._factory(tuple((o, o + e) for o, e in zip(off, ext)), file, self.key, fs)
                                  for off, ext, fs in self._cut(self.global_shape, a, b) if math.prod(ext)]
        return p

    @property
    def pieces(self) -> list[Any]:
        return [p for i in range(self.grid.count(self._n)) for p in self._pieces(i)]

    def query(self, box: Any) -> list[Any]:
        if not self._n:
            return []
        if not box:
            return self._pieces(0)
        nd = len(box)
        strides = [1] * nd
        for d in range(nd - 2, -1, -1):
            strides[d] = strides[d + 1] * self.global_shape[d + 1]
        if any(b <= a for a, b in box):
            return []
        lo = sum(a * s for (a, _), s in zip(box, strides))
        hi = sum((b - 1) * s for (_, b), s in zip(box, strides))
        out = []
        for i in range(self.grid.shard_of(self._n, lo), self.grid.shard_of(self._n, hi) + 1):
            for p in self._pieces(i):
                if all(min(b, y) > max(a, x) for (a, b), (x, y) in zip(p.box, box)):
                    out.append(p)
        return out


# ---------------------------------------------------------------- packed data files

#: Name of the one safetensors entry of a packed data file (``docs/checkpoint-format.md``, "Packed data files"):
#: a ``U8`` array holding, back to back, the piece of every grid- or flat-recorded tensor this file's rank writes.
PACKED_ENTRY = "oarlock.packed"


@functools.lru_cache(maxsize=4096)
def _pieces_of_rank(global_shape: tuple[int, ...], grid: Any) -> dict[int, tuple[int, ...]]:
    """rank -> shape of the piece it writes of a tensor recorded by ``grid`` (a :class:`GridLayout`: the cell's
    shape; a :class:`FlatGrid`: ``(elements,)``). Empty cells write nothing.

    Raises:
        CheckpointFormatError: the rule gives one rank two pieces (a packed file holds at most one per key).
    """
    out: dict[int, tuple[int, ...]] = {}
    if isinstance(grid, FlatGrid):
        n = math.prod(global_shape)
        pieces = ((grid.writer(i), (b - a,)) for i in range(grid.count(n) if n else 0)
                  for a, b in (grid.shard(n, i),))
    else:
        pieces = ((grid.writer(cell), shape) for cell, _, shape in grid.cells(global_shape))
    for r, shape in pieces:
        if r in out:
            raise CheckpointFormatError(f"grid record {grid!r} of shape {list(global_shape)} gives rank {r} two "
                                        "pieces; a packed data file holds one per key")
        out[r] = tuple(shape)
    return out


class PackedLayout:
    """Where each grid- or flat-recorded tensor's piece lies inside the :data:`PACKED_ENTRY` of a data file, from
    the metadata alone: the pieces a rank writes, ordered by key (code-point order), back to back, leaving out the
    keys the file holds as named entries (listed shards whose record was compacted into a grid). Built once per
    checkpoint (keys sorted, tensors grouped by geometry); a file's offsets are one cumulative sum over the keys.

    ``tensors``: ``(key, global_shape, dtype name, grid)`` of every grid/flat-recorded tensor.
    """

    def __init__(self, tensors: Sequence[tuple[str, Sequence[int], str, Any]]):
        from oarlock.utils import dtype_itemsize

        rows = sorted((k, tuple(int(x) for x in s), d, g) for k, s, d, g in tensors)
        self.keys = [r[0] for r in rows]
        self.pos = {k: i for i, k in enumerate(self.keys)}
        self.dtypes = [r[2] for r in rows]
        geoms: dict[tuple, int] = {}
        self.gid = [geoms.setdefault((s, g, dtype_itemsize(d)), len(geoms)) for _, s, d, g in rows]
        self.geoms = list(geoms)

    def entries(self, rank: int, region_begin: int, region_bytes: int, source: str, named: dict | None = None
                ) -> "PackedEntries":
        """The pieces in rank ``rank``'s packed entry, which starts ``region_begin`` bytes into the data section
        and holds ``region_bytes`` bytes (with the file's ``named`` entries in front).

        Raises:
            CheckpointFormatError: naming ``source`` (the file), when the pieces the metadata describes do not
                fill the packed entry exactly (a file of another layout, or edited metadata).
        """
        import numpy as np

        shapes = []
        sizes_g = np.zeros(len(self.geoms), dtype=np.int64)
        for j, (gshape, grid, isz) in enumerate(self.geoms):
            shape = _pieces_of_rank(gshape, grid).get(rank)
            shapes.append(shape)
            if shape is not None:
                sizes_g[j] = math.prod(shape) * isz
        sizes = sizes_g[np.asarray(self.gid, dtype=np.int64)] if self.gid else np.zeros(0, dtype=np.int64)
        for name in named or ():  # a grid key with a named entry (a compacted listed shard) is not packed
            i = self.pos.get(name)
            if i is not None:
                sizes[i] = 0
        ends = np.cumsum(sizes) + region_begin
        total = int(ends[-1] - region_begin) if len(ends) else 0
        if total != region_bytes:
            raise CheckpointFormatError(f"{source}: the packed entry {PACKED_ENTRY!r} holds {region_bytes} bytes, "
                                        f"but the metadata's grid records give this file {total}: the data file "
                                        "does not belong to this metadata (or one of them was edited)")
        return PackedEntries(self, shapes, sizes, ends, named)


class PackedEntries:
    """The entries of one packed data file, safetensors-style: ``name -> (dtype, shape, begin, end)`` (offsets
    relative to the data section): the file's named entries (``named``, listed shards), then the pieces of its
    packed entry, computed on lookup; a read-only mapping."""

    def __init__(self, layout: PackedLayout, shapes: list, sizes: Any, ends: Any, named: dict | None = None):
        # Python ints: one lookup per piece, and numpy's scalar indexing costs more than the rest of it
        self._layout, self._shapes, self._sizes, self._ends = layout, shapes, sizes.tolist(), ends.tolist()
        self._named = {k: v for k, v in (named or {}).items() if k != PACKED_ENTRY}

    def get(self, name: str, default: Any = None) -> Any:
        e = self._named.get(name)
        if e is not None:
            return e
        i = self._layout.pos.get(name)
        if i is None or not self._sizes[i]:
            return default
        end = self._ends[i]
        # remembered as a named entry: a load looks each piece up several times (check, verify, read)
        e = self._named[name] = (self._layout.dtypes[i], self._shapes[self._layout.gid[i]], end - self._sizes[i], end)
        return e

    def packed_begin(self, name: str, dtype: str, shape: tuple) -> int | None:
        """Where packed piece ``name`` begins in the data section when it is one, of ``dtype`` and of exactly
        ``shape`` (what :meth:`~oarlock.checkpoint.safetensors_io.SafetensorsFile.check_array` accepts for a whole
        piece); None otherwise, for the full check and its error. The cheap path of a load that reads thousands of
        pieces: nothing is built or remembered per piece."""
        if name in self._named:
            return None
        lay = self._layout
        i = lay.pos.get(name)
        if i is None or not self._sizes[i] or lay.dtypes[i] != dtype or self._shapes[lay.gid[i]] != shape:
            return None
        return self._ends[i] - self._sizes[i]

    def __getitem__(self, name: str) -> Any:
        e = self.get(name)
        if e is None:
            raise KeyError(name)
        return e

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def keys(self) -> list[str]:
        named = [k for k in self._named if k not in self._layout.pos]
        return named + [k for i, k in enumerate(self._layout.keys) if self._sizes[i] or k in self._named]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def items(self) -> list[tuple[str, Any]]:
        return [(k, self.get(k)) for k in self.keys()]
