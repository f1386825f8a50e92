"""Tensor descriptions of the AOA engine (docs/aoa.md, "Primitive statements"): a :class:`TensorDesc` is a shape, a
dtype and *refs*, each saying that the box ``dst_box`` of the tensor is ``cast(permute(src[src_box], perm))`` for one
source key. Split, concat, permute, reshape and cast are interval arithmetic on these refs; no tensor data is touched.

A ref keeps *one* composed permutation (native source axes -> this tensor's axes) instead of a post-process list
(permutations compose exactly) and its casts as one chain ``"float16>float32"`` applied step by step, so an
intermediate narrowing cast (fp32 -> fp16 -> fp32) rounds as in Paddle.
"""

from __future__ import annotations

from typing import Sequence

from oarlock.checkpoint.aoa.errors import AOAError
from oarlock.checkpoint.aoa.parser import Expr
from oarlock.checkpoint.model.boxes import Box, flat_range_boxes, full_box, numel
from oarlock.checkpoint.model.mapping import CAST_CHAIN, TensorSpec

#: The most slice mappings one ``reshape=`` statement may produce by default (see :meth:`TensorDesc.reshape`; the
#: engine passes its own :data:`oarlock.checkpoint.aoa.engine.MAX_RESHAPE_REFS`).
MAX_RESHAPE_REFS = 1 << 20


_BOXES: dict[tuple[int, ...], Box] = {}  # full boxes by shape: most keys of a model share a few shapes


class Ref:
    """``tensor[dst_box] = cast(permute(source[src_key][src_box], perm), cast)``; ``src_box`` in the source's
    native axis order, ``perm`` maps this tensor's axis i to source axis ``perm[i]`` (None = identity).

    After a ``reshape=`` the ranks may differ: an entry ``perm[i] is None`` is an axis of extent 1 with no source
    axis, and a source axis absent from ``perm`` has extent 1 in ``src_box``. Mapped axes always have equal
    extents on both sides, so the box is the source box up to inserted or removed unit axes."""

    __slots__ = ("src_key", "src_box", "dst_box", "perm", "cast")

    def __init__(self, src_key: str, src_box: Box, dst_box: Box, perm: tuple[int, ...] | None,
                 cast: str | None):
        self.src_key, self.src_box, self.dst_box, self.perm, self.cast = src_key, src_box, dst_box, perm, cast


class TensorDesc:
    """A (virtual) tensor: ``shape``, ``dtype`` (after any cast) and the refs that tile it."""

    __slots__ = ("shape", "dtype", "refs", "expr")

    def __init__(self, shape: tuple[int, ...], dtype: str, refs: list[Ref], expr: Expr | None = None):
        self.shape, self.dtype, self.refs, self.expr = shape, dtype, refs, expr

    @classmethod
    def source(cls, key: str, spec: TensorSpec) -> "TensorDesc":
        shape = tuple(spec.shape)
        box = _BOXES.get(shape)
        if box is None:
            box = _BOXES[shape] = full_box(shape)
        return cls(shape, spec.dtype, [Ref(key, box, box, None, None)])

    def slice(self, axis: int, a: int, b: int, expr: Expr | None = None) -> "TensorDesc":
        """Sub-tensor ``[a, b)`` along ``axis``."""
        refs = []
        for r in self.refs:
            lo, hi = r.dst_box[axis]
            s, t = max(lo, a), min(hi, b)
            if s >= t:
                continue
            nax = r.perm[axis] if r.perm is not None else axis
            sb = list(r.src_box)
            if nax is not None:  # None: a unit axis of this tensor only (after a reshape)
                so = sb[nax][0] + (s - lo)
                sb[nax] = (so, so + t - s)
            db = list(r.dst_box)
            db[axis] = (s - a, t - a)
            refs.append(Ref(r.src_key, tuple(sb), tuple(db), r.perm, r.cast))
        shape = list(self.shape)
        shape[axis] = b - a
        return TensorDesc(tuple(shape), self.dtype, refs, expr)

    @staticmethod
    def concat(parts: Sequence["TensorDesc"], axis: int, expr: Expr | None = None) -> "TensorDesc":
        refs = []
        off = 0
        for p in parts:
            for r in p.refs:
                db = list(r.dst_box)
                db[axis] = (db[axis][0] + off, db[axis][1] + off)
                refs.append(Ref(r.src_key, r.src_box, tuple(db), r.perm, r.cast))
            off += p.shape[axis]
        shape = list(parts[0].shape)
        shape[axis] = off
        return TensorDesc(tuple(shape), parts[0].dtype, refs, expr)

    def permute(self, q: Sequence[int], expr: Expr | None = None) -> "TensorDesc":
        """``torch.permute`` semantics: result axis i is this tensor's axis ``q[i]``."""
        ident = tuple(range(len(q)))
        refs = []
        for r in self.refs:
            p = r.perm
            perm = q if p is None else tuple([p[i] for i in q])
            db = r.dst_box
            same = perm == ident and len(r.src_box) == len(perm)
            refs.append(Ref(r.src_key, r.src_box, tuple([db[i] for i in q]), None if same else perm, r.cast))
        shape = self.shape
        return TensorDesc(tuple([shape[i] for i in q]), self.dtype, refs, expr)

    def reshape(self, shape: Sequence[int], expr: Expr | None = None, name: str = "",
                limit: int | None = None) -> "TensorDesc":
        """Row-major reshape (``torch.reshape`` semantics) to ``shape`` (same element count, checked by the
        caller), still as box-to-box refs: every ref's box is cut into pieces that are boxes in both shapes and
        hold the same elements up to unit axes (:func:`_common_pieces`). Splitting or merging leading axes of
        whole rows keeps one ref per block (``[L * n, m] <-> [L, n, m]``: L refs); a merge that interleaves
        (rows of a transposed tensor, a rotary permutation) needs one ref per contiguous run. No data is touched.

        Raises:
            AOAError: more than ``limit`` (default :data:`MAX_RESHAPE_REFS`) refs would be needed (a reshape that
                scatters single elements), naming the statement and both shapes.
        """
        limit = MAX_RESHAPE_REFS if limit is None else limit
        old, new = self.shape, tuple(int(n) for n in shape)
        if old == new:
            return TensorDesc(new, self.dtype, list(self.refs), expr)
        refs: list[Ref] = []
        for r in self.refs:
            for a, b in _box_runs(old, r.dst_box):
                for f, g in _common_pieces(old, new, a, b):
                    ob, nb = _range_box(old, f, g), _range_box(new, f, g)
                    sb = list(r.src_box)
                    src_axes = []
                    for i, ((x0, x1), (d0, _)) in enumerate(zip(ob, r.dst_box)):
                        j = r.perm[i] if r.perm is not None else i
                        if j is None:
                            continue
                        so = r.src_box[j][0] + x0 - d0
                        sb[j] = (so, so + x1 - x0)
                        if x1 - x0 != 1:
                            src_axes.append(j)
                    it = iter(src_axes)
                    amap = tuple(next(it) if y1 - y0 != 1 else None for y0, y1 in nb)
                    if amap == tuple(range(len(sb))):
                        amap = None
                    refs.append(Ref(r.src_key, tuple(sb), nb, amap, r.cast))
                    if len(refs) > limit:
                        raise AOAError(f"reshape of {name!r} from {list(old)} to {list(new)} does not map to boxes: "
                                       f"it would need more than {limit} slice mappings (the new shape scatters "
                                       "single elements of the source, e.g. a transposed tensor merged into one "
                                       "axis); reshape before transposing, or split/concat instead", expr,
                                       name="reshape")
        return TensorDesc(new, self.dtype, refs, expr)

    def cast(self, dtype: str, expr: Expr | None = None) -> "TensorDesc":
        """Cast to ``dtype``; after an earlier cast the steps chain (``"bfloat16>float32"``), so every narrowing
        step still rounds, in order (Paddle applies each cast of a chain)."""
        def chained(prev: str | None) -> str:
            if prev is None or prev.rsplit(CAST_CHAIN, 1)[-1] == dtype:
                return dtype if prev is None else prev
            return prev + CAST_CHAIN + dtype
        return TensorDesc(self.shape, dtype,
                          [Ref(r.src_key, r.src_box, r.dst_box, r.perm, chained(r.cast)) for r in self.refs], expr)


def _box_runs(shape: tuple[int, ...], box: Box) -> list[tuple[int, int]]:
    """The row-major element ranges ``[a, b)`` of ``shape`` that make up ``box`` (one per index of the axes
    before the last partial one; whole trailing axes merge into each run)."""
    nd = len(shape)
    if nd == 0:
        return [(0, 1)]
    if any(b <= a for a, b in box):
        return []
    strides = [numel(shape[d + 1:]) for d in range(nd)]
    k = nd - 1
    while k > 0 and box[k] == (0, shape[k]):
        k -= 1
    length = (box[k][1] - box[k][0]) * strides[k]
    starts = [box[k][0] * strides[k]]
    for d in range(k - 1, -1, -1):
        starts = [i * strides[d] + s for i in range(*box[d]) for s in starts]
    return [(s, s + length) for s in starts]


def _range_box(shape: tuple[int, ...], a: int, b: int) -> Box:
    """The box of ``shape`` whose elements are exactly the row-major range ``[a, b)`` (which must be one)."""
    (off, ext, _), = flat_range_boxes(shape, a, b)
    return tuple((o, o + e) for o, e in zip(off, ext))


def _common_pieces(old: tuple[int, ...], new: tuple[int, ...], a: int, b: int) -> list[tuple[int, int]]:
    """Cut the row-major range ``[a, b)`` into ranges that are boxes in both ``old`` and ``new`` with the same
    extents once unit axes are dropped (so one is the other viewed with unit axes added or removed). A range that
    is a box in both but with other extents (``[b, a]`` vs ``[b * a]``) is cut along the first non-unit axis of
    the side that gives fewer pieces; single elements always qualify, so this terminates."""
    out, stack = [], [(a, b)]
    while stack:
        f, g = stack.pop()
        cut = False
        boxes = None
        for shape in (old, new):
            pieces = flat_range_boxes(shape, f, g)
            if len(pieces) > 1:
                stack.extend((f + fs, f + fs + numel(ext)) for _, ext, fs in reversed(pieces))
                cut = True
                break
            boxes = (boxes or []) + [[e for e in pieces[0][1] if e != 1]]
        if cut:
            continue
        eo, en = boxes
        if eo == en:
            out.append((f, g))
            continue
        m = min(eo[0], en[0])
        step = (g - f) // m
        stack.extend((f + i * step, f + (i + 1) * step) for i in range(m - 1, -1, -1))
    return out
