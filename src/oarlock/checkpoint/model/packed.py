"""Packed data files (``docs/checkpoint-format.md``, "Packed data files"): where each grid- or flat-recorded tensor's
piece lies inside the one :data:`~oarlock.checkpoint.model.names.PACKED_ENTRY` of a rank's data file, computed from
the metadata alone (:class:`PackedLayout`), and that file's entries seen as a safetensors header
(:class:`PackedEntries`)."""

from __future__ import annotations

import functools
from typing import Any, Iterator, Sequence

from oarlock.checkpoint.errors import CheckpointFormatError
from oarlock.checkpoint.model.boxes import numel
from oarlock.checkpoint.model.flatgrid import FlatGrid
from oarlock.checkpoint.model.names import PACKED_ENTRY


@functools.lru_cache(maxsize=4096)
def _pieces_of_rank(global_shape: tuple[int, ...], grid: Any) -> dict[int, tuple[int, ...]]:
    """rank -> shape of the piece it writes of a tensor recorded by ``grid`` (a :class:`GridLayout`: the cell's
    shape; a :class:`FlatGrid`: ``(elements,)``). Empty cells write nothing.

    Raises:
        CheckpointFormatError: the rule gives one rank two pieces (a packed file holds at most one per key).
    """
    out: dict[int, tuple[int, ...]] = {}
    if isinstance(grid, FlatGrid):
        n = numel(global_shape)
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
                sizes_g[j] = numel(shape) * isz
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
        ``shape`` (what :meth:`~oarlock.checkpoint.storage.safetensors.SafetensorsFile.check_array` accepts for a whole
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
