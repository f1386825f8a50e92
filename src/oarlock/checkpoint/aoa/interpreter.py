"""The AOA interpreter: runs primitive statements over :class:`~oarlock.checkpoint.aoa.desc.TensorDesc` bindings,
checking every statement against the shapes and dtypes it meets (errors name the statement and column)."""

from __future__ import annotations

import difflib
from typing import Mapping, Sequence

from oarlock.checkpoint.aoa.desc import TensorDesc
from oarlock.checkpoint.aoa.errors import AOAError
from oarlock.checkpoint.aoa.macros import KeySet
from oarlock.checkpoint.aoa.parser import Expr
from oarlock.checkpoint.aoa.primitives import Primitive
from oarlock.checkpoint.model.boxes import numel
from oarlock.checkpoint.model.mapping import TensorSpec


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


class Interpreter:
    """The environment of one compilation: every name a statement wrote (a :class:`TensorDesc`, a deletion or a
    source-less declaration), the source keys read, deleted and created, and the fused statements' piece sizes.

    Args:
        model_src: model-level source specs; ``keys``: the same keys as a :class:`KeySet` (for "closest names").
        states: optimizer-state source keys, readable when a statement names one explicitly.
        dst_specs: model-level destination specs: the shape an inverted reshape goes back to.
        reshape_limit: the most slice mappings one ``reshape=`` may produce.
    """

    def __init__(self, model_src: dict[str, TensorSpec], keys: KeySet, states: Mapping[str, TensorSpec] = {},
                 dst_specs: Mapping[str, TensorSpec] | None = None, reshape_limit: int | None = None):
        self.reshape_limit = reshape_limit
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

    def resolve(self, key: str) -> TensorDesc | None | str:
        """What ``key`` holds after the statements: its :class:`TensorDesc` (an untouched source key's own), None
        when declared source-less (``_ -> key``), or why it holds nothing (a message)."""
        b = self.env.get(key, _MISSING)
        if b is _MISSING:
            return TensorDesc.source(key, self.model_src[key]) if key in self.model_src else "no statement or " \
                "source key provides it"
        if b is _VOID:
            return None
        if isinstance(b, _Deleted):
            return f"deleted by '{b.prim.render()}'"
        return b  # type: ignore[return-value]

    def is_void(self, name: str) -> bool:
        """``name`` was declared source-less (``_ -> name``) and not written since."""
        return self.env.get(name) is _VOID

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
            self.bind(p.rhs[0], d.reshape(self._reshape_target(p, d), e, p.lhs[0], self.reshape_limit))
        elif p.kind == "cast":
            if p.src_dtype is not None and d.dtype != p.src_dtype:
                raise AOAError(f"{p.lhs[0]!r} is {d.dtype}, but the statement says src_dtype='{p.src_dtype}'", e,
                               name=p.lhs[0])
            self.bind(p.rhs[0], d.cast(p.dtype, e) if p.dtype is not None else d)
        else:  # pragma: no cover
            raise AssertionError(p.kind)
