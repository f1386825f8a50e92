"""Primitive statements of the AOA language (docs/aoa.md, "Primitive statements", "Reverse mode"): a macro-expanded
statement checked against the primitive forms (:func:`classify`), compound ``reshape=`` statements cut into a chain
of one-operator statements (:func:`split_compound`), and the inverse program (:func:`invert`)."""

from __future__ import annotations

from dataclasses import dataclass

from oarlock.checkpoint.aoa.errors import AOAError, AOASyntaxError
from oarlock.checkpoint.aoa.parser import VOID, Expr
from oarlock.utils import dtype_name

_ATTRS = ("axis", "dtype", "permute", "src_dtype", "dst_dtype", "reshape", "src_shape")


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
