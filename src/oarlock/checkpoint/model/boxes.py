"""Boxes of global tensors (terms: ``docs/checkpoint-format.md``) and :func:`numel`, the one shape product of the
checkpoint package.

A *box* is an axis-aligned region of a global tensor: one ``(start, stop)`` pair per dimension, ``()`` for a
scalar. Pure arithmetic on tuples: no torch, no I/O.
"""

from __future__ import annotations

from typing import Sequence

from oarlock.utils import numel as _numel

Box = tuple[tuple[int, int], ...]


# the one shape product (shared with the rest of oarlock): the entries are Python ints (a ``torch.Size`` is);
# convert numpy integers first (``map(int, shape)``): their own product wraps around silently past ``2**63``,
# which a hostile file's shape reaches
numel = _numel


def stored_numel(local_shape: Sequence[int], flattened_range: tuple[int, int] | None) -> int:
    """Elements a shard actually stores: its box's, or its flat range's length for a flattened shard."""
    if flattened_range is not None:
        return flattened_range[1] - flattened_range[0]
    return numel(local_shape)


def make_box(offset: Sequence[int], shape: Sequence[int]) -> Box:
    """The box ``[offset, offset + shape)`` as ``((start, stop), ...)``."""
    return tuple((int(o), int(o) + int(n)) for o, n in zip(offset, shape))


def full_box(shape: Sequence[int]) -> Box:
    """The box covering a whole tensor of ``shape``."""
    return tuple((0, int(n)) for n in shape)


def box_extent(box: Box) -> tuple[int, ...]:
    """The shape of a box."""
    return tuple(b - a for a, b in box)


def box_volume(box: Box) -> int:
    """Elements inside ``box`` (1 for the scalar box ``()``)."""
    return numel(b - a for a, b in box)


def box_slices(box: Box) -> tuple[slice, ...]:
    """``box`` as a tuple of slices, for indexing a tensor whose origin is the box's coordinate origin."""
    return tuple(slice(a, b) for a, b in box)


def box_intersection(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of equal rank, or None when they do not overlap (or the overlap is empty)."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if hi <= lo:
            return None
        out.append((lo, hi))
    return tuple(out)


def box_shift(box: Box, origin: Sequence[int]) -> Box:
    """``box`` in coordinates relative to ``origin`` (``origin`` becomes 0)."""
    return tuple((a - o, b - o) for (a, b), o in zip(box, origin))


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Cut the row-major element range ``[start, stop)`` of a tensor of ``shape`` into regular boxes.

    Returns a list of ``(offset, extent, flat_start)``: each box lies at ``offset`` with ``extent`` inside the
    tensor, and its elements are exactly the range ``[flat_start, flat_start + numel(extent))`` in row-major
    order (every box has leading singleton dims, one partial dim, then full dims, so it is contiguous). At most
    ``2 * ndim - 1`` boxes; empty ranges give ``[]``. This is an exact form of a "minimal bounding box" of the
    range, without over-reading.
    """
    shape = tuple(int(n) for n in shape)
    if stop <= start:
        return []
    if not shape:
        return [((), (), 0)] if (start, stop) == (0, 1) else []
    inner = numel(shape[1:])
    if inner == 0:
        return []
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    pos = start
    if pos % inner:  # head: a partial first row, recursively
        row = pos // inner
        end = min(stop, (row + 1) * inner)
        for off, ext, fs in flat_range_boxes(shape[1:], pos - row * inner, end - row * inner):
            out.append(((row, *off), (1, *ext), pos + fs - start))
        pos = end
    full_rows = (stop - pos) // inner
    if full_rows:  # middle: whole rows
        row = pos // inner
        out.append(((row, *([0] * (len(shape) - 1))), (full_rows, *shape[1:]), pos - start))
        pos += full_rows * inner
    if pos < stop:  # tail: a partial last row
        row = pos // inner
        for off, ext, fs in flat_range_boxes(shape[1:], 0, stop - pos):
            out.append(((row, *off), (1, *ext), pos + fs - start))
    return out
