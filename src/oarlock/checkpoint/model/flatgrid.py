"""Flat grid records: the flattened shards of one tensor cut from an even split of a flat buffer (ZeRO-1/2
partitions, FSDP1 flat parameters), recorded as one rule (:class:`FlatGrid`; ``docs/checkpoint-format.md``, "Grid
records"), recognised in a listed shard set (:func:`compress_flat`) and intersected arithmetically by the planner
(:class:`FlatIndex`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from oarlock.checkpoint.errors import CheckpointFormatError
from oarlock.checkpoint.model.boxes import numel
from oarlock.checkpoint.model.names import MAX_CELLS_PER_DIM, MAX_RANK, data_file_name, rank_of_file


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
        n = numel(global_shape)
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
        n = numel(global_shape)
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
    n = numel(global_shape)
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
        self._cut = cut  # oarlock.checkpoint.model.boxes.flat_range_boxes
        self._n = numel(self.global_shape)
        self._cache: dict[int, list[Any]] = {}

    def _pieces(self, i: int) -> list[Any]:
        p = self._cache.get(i)
        if p is None:
            a, b = self.grid.shard(self._n, i)
            file = data_file_name(self.grid.writer(i))
            p = self._cache[i] = [self._factory(tuple((o, o + e) for o, e in zip(off, ext)), file, self.key, fs)
                                  for off, ext, fs in self._cut(self.global_shape, a, b) if numel(ext)]
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
