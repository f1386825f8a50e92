"""The AOA engine (docs/aoa.md, "Primitive statements", "Reverse mode"): primitive statements -> exact slice mappings.

Every tensor name is bound to a :class:`TensorDesc`: a shape, a dtype and *refs*, each saying that the box
``dst_box`` of this tensor is ``cast(permute(src[src_box], perm))`` for one source key. Split, concat,
transpose/permute and cast are interval arithmetic on these refs; no tensor data is touched. A destination
key's refs become :class:`~oarlock.checkpoint.mapping.SliceMapping` objects whose ``dst_box`` regions tile it.

Unlike Paddle, a ref keeps *one* composed permutation (native source axes -> this tensor's axes) instead of a
post-process list (permutations compose exactly) and its casts as one chain ``"float16>float32"`` applied step by
step, so an intermediate narrowing cast (fp32 -> fp16 -> fp32) rounds as in Paddle.
"""

from __future__ import annotations

import difflib
import gc
import warnings
from dataclasses import dataclass
from typing import Mapping, Sequence

from oarlock.checkpoint.aoa.errors import AOAError, AOASyntaxError
from oarlock.checkpoint.aoa.macros import (SCALAR_SUFFIXES, KeySet, MacroContext, expand_macros,
                                           optimizer_splitter, split_optimizer_suffix)
from oarlock.checkpoint.aoa.parser import VOID, Expr, parse_statements
from oarlock.checkpoint.mapping import CAST_CHAIN, Box, SliceMapping, TensorSpec, full_box
from oarlock.checkpoint.sharded import flat_range_boxes
from oarlock.utils import dtype_name, numel

TP_LAYOUTS_KEY = "tp_layouts"  # CheckpointMetadata.extra entry: AOAProgram.tp_layouts of the writer
_ATTRS = ("axis", "dtype", "permute", "src_dtype", "dst_dtype", "reshape", "src_shape")
#: The most slice mappings one ``reshape=`` statement may produce (see :meth:`TensorDesc.reshape`).
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


def _parse_shape(e: Expr, value: object, attr: str = "reshape") -> tuple[int, ...]:
    """``reshape='[2, 3, -1]'`` (or unquoted ``reshape=[2, 3, -1]``) -> ``(2, 3, -1)``.

    Raises:
        AOASyntaxError: not a list of integers, a size below -1, or more than one -1.
    """
    text = str(value).strip()
    body = text[1:-1].strip() if text.startswith("[") and text.endswith("]") else None
    try:
        shape = tuple(int(x) for x in body.split(",")) if body else None
    except ValueError:
        shape = None
    if shape is None:
        raise AOASyntaxError(f"{attr}={value!r}: expected a non-empty list of integers such as '[2, 3, -1]'", e,
                             name=attr)
    if any(n < -1 for n in shape):
        raise AOASyntaxError(f"{attr}={value!r}: sizes must be >= 0, or -1 for the one inferred size", e,
                             name=attr)
    if shape.count(-1) > 1:
        raise AOASyntaxError(f"{attr}={value!r}: more than one -1 (only one size can be inferred)", e,
                             name=attr)
    return shape


@dataclass(slots=True)
class Primitive:
    """A primitive statement: ``kind`` in rename, split, concat, permute, cast, reshape, delete, create.

    ``perm`` None with kind permute = reverse all axes (``^T``, ``permute='[]'``); ``dtype`` None with kind cast
    = the inverse of a plain cast in reverse mode (the destination's dtype decides); ``src_dtype`` is checked
    against the tensor before a reversible cast. ``shape``: the target shape of a reshape (one size may be -1);
    None in an inverted reshape whose input shape the statements do not determine (the destination's shape
    decides). ``src_shape``: the input shape a reshape checks (and its inverse restores)."""

    kind: str
    lhs: tuple[str, ...]
    rhs: tuple[str, ...]
    expr: Expr
    axis: int | None = None
    perm: tuple[int, ...] | None = None
    dtype: str | None = None
    src_dtype: str | None = None
    inverted: bool = False
    shape: tuple[int, ...] | None = None
    src_shape: tuple[int, ...] | None = None

    def render(self) -> str:
        if not self.inverted:
            return self.expr.render()
        attrs = []
        if self.kind in ("split", "concat") or (self.kind == "rename" and self.axis is not None):
            attrs.append(f"axis={self.axis}")
        elif self.kind == "permute":
            attrs.append(f"permute='{list(self.perm) if self.perm is not None else []}'")
        elif self.kind == "cast":
            attrs.append(f"src_dtype='{self.src_dtype}', dst_dtype='{self.dtype}'" if self.src_dtype
                         else f"dtype='{self.dtype}'" if self.dtype else "dtype=<destination dtype>")
        elif self.kind == "reshape":
            attrs.append(f"reshape='{list(self.shape)}'" if self.shape is not None
                         else "reshape=<destination shape>")
        return f"{', '.join(self.lhs)} -> {', '.join(list(self.rhs) + attrs)}"


def _dtype_attr(e: Expr, name: str, value: object) -> str:
    try:
        return dtype_name(str(value))
    except ValueError as err:
        raise AOAError(f"{name}={value!r}: {err}", e, name=name) from None


def _parse_perm(e: Expr, value: object) -> tuple[int, ...] | None:
    text = str(value).strip()
    if not (text.startswith("[") and text.endswith("]")):
        raise AOASyntaxError(f"permute={value!r}: expected a list such as '[2, 0, 1]' (or '[]' to reverse all axes)",
                             e, name="permute")
    body = text[1:-1].strip()
    if not body:
        return None
    try:
        return tuple(int(x) for x in body.split(","))
    except ValueError:
        raise AOASyntaxError(f"permute={value!r}: expected integers", e, name="permute") from None


def classify(e: Expr, memo: dict | None = None) -> Primitive:
    """Check a macro-expanded statement against the primitive forms (docs/aoa.md, "Primitive statements"). ``memo`` caches the
    verdict per attribute list and arity (macro expansions repeat a few forms tens of thousands of times).

    Raises:
        AOASyntaxError: N -> M with N, M >= 2, unsupported attribute, bad attribute value.
        AOAError: split/concat without exactly one ``axis``; two operators in a 1 -> 1 statement.
    """
    lhs, rhs = e.lhs, e.rhs
    if memo is not None and VOID not in lhs and VOID not in rhs:
        key = (tuple(e.attrs), len(lhs) >= 2, len(rhs) >= 2)
        hit = memo.get(key)
        if hit is None:
            p = classify(e)
            memo[key] = (p.kind, p.axis, p.perm, p.dtype, p.src_dtype, p.shape, p.src_shape)
            return p
        return Primitive(hit[0], lhs, rhs, e, hit[1], hit[2], hit[3], hit[4], shape=hit[5], src_shape=hit[6])
    names = [k for k, _ in e.attrs]
    for k in names:
        if k not in _ATTRS:
            raise AOASyntaxError(f"Unsupported attribute {k!r} (supported: {', '.join(_ATTRS)})", e, name=k)
    if e.lhs == (VOID,) or e.rhs == (VOID,):
        if e.attrs:
            raise AOASyntaxError("a statement with '_' takes no attributes", e, name=names[0])
        if e.lhs == (VOID,) and e.rhs == (VOID,):
            raise AOASyntaxError("'_ -> _' means nothing", e)
        return Primitive("create", (), e.rhs, e) if e.lhs == (VOID,) else Primitive("delete", e.lhs, (), e)
    for n in e.names():
        if n == VOID:
            raise AOASyntaxError("'_' must stand alone on its side of '->'", e, name=n)
    nl, nr = len(e.lhs), len(e.rhs)
    if nl >= 2 and nr >= 2:
        raise AOASyntaxError(f"unexpected split/concat statement: {nl} -> {nr} names (a statement splits one tensor "
                             "or concatenates into one)", e)
    if nl >= 2 or nr >= 2:
        if names != ["axis"] or not isinstance(e.attrs[0][1], int):
            raise AOAError(f"a {'split' if nr >= 2 else 'concat'} statement needs exactly one attribute, an integer "
                           f"axis=k (got {', '.join(names) or 'none'}): only support one attr named `axis`", e,
                           name=names[1] if len(names) > 1 else (names[0] if names else None))
        return Primitive("split" if nr >= 2 else "concat", e.lhs, e.rhs, e, axis=e.attrs[0][1])
    if not names:
        return Primitive("rename", e.lhs, e.rhs, e)
    if sorted(names) == ["reshape", "src_shape"]:
        return Primitive("reshape", e.lhs, e.rhs, e, shape=_parse_shape(e, e.attr("reshape")),
                         src_shape=_parse_shape(e, e.attr("src_shape"), "src_shape"))
    if sorted(names) == ["dst_dtype", "src_dtype"]:
        return Primitive("cast", e.lhs, e.rhs, e, dtype=_dtype_attr(e, "dst_dtype", e.attr("dst_dtype")),
                         src_dtype=_dtype_attr(e, "src_dtype", e.attr("src_dtype")))
    if len(names) > 1:
        raise AOAError(f"a 1 -> 1 statement takes one operator, got {', '.join(names)} (only the pair "
                       "src_dtype/dst_dtype goes together)", e, name=names[1])
    k, v = e.attrs[0]
    if k == "axis":
        if not isinstance(v, int):
            raise AOASyntaxError(f"axis must be an integer, got {v!r}", e, name=k)
        return Primitive("rename", e.lhs, e.rhs, e, axis=v)
    if k == "dtype":
        return Primitive("cast", e.lhs, e.rhs, e, dtype=_dtype_attr(e, k, v))
    if k == "permute":
        return Primitive("permute", e.lhs, e.rhs, e, perm=_parse_perm(e, v))
    if k == "reshape":
        return Primitive("reshape", e.lhs, e.rhs, e, shape=_parse_shape(e, v))
    if k == "src_shape":
        raise AOAError("src_shape goes with reshape= (the input shape a reshape checks and its inverse restores)",
                       e, name=k)
    raise AOAError(f"{k} needs its partner ({'dst_dtype' if k == 'src_dtype' else 'src_dtype'})", e, name=k)


def _reshape_inputs(prims: list[Primitive]) -> dict[int, tuple[int, ...] | None]:
    """For each reshape of a forward program, the shape its input has as far as the statements alone determine it
    (an earlier ``reshape=`` and the permutations, splits, concatenations and renames after it; at most one size
    unknown, as -1, which the element count fixes): what its inverse reshapes back to. None when not determined
    (the input is a checkpoint key, or two sizes are unknown)."""
    shapes: dict[str, tuple[int, ...] | None] = {}
    out: dict[int, tuple[int, ...] | None] = {}
    for p in prims:
        ins = [shapes.get(n) for n in p.lhs]
        t = ins[0] if ins else None
        res: tuple[int, ...] | None = None
        if p.kind == "reshape":
            out[id(p)] = p.src_shape if p.src_shape is not None else t
            res = p.shape
        elif p.kind in ("rename", "cast"):
            res = t
        elif p.kind == "permute" and t is not None:
            q = tuple(range(len(t)))[::-1] if p.perm is None else tuple(a % len(t) for a in p.perm)
            res = tuple(t[i] for i in q) if sorted(q) == list(range(len(t))) else None
        elif p.kind == "split" and t is not None and -len(t) <= p.axis < len(t):
            ax, n = p.axis % len(t), len(p.rhs)
            if t[ax] == -1 or t[ax] % n == 0:
                res = t[:ax] + (t[ax] // n if t[ax] != -1 else -1,) + t[ax + 1:]
        elif p.kind == "concat" and all(x is not None and -1 not in x for x in ins) and ins:
            ax = p.axis % len(ins[0]) if -len(ins[0]) <= p.axis < len(ins[0]) else None
            if ax is not None and all(len(x) == len(ins[0]) for x in ins):  # type: ignore[arg-type]
                res = ins[0][:ax] + (sum(x[ax] for x in ins),) + ins[0][ax + 1:]  # type: ignore[index]
        for r in p.rhs:
            shapes[r] = res
    return out


def invert(prims: list[Primitive]) -> list[Primitive]:
    """The inverse program (docs/aoa.md, "Reverse mode"): reversed order, split <-> concat, renames and permutations
    inverted, ``X -> _`` <-> ``_ -> X``, ``src_dtype``/``dst_dtype`` swapped; a plain ``dtype=`` cast becomes
    a cast to the destination's dtype; a reshape goes back to its input's shape (see :func:`_reshape_inputs`)."""
    inputs = _reshape_inputs(prims) if any(p.kind == "reshape" for p in prims) else {}
    out = []
    for p in reversed(prims):
        kind = {"split": "concat", "concat": "split", "delete": "create", "create": "delete"}.get(p.kind, p.kind)
        perm = p.perm
        if p.kind == "permute" and perm is not None:
            inv = [0] * len(perm)
            for i, a in enumerate(perm):
                if 0 <= a < len(perm):
                    inv[a] = i
            perm = tuple(inv) if sorted(perm) == list(range(len(perm))) else perm
        dtype, src = (p.src_dtype, p.dtype) if p.src_dtype else (None, None)
        out.append(Primitive(kind, p.rhs, p.lhs, p.expr, p.axis, perm, dtype, src, inverted=True,
                             shape=inputs.get(id(p)), src_shape=p.shape if p.kind == "reshape" else None))
    return out


class _Deleted:
    def __init__(self, prim: Primitive):
        self.prim = prim


class _Void:
    pass


_VOID = _Void()
_MISSING = object()


def _norm_axis(axis: int, ndim: int, name: str, prim: Primitive) -> int:
    if not -ndim <= axis < ndim:
        raise AOAError(f"axis={axis} is out of range for {name!r}, which has {ndim} dimension(s)", prim.expr,
                       name="axis" if "axis" in prim.expr.render() else name)
    return axis % ndim


def _fmt_range(shape: Sequence[int]) -> str:
    return "(" + ", ".join(f"slice(0, {n})" for n in shape) + ("," if len(shape) == 1 else "") + ")"


def normalize_config(aoa_config: object) -> tuple[list[str], bool]:
    """``(statements, reverse)`` from a Paddle-style dict, a list of strings or one string."""
    if isinstance(aoa_config, str):
        return [aoa_config], False
    if isinstance(aoa_config, (list, tuple)):
        return list(aoa_config), False
    if isinstance(aoa_config, Mapping):
        if "aoa_statements" not in aoa_config:
            raise AOASyntaxError(f"AOA config needs the key 'aoa_statements'; got keys {sorted(aoa_config)}")
        st = aoa_config["aoa_statements"]
        if isinstance(st, str):
            st = [st]
        if not isinstance(st, (list, tuple)):
            raise AOASyntaxError(f"aoa_statements must be a list of strings, got {type(st).__name__}")
        return list(st), bool(aoa_config.get("aoa_config_reverse", False))
    raise AOASyntaxError(f"AOA config must be a dict with 'aoa_statements' or a list of statement strings, got "
                         f"{type(aoa_config).__name__}")


def fold_optimizer_keys(source: Mapping[str, TensorSpec]) -> tuple[dict[str, TensorSpec], dict[str, list[str]]]:
    """Model-level view of a source key set: ``({model_key: spec}, {model_key: [optimizer suffixes]})``.

    A model key present only through its optimizer states (an optimizer-only checkpoint) takes the spec of its
    first parameter-shaped state."""
    model: dict[str, TensorSpec] = {}
    states: dict[str, list[str]] = {}
    split = optimizer_splitter(source)
    for k, spec in source.items():
        base, suf = split(k)
        if not suf:
            model[k] = spec
        else:
            states.setdefault(base, []).append(suf)
    for base, sufs in states.items():
        if base not in model:
            for s in sufs:
                if s not in SCALAR_SUFFIXES:
                    model[base] = source[base + s]
                    break
    return model, states


def fold_shard_counts(counts: Mapping[str, int] | None) -> dict[str, int]:
    """Model-level TP shard counts; a key and its optimizer states must agree.

    Raises:
        AOAError: naming the key and the disagreeing counts.
    """
    out: dict[str, int] = {}
    seen: dict[str, list[str]] = {}
    split = optimizer_splitter(counts or {})
    for k, n in (counts or {}).items():
        base, suf = split(k)
        if suf in SCALAR_SUFFIXES:
            continue
        if base in out and out[base] != int(n):
            raise AOAError(f"inconsistent shard counts among {base!r} and its optimizer states: "
                           f"{', '.join(seen[base])} have {out[base]} TP shard(s) but {k!r} has {n}")
        out[base] = int(n)
        seen.setdefault(base, []).append(repr(k))
    return out


def source_specs(metadata) -> dict[str, TensorSpec]:
    """``{key: TensorSpec(global_shape, dtype)}`` of a :class:`~oarlock.checkpoint.CheckpointMetadata`: the
    ``source`` argument of :func:`compile_aoa` for a checkpoint on disk."""
    return {k: TensorSpec(tuple(t.global_shape), t.dtype) for k, t in metadata.tensors.items()}


def shard_counts(metadata) -> dict[str, int]:
    """TP shard count of every key of a :class:`~oarlock.checkpoint.CheckpointMetadata`: the number of distinct
    global offsets among its primary shards (as Paddle derives it for ``fused_qkv_old``/``fused_ffn``)."""
    counts = {k: t.shard_count() or 1 for k, t in metadata.tensors.items()}
    recorded = (getattr(metadata, "extra", None) or {}).get(TP_LAYOUTS_KEY) or {}
    if recorded:  # the degree a fused layout was written for wins over the offsets (a reshard may differ)
        for k in counts:
            rec = recorded.get(split_optimizer_suffix(k)[0])
            if isinstance(rec, dict) and isinstance(rec.get("tp"), int) and rec["tp"] > 0:
                counts[k] = rec["tp"]
    return counts


@dataclass
class _Entry:
    desc: TensorDesc
    suffix: str
    spec: TensorSpec
    cast_all: str | None = None      # reverse-mode / allow_cast: cast every ref to the destination dtype


class AOAProgram:
    """A compiled AOA config; implements :class:`~oarlock.checkpoint.mapping.MappingProgram`.

    Attributes:
        reverse: whether the statements were inverted (``aoa_config_reverse``).
        statements: the primitive statements as executed (expanded by macros, inverted in reverse mode).
        skipped: destination keys deliberately not loaded (left as initialised): declared source-less with
            ``_ -> key``, or named like a source key dropped with ``key -> _`` (or whose state source was dropped).
        missing: destination keys that no statement and no source key provides, with the reason.
        deleted: source keys dropped with ``key -> _``.
        unused_sources: source keys (model level) that reach no destination key.
        tp_layouts: destination keys written in a TP-degree-dependent layout (``fused_ffn``, ``fused_qkv_old``):
            ``{key: {"statement": ..., "tp": degree, "axis": ..., ["num_heads", "num_key_value_groups"]}}``.
            Writers store it in the checkpoint metadata (``extra["tp_layouts"]``) so that a load at another
            degree re-lays it out (see :func:`oarlock.checkpoint.aoa.layout.relayout_config`).
    """

    def __init__(self, source: Mapping[str, TensorSpec], reverse: bool, statements: list[Primitive]):
        self.source = dict(source)
        self.reverse = reverse
        self.statements = statements
        self.skipped: list[str] = []
        self.missing: dict[str, str] = {}
        self.deleted: list[str] = []
        self.unused_sources: list[str] = []
        self.tp_layouts: dict[str, dict] = {}
        self._entries: dict[str, _Entry] = {}
        self._cache: dict[str, list[SliceMapping]] = {}

    @property
    def deleted_keys(self) -> list[str]:
        """Source keys dropped with ``key -> _`` (the loader does not report them as unexpected)."""
        return list(self.deleted)

    def destination_keys(self) -> list[str]:
        """Destination keys this program fills (model keys, then their optimizer states where present)."""
        return list(self._entries)

    def destination_spec(self, key: str) -> TensorSpec:
        """Global shape and dtype of destination ``key``; raises :class:`AOAError` for an unknown key."""
        return self._entry(key).spec

    def _entry(self, key: str) -> _Entry:
        try:
            return self._entries[key]
        except KeyError:
            why = self.missing.get(key) or ("declared source-less by '_ -> key'" if key in self.skipped else None)
            raise AOAError(f"{key!r} is not a destination key of this AOA program"
                           + (f" ({why})" if why else "")) from None

    def mappings_for(self, key: str) -> list[SliceMapping]:
        """Slice mappings tiling destination ``key`` (computed on first request, then cached)."""
        got = self._cache.get(key)
        if got is not None:
            return got
        ent = self._entry(key)
        out = []
        if ent.suffix in SCALAR_SUFFIXES:  # beta powers / step counters: one whole accumulator
            src = next(r.src_key + ent.suffix for r in ent.desc.refs if r.src_key + ent.suffix in self.source)
            box = full_box(ent.spec.shape)
            out.append(SliceMapping(key, box, src, box, None, ent.cast_all))
        else:
            for r in ent.desc.refs:
                if ent.suffix:
                    src = r.src_key + ent.suffix
                    cast = ent.spec.dtype if self.source[src].dtype != ent.spec.dtype else None
                else:
                    src, cast = r.src_key, r.cast
                    if ent.cast_all is not None and (cast or "").rsplit(CAST_CHAIN, 1)[-1] != ent.cast_all:
                        cast = ent.cast_all if cast is None else cast + CAST_CHAIN + ent.cast_all
                out.append(SliceMapping(key, r.dst_box, src, r.src_box, _mapping_perm(r), cast))
        self._cache[key] = out
        return out

    def explain(self, keys: Sequence[str] | None = None, *, only: str | None = None,
                tp: int = 1, tp_axes: Mapping[str, int | None] | None = None) -> str:
        """Human-readable listing: every primitive statement, then per destination key each slice's origin, then
        the skipped, missing, deleted and unused keys.

        Args:
            keys: destination keys to list (default: all).
            only: an ``fnmatch`` glob; every section keeps only what names a matching key (a statement is kept
                when one of its names matches).
            tp, tp_axes: with ``tp > 1``, each listed key also shows the row ranges the ``tp`` ranks hold
                (``tp_axes``: key -> split axis or None, as ``convert --tp`` splits it).
        """
        import fnmatch

        def hit(name: str) -> bool:
            return only is None or fnmatch.fnmatchcase(name, only)

        stmts = list(self.statements)
        if only is not None:  # statements naming a matching key, or feeding one (walked backwards)
            need = {k for k in self._entries if hit(k)}
            kept = []
            for p in reversed(stmts):
                if any(hit(n) for n in (*p.lhs, *p.rhs)) or any(n in need for n in p.rhs):
                    kept.append(p)
                    need.difference_update(p.rhs)  # temporaries are reused: only the latest writer feeds a reader
                    need.update(p.lhs)
            stmts = kept[::-1]
        lines = [f"# {len(stmts)} primitive statement(s)" + (" (reverse mode: inverted)" if self.reverse else "")
                 + (f" for keys matching {only!r}" if only is not None else "")]
        lines += [f"  {p.render()}" for p in stmts]
        keys = [k for k in (list(self._entries) if keys is None else list(keys)) if hit(k)]
        lines.append(f"# {len(keys)} destination key(s)")
        for k in keys:
            spec = self.destination_spec(k)
            lines.append(f"{k}  {list(spec.shape)} {spec.dtype}")
            axis = (tp_axes or {}).get(k) if tp > 1 else None
            if axis is not None:
                n = spec.shape[axis]
                step = -(-n // tp)  # torch.chunk sizes, as convert --tp splits
                parts = [f"rank {r}: {min(r * step, n)}:{min((r + 1) * step, n)}" for r in range(tp)]
                layout = self.tp_layouts.get(k)
                extra = f", {layout['statement']} blocks for tp={layout['tp']}" if layout else ""
                lines.append(f"  TP {tp} on axis {axis}{extra}: {'; '.join(parts)}")
            for m in self.mappings_for(k):
                extra = (f"  permute={list(m.permute)}" if m.permute else "") + (f"  cast={m.dtype}" if m.dtype else "")
                lines.append(f"  [{_fmt_box(m.dst_box)}] <- {m.src_key}[{_fmt_box(m.src_box)}]{extra}")
        for k in self.skipped:
            if hit(k):
                lines.append(f"{k}  (not loaded on purpose: '_ -> {k}' or a dropped key of that name; keeps its "
                             "value)")
        for k, why in self.missing.items():
            if hit(k):
                lines.append(f"{k}  MISSING: {why}")
        for what, names in (("deleted", self.deleted), ("unused", self.unused_sources)):
            names = [n for n in names if hit(n)]
            if names:
                more = f" ... ({len(names) - 10} more)" if len(names) > 10 else ""
                lines.append(f"# {len(names)} {what} source key(s): {', '.join(names[:10])}{more}")
        return "\n".join(lines)


def _mapping_perm(r: Ref) -> tuple[int, ...] | None:
    """The ``SliceMapping.permute`` of a ref: its own permutation when it keeps the source's rank; after a reshape,
    the source axes in this tensor's order followed by the unmapped (unit) ones, or None when the non-unit axes
    keep their order (then the source box's row-major elements are the destination box's, unit axes aside)."""
    p = r.perm
    if p is None or (len(p) == len(r.src_box) and None not in p):
        return p
    mapped = [j for j in p if j is not None]
    full = mapped + [j for j in range(len(r.src_box)) if j not in mapped]
    moving = [j for j in full if r.src_box[j][1] - r.src_box[j][0] != 1]
    return None if moving == sorted(moving) else tuple(full)


def split_compound(exprs: list[Expr]) -> list[Expr]:
    """A 1 -> 1 statement with ``reshape=`` and other operators (``permute=``, ``dtype=``, the
    ``src_dtype``/``dst_dtype`` pair) becomes a chain of one-operator statements in the written order, through
    temporaries ``<destination>@<step>``; every other statement is left as it is."""
    out = []
    for e in exprs:
        names = [k for k, _ in e.attrs]
        if "reshape" not in names or len(names) < 2 or len(e.lhs) != 1 or len(e.rhs) != 1:
            out.append(e)
            continue
        ops: list[list[tuple[str, object]]] = []
        pair: list[tuple[str, object]] | None = None
        extra = [(k, v) for k, v in e.attrs if k == "src_shape"]
        for k, v in e.attrs:
            if k == "src_shape":
                continue
            if k == "reshape" and extra:  # the input shape belongs to the first reshape
                ops.append([(k, v)] + extra)
                extra = []
                continue
            if k in ("src_dtype", "dst_dtype"):
                if pair is None:
                    pair = []
                    ops.append(pair)
                pair.append((k, v))
            else:
                ops.append([(k, v)])
        if len(ops) < 2:
            out.append(e)
            continue
        names_chain = [e.lhs[0]] + [f"{e.rhs[0]}@{i}" for i in range(1, len(ops))] + [e.rhs[0]]
        for i, op in enumerate(ops):
            out.append(e.derive("reshape chain", [names_chain[i]], [names_chain[i + 1]], op))
    return out


_FUSED_STAGES = ("fused_qkv", "fused_qkv_old", "fused_ffn")


def _fused_hint(e: Expr) -> str:
    """What the parameters of a fused macro mean, for errors about piece sizes."""
    root = e
    while root.parent is not None and root.keyword is None:
        root = root.parent
    if e.stage == "fused_ffn":
        return ("; fused_ffn expects gate and up of the same shape, and a fused tensor of 2 x (TP degree) equal "
                "blocks")
    h, g = root.attr("num_heads"), root.attr("num_key_value_groups")
    return (f"; check num_heads={h} and num_key_value_groups={g} against the tensor shapes: num_key_value_groups "
            "is the number of KV heads (HF num_key_value_heads), not the number of query heads per KV head")


def _fmt_box(box: Box) -> str:
    return ", ".join(f"{a}:{b}" for a, b in box)


class _Executor:
    def __init__(self, model_src: dict[str, TensorSpec], keys: KeySet, states: Mapping[str, TensorSpec] = {},
                 dst_specs: Mapping[str, TensorSpec] | None = None):
        self.model_src = model_src
        self.states = states  # optimizer-state source keys, readable when a statement names one explicitly
        self.dst_specs = dst_specs or {}  # model-level destination specs: the shape an inverted reshape goes back to
        self.keys = keys
        self.env: dict[str, object] = {}
        self.fresh: dict[str, None] = {}
        self.read_sources: set[str] = set()
        self.deleted: dict[str, None] = {}
        self.created: dict[str, None] = {}
        self._src_cache: dict[str, TensorDesc] = {}
        self._pieces: dict[int, tuple] = {}  # fused statement -> (piece extent, name, count, shape, expr)

    def source_desc(self, name: str) -> TensorDesc:
        d = self._src_cache.get(name)
        if d is None:
            d = self._src_cache[name] = TensorDesc.source(name, self.model_src[name])
        return d

    def get(self, name: str, prim: Primitive) -> TensorDesc:
        b = self.env.get(name, _MISSING)
        if b is _MISSING:
            if name not in self.model_src and name in self.states:
                self.read_sources.add(name)
                return TensorDesc.source(name, self.states[name])
            if name not in self.model_src:
                # temporaries the macros made (``X_transpose_tmp``, ``dst@1``...) are not names a user wrote
                user_env = [n for n in self.env if not (n.endswith("_tmp") or "@" in n)]
                near = difflib.get_close_matches(name, user_env + self.keys.with_prefix(name.split(".")[0]),
                                                 n=3, cutoff=0.5)
                raise AOAError(f"`{name}` should be assigned before! It is neither a source key nor the result of an "
                               "earlier statement" + (f"; closest names: {', '.join(near)}" if near else ""),
                               prim.expr, name=name)
            self.read_sources.add(name)
            return self.source_desc(name)
        if isinstance(b, _Deleted):
            raise AOAError(f"`{name}` was deleted by '{b.prim.render()}' and cannot be read afterwards", prim.expr,
                           name=name)
        if b is _VOID:
            raise AOAError(f"`{name}` was declared source-less by '_ -> {name}' and holds no data to read", prim.expr,
                           name=name)
        self.fresh.pop(name, None)
        assert isinstance(b, TensorDesc)
        return b

    def _check_piece(self, p: Primitive, name: str, size: int, count: int, shape: Sequence[int]) -> None:
        """Every head/block piece of one fused statement has the same extent along its axis: a q of 8 heads x 4
        rows and a k of 2 heads x 4 rows under ``num_key_value_groups=4`` would otherwise be cut into 2-row
        pieces and loaded silently wrong."""
        root = p.expr.parent if p.expr.parent is not None else p.expr
        first = self._pieces.setdefault(id(root), (size, name, count, tuple(shape), root))
        if first[0] == size:
            return
        size0, name0, count0, shape0, _ = first
        what = {"fused_qkv": "head", "fused_qkv_old": "head"}.get(p.expr.stage, "block")

        def desc(n: str, sz: int, cnt: int, sh: tuple) -> str:
            return (f"{n!r} (shape {list(sh)}) gives {cnt} {what}s of {sz}" if cnt > 1
                    else f"a piece of {n!r} has extent {sz}")
        raise AOAError(f"{p.expr.stage}: {what} sizes disagree: {desc(name0, size0, count0, shape0)}, but "
                       f"{desc(name, size, count, tuple(shape))} along the fused axis"
                       + _fused_hint(p.expr), root, name=name)

    def _reshape_target(self, p: Primitive, d: TensorDesc) -> tuple[int, ...]:
        """The concrete target shape of reshape ``p`` applied to ``d`` (-1 inferred from the element count).

        Raises:
            AOAError: element counts differ, or (reverse mode) the shape to go back to is unknown.
        """
        shape = p.shape
        if shape is None:  # an inverted reshape whose input the statements do not determine
            spec = self.dst_specs.get(p.rhs[0])
            if spec is None:
                raise AOAError(f"reverse mode: the inverse of this reshape must give {p.rhs[0]!r} back the shape it "
                               f"had before, but no statement determines that shape and {p.rhs[0]!r} is not a "
                               f"destination key; write it on the statement: \"..., reshape='{list(p.src_shape or ())}"
                               f"', src_shape='[...]'\"", p.expr, name="reshape")
            shape = tuple(spec.shape)
        total = numel(d.shape)
        if -1 in shape:
            rest = numel([n for n in shape if n != -1])
            if rest == 0 or total % rest:
                raise AOAError(f"cannot reshape {p.lhs[0]!r} of shape {list(d.shape)} ({total} elements) to "
                               f"{list(shape)}: {total} is not a multiple of {rest}", p.expr, name="reshape")
            shape = tuple(total // rest if n == -1 else n for n in shape)
        if numel(shape) != total:
            raise AOAError(f"cannot reshape {p.lhs[0]!r} of shape {list(d.shape)} ({total} elements) to "
                           f"{list(shape)} ({numel(shape)} elements): element counts differ", p.expr,
                           name="reshape")
        return shape

    def bind(self, name: str, desc: object) -> None:
        self.env[name] = desc
        self.fresh.pop(name, None)
        if isinstance(desc, TensorDesc):
            self.fresh[name] = None

    def run(self, p: Primitive) -> None:
        if p.kind == "rename" and p.axis is None:  # the most common statement: a fast path
            b = self.env.get(p.lhs[0], _MISSING)
            d = b if isinstance(b, TensorDesc) else self.get(p.lhs[0], p)
            self.fresh.pop(p.lhs[0], None)
            self.bind(p.rhs[0], d)
            return
        e = p.expr
        if p.kind == "create":
            for r in p.rhs:
                self.bind(r, _VOID)
                self.created[r] = None
            return
        if p.kind == "delete":
            for n in p.lhs:
                self.get(n, p)
                if (n in self.model_src or n in self.states) and n not in self.env:
                    self.deleted[n] = None
                self.bind(n, _Deleted(p))
            return
        if p.kind == "concat":
            parts = [self.get(n, p) for n in p.lhs]
            nd = len(parts[0].shape)
            ax = _norm_axis(p.axis, nd, p.lhs[0], p)
            if e.stage in _FUSED_STAGES:
                for n, d in zip(p.lhs, parts):
                    if len(d.shape) == nd:
                        self._check_piece(p, n, d.shape[ax], 1, d.shape)
            for n, d in zip(p.lhs, parts):
                if d.dtype != parts[0].dtype:
                    raise AOAError(f"All tensors must have the same dtype! {p.lhs[0]!r} is {parts[0].dtype} but "
                                   f"{n!r} is {d.dtype}", e, name=n)
                if len(d.shape) != nd or any(a != b for i, (a, b) in enumerate(zip(d.shape, parts[0].shape))
                                             if i != ax):
                    raise AOAError(f"cannot concatenate along axis {p.axis}: {p.lhs[0]!r} has shape "
                                   f"{list(parts[0].shape)} but {n!r} has shape {list(d.shape)}", e, name=n)
            self.bind(p.rhs[0], TensorDesc.concat(parts, ax, e))
            return
        d = self.get(p.lhs[0], p)
        if p.kind == "split":
            ax = _norm_axis(p.axis, len(d.shape), p.lhs[0], p)
            n = len(p.rhs)
            if d.shape[ax] % n:
                raise AOAError(f"cannot split {p.lhs[0]!r} of shape {list(d.shape)} into {n} equal parts along axis "
                               f"{p.axis} ({d.shape[ax]} is not divisible by {n})"
                               + (_fused_hint(e) if e.stage in _FUSED_STAGES else ""), e, name=p.lhs[0])
            step = d.shape[ax] // n
            if e.stage in _FUSED_STAGES:
                self._check_piece(p, p.lhs[0], step, n, d.shape)
            for i, r in enumerate(p.rhs):
                self.bind(r, d.slice(ax, i * step, (i + 1) * step, e))
        elif p.kind == "rename":
            if p.axis is not None:
                ax = _norm_axis(p.axis, len(d.shape), p.lhs[0], p)
                if e.stage in _FUSED_STAGES:
                    self._check_piece(p, p.lhs[0], d.shape[ax], 1, d.shape)
            self.bind(p.rhs[0], d)
        elif p.kind == "permute":
            nd = len(d.shape)
            q = tuple(range(nd))[::-1] if p.perm is None else tuple(a % nd if -nd <= a < nd else a for a in p.perm)
            if sorted(q) != list(range(nd)):
                raise AOAError(f"permute={list(p.perm or ())} is not a permutation of the {nd} axes of "
                               f"{p.lhs[0]!r} (shape {list(d.shape)})", e, name="permute")
            self.bind(p.rhs[0], d.permute(q, e))
        elif p.kind == "reshape":
            want = p.src_shape
            if want is not None and (len(want) != len(d.shape) or any(w not in (-1, n) for w, n in zip(want, d.shape))):
                raise AOAError(f"{p.lhs[0]!r} has shape {list(d.shape)}, but the statement says src_shape="
                               f"'{list(want)}'", e, name=p.lhs[0])
            self.bind(p.rhs[0], d.reshape(self._reshape_target(p, d), e, p.lhs[0]))
        elif p.kind == "cast":
            if p.src_dtype is not None and d.dtype != p.src_dtype:
                raise AOAError(f"{p.lhs[0]!r} is {d.dtype}, but the statement says src_dtype='{p.src_dtype}'", e,
                               name=p.lhs[0])
            self.bind(p.rhs[0], d.cast(p.dtype, e) if p.dtype is not None else d)
        else:  # pragma: no cover
            raise AssertionError(p.kind)


def _pattern_keys(keys: Sequence[str]) -> KeySet:
    """What patterns match: the model-level keys, then the optimizer-state keys themselves (a template such as
    ``model.*.exp_avg`` matches those; placeholders and ``*`` stand for digits only, so a template without the
    suffix never matches a state key)."""
    model, states = [], []
    split = optimizer_splitter(keys)
    for k in keys:
        base, suf = split(k)
        model.append(base)
        if suf:
            states.append(k)
    return KeySet(model + states)


def expand_statements(aoa_config: object, source_keys: Sequence[str], destination_keys: Sequence[str] | None = None,
                      *, source_shards: Mapping[str, int] | None = None,
                      destination_shards: Mapping[str, int] | None = None,
                      layouts: dict[str, dict] | None = None) -> list[Expr]:
    """Parse and macro-expand ``aoa_config`` against key names only (no shapes): the primitive statements
    as written, before reverse-mode inversion. ``*_shards``: TP shard count per key for ``fused_qkv_old`` and
    ``fused_ffn`` (1 where absent). ``layouts``, if given, receives ``{name: {"statement", "tp", "axis", ...}}``
    for every destination-side name a TP-dependent fused statement writes.

    Raises:
        AOASyntaxError, AOAError: see :func:`compile_aoa`.
    """
    statements, reverse = normalize_config(aoa_config)
    exprs = parse_statements(statements)
    src = _pattern_keys(source_keys)
    dst = _pattern_keys(destination_keys) if destination_keys is not None else None
    ctx = MacroContext(src, dst, reverse, fold_shard_counts(source_shards), fold_shard_counts(destination_shards))
    out = expand_macros(exprs, ctx)
    if layouts is not None:
        layouts.update(ctx.layouts)
    return out


def compile_aoa(aoa_config: object, source: Mapping[str, TensorSpec],
                destination: Mapping[str, TensorSpec] | None = None, *,
                source_shards: Mapping[str, int] | None = None, destination_shards: Mapping[str, int] | None = None,
                allow_cast: bool = False) -> AOAProgram:
    """Compile an AOA config into slice mappings (the language: docs/aoa.md).

    Args:
        aoa_config: ``{"aoa_statements": [str, ...], "aoa_config_reverse": bool}`` or a list of statement strings.
        source: checkpoint key -> global :class:`TensorSpec`; optimizer states ``<model_key><suffix>`` (see
            :data:`~oarlock.checkpoint.aoa.macros.OPTIMIZER_SUFFIXES`) follow the statements of ``<model_key>``.
        destination: model key -> spec, or None for the program's dataflow sinks (export / ``full()``).
        source_shards, destination_shards: TP shard count per key (distinct global offsets of its shards), used
            by ``fused_qkv_old`` and ``fused_ffn``; 1 where absent. See :func:`shard_counts`.
        allow_cast: cast to the destination dtype instead of failing when no AOA cast makes dtypes agree.

    Returns:
        An :class:`AOAProgram` (implements ``MappingProgram``): destination keys are the ``destination`` keys
        that some statement or identically named source key provides (others are listed in ``missing``;
        ``_ -> key`` ones in ``skipped``).

    Raises:
        AOASyntaxError: lexing/parsing/macro errors, naming the statement, column and macro expansion chain.
        AOAError: semantic errors (unknown name, zero-match pattern, indivisible split, concat dtype/shape
            mismatch, destination shape or dtype mismatch, ...), naming the statement, column and macro
            expansion chain.
    """
    # Compilation allocates ~10 small acyclic objects per key; the cyclic GC would rescan them all again and
    # again (a third of the time on 50,000 keys), so it is paused while compiling. One young-generation pass at
    # the end moves the program's objects out of the young generations at once; otherwise the first calls of
    # mappings_for() would pay for that, several times over.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _compile(aoa_config, source, destination, source_shards, destination_shards, allow_cast)
    finally:
        if enabled:
            gc.enable()
            gc.collect(1)


def _canonical_specs(specs: Mapping[str, TensorSpec], what: str) -> dict[str, TensorSpec]:
    """Specs with canonical dtype names (``"float32"``, not ``"F32"`` or ``"torch.float32"``)."""
    names: dict[str, str] = {}
    out = {}
    for k, sp in specs.items():
        dt = names.get(sp.dtype)
        if dt is None:
            try:
                dt = names[sp.dtype] = dtype_name(sp.dtype)
            except ValueError as e:
                raise AOAError(f"{what} key {k!r}: {e}") from None
        out[k] = sp if dt == sp.dtype else TensorSpec(tuple(sp.shape), dt)
    return out


def _compile(aoa_config: object, source: Mapping[str, TensorSpec], destination: Mapping[str, TensorSpec] | None,
             source_shards: Mapping[str, int] | None, destination_shards: Mapping[str, int] | None,
             allow_cast: bool) -> AOAProgram:
    _, reverse = normalize_config(aoa_config)
    source = _canonical_specs(source, "source")
    if destination is not None:
        destination = _canonical_specs(destination, "destination")
    model_src, states = fold_optimizer_keys(source)
    dst_model = None
    split_dst = optimizer_splitter(destination or {})
    if destination is not None:
        dst_model = [split_dst(k)[0] for k in destination]
    layouts: dict[str, dict] = {}
    exprs = expand_statements(aoa_config, list(source), dst_model, source_shards=source_shards,
                              destination_shards=destination_shards, layouts=layouts)
    memo: dict = {}
    prims = [classify(e, memo) for e in split_compound(exprs)]
    if reverse:
        prims = invert(prims)
    prog = AOAProgram(source, reverse, prims)
    ex = _Executor(model_src, KeySet(model_src), {k: v for k, v in source.items() if k not in model_src},
                   {k: v for k, v in (destination or {}).items() if not split_dst(k)[1]})
    for p in prims:
        ex.run(p)
    # a dropped model key takes its optimizer states along
    prog.deleted = list(ex.deleted) + [k + s for k in ex.deleted for s in states.get(k, ()) if k + s not in ex.deleted]

    def resolve(key: str) -> TensorDesc | None | str:
        b = ex.env.get(key, _MISSING)
        if b is _MISSING:
            return TensorDesc.source(key, model_src[key]) if key in model_src else "no statement or source key " \
                "provides it"
        if b is _VOID:
            return None
        if isinstance(b, _Deleted):
            return f"deleted by '{b.prim.render()}'"
        return b  # type: ignore[return-value]

    if destination is None:
        sinks = [k for k in model_src if k not in ex.env and k not in ex.read_sources] + list(ex.fresh)
        wanted: list[tuple[str, str, str]] = []
        for k in sinks:
            wanted.append((k, k, ""))
            d = resolve(k)
            if isinstance(d, TensorDesc):
                srcs = {r.src_key for r in d.refs}
                sufs = dict.fromkeys(s for sk in srcs for s in states.get(sk, ()))
                for s in sufs:
                    ok = any if s in SCALAR_SUFFIXES else all
                    if any(sk + s in ex.deleted or sk + s in ex.read_sources for sk in srcs):
                        continue  # dropped, or moved by a statement of its own
                    if ok(sk + s in source for sk in srcs):
                        wanted.append((k + s, k, s))
        prog.skipped = [k for k in ex.created if ex.env.get(k) is _VOID]
    else:
        wanted = []
        for k in destination:
            if k in ex.env or k in model_src:
                wanted.append((k, k, ""))
            else:
                base, suf = split_dst(k)
                wanted.append((k, base, suf) if suf else (k, k, ""))
    reached: set[str] = set()
    for key, model_key, suf in wanted:
        d = resolve(model_key)
        if d is None or (isinstance(d, str) and d.startswith("deleted by")) or \
                (suf and isinstance(d, TensorDesc) and any(r.src_key + suf in ex.deleted for r in d.refs)):
            # '_ -> key', or named like a key dropped with 'key -> _': deliberately not loaded
            prog.skipped.append(key) if key not in prog.skipped else None
            continue
        if isinstance(d, str):
            prog.missing[key] = d
            continue
        if not suf and model_key not in source and any(r.src_key not in source for r in d.refs):
            lack = next(r.src_key for r in d.refs if r.src_key not in source)
            prog.missing[key] = f"source key {lack!r} exists only through its optimizer states"
            continue
        if suf and suf not in SCALAR_SUFFIXES:
            lack = [r.src_key + suf for r in d.refs if r.src_key + suf not in source]
            if lack:
                prog.missing[key] = f"source optimizer state {lack[0]!r} does not exist"
                continue
        if suf in SCALAR_SUFFIXES:
            srcs = list(dict.fromkeys(r.src_key + suf for r in d.refs if r.src_key + suf in source))
            if not srcs:
                prog.missing[key] = f"no source holds a {suf} accumulator for {model_key!r}"
                continue
            if len(srcs) > 1:
                warnings.warn(f"AOA: {key!r} gathers several sources; its accumulator is taken from {srcs[0]!r}")
            sspec = source[srcs[0]]
            spec = destination[key] if destination is not None else sspec
            if tuple(spec.shape) != tuple(sspec.shape):
                raise AOAError(f"destination {key!r} has shape {list(spec.shape)} but its source accumulator "
                               f"{srcs[0]!r} has shape {list(sspec.shape)}")
            prog._entries[key] = _Entry(d, suf, TensorSpec(tuple(spec.shape), spec.dtype),
                                        spec.dtype if spec.dtype != sspec.dtype else None)
            reached.update(r.src_key for r in d.refs)
            continue
        if suf:
            for r in d.refs:
                sshape = source[r.src_key + suf].shape
                if r.src_key in model_src and tuple(sshape) != tuple(model_src[r.src_key].shape):
                    raise AOAError(f"optimizer state {r.src_key + suf!r} has shape {list(sshape)} but its parameter "
                                   f"{r.src_key!r} has shape {list(model_src[r.src_key].shape)}")
            state_dtype = source[d.refs[0].src_key + suf].dtype if d.refs else d.dtype
        cast_all = None
        if destination is not None:
            spec = destination[key]
            if tuple(spec.shape) != tuple(d.shape):
                raise AOAError(
                    f"destination {key!r} does not match the tensor AOA computes for it: current model param slice "
                    f"range: {_fmt_range(spec.shape)}, preloaded weights param slice range: {_fmt_range(d.shape)}. "
                    "Please check the AOA statements (a missing '^T', a wrong split/concat axis?)",
                    d.expr, name=model_key)
            dtype = dtype_name(spec.dtype)
            if not suf and dtype != d.dtype:
                if not (reverse or allow_cast):
                    raise AOAError(f"{key!r}: the source is {d.dtype} but the destination is {dtype}; direct "
                                   "assignment of tensors of different types is prohibited, add an AOA cast "
                                   f"(\"{model_key} -> {model_key}, dtype='{dtype}'\")", d.expr, name=model_key)
                cast_all = dtype
        else:
            dtype = state_dtype if suf else d.dtype
        prog._entries[key] = _Entry(d, suf, TensorSpec(tuple(d.shape), dtype), cast_all)
        for r in d.refs:
            reached.add(r.src_key)
    # '_ -> key' over a source that stores 'key' too: that stored tensor (and its optimizer states) is
    # deliberately not loaded, which is what '_' says, so it is dropped rather than left "unexpected"
    voided = [k for k in model_src if ex.env.get(k) is _VOID and k not in ex.read_sources and k not in ex.deleted]
    prog.deleted += [n for k in voided for n in (k, *(k + s for s in states.get(k, ()))) if n not in prog.deleted]
    prog.unused_sources = [k for k in model_src if k not in reached and k not in ex.deleted and k not in voided]
    prog.tp_layouts = {k: v for k, v in layouts.items() if k in prog._entries}
    return prog
