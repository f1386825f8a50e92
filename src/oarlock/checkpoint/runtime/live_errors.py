"""Errors of a live reshard said in the user's terms (``docs/live-resharding.md``, "Failure and verification").

A mismatch between what the targets want and what the sources give is reported with the keys on both sides and
their shapes and dtypes (``[768, 256] float32``), not with the slice ranges of the AOA engine, and quotes an AOA
statement only when the user wrote it: statements a helper generated (a config dict lists them under
:data:`GENERATED_KEY`) are not shown. Every error a live reshard raises before any byte moves becomes a
:class:`~oarlock.checkpoint.errors.PlanError` that keeps its own class (:func:`as_plan_error`).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from oarlock.checkpoint.errors import CheckpointError, CheckpointMismatchError, PlanError
from oarlock.checkpoint.model.mapping import TensorSpec

#: Key of an AOA config dict listing the statements the user did not write: ``[[start, stop, "made by"], ...]``
#: (statement indices ``start <= i < stop``; e.g. the casts ``oarlock.integrations.vllm.with_casts`` appends).
GENERATED_KEY = "generated_statements"

_PLAN_CLASSES: dict[type, type] = {}


def _plan_class(base: type) -> type:
    cls = _PLAN_CLASSES.get(base)
    if cls is None:
        cls = _PLAN_CLASSES[base] = type(base.__name__, (PlanError, base), {
            "__module__": base.__module__, "__qualname__": base.__qualname__,
            "__reduce__": lambda self: (_rebuild, (base, self.args, dict(self.__dict__)))})
    return cls


def _rebuild(base: type, args: tuple, state: dict) -> BaseException:
    err = _plan_class(base).__new__(_plan_class(base), *args)
    err.args = args
    err.__dict__.update(state)
    return err


def as_plan_error(e: Exception) -> Exception:
    """``e`` as a :class:`PlanError` that is still an instance of ``e``'s class (same message and attributes);
    ``e`` itself when it is one already or its class cannot be combined (a non-oarlock error becomes a plain
    ``PlanError`` naming it)."""
    if isinstance(e, PlanError):
        return e
    if not isinstance(e, CheckpointError):
        out: Exception = PlanError(f"{type(e).__name__}: {e}")
    else:
        out = _rebuild(type(e), e.args, dict(e.__dict__))
    out.__cause__, out.__suppress_context__ = e.__cause__, True
    return out.with_traceback(e.__traceback__)


def _shape(shape: Any) -> str:
    return "[" + ", ".join(str(int(x)) for x in shape) + "]"


#: ``key -> key, dtype='...'``: a statement that only casts (it cannot be the cause of a shape mismatch).
_CAST_ONLY = re.compile(r"""^\s*([^\s,]+)\s*->\s*\1\s*,\s*dtype\s*=\s*(['"])[\w.]+\2\s*$""")


def user_statement(cfg: Any, index: int | None, text: str | None, shape: bool = False) -> str:
    """How to name AOA statement ``index`` of ``cfg`` in an error: ``""`` for a generated one (or none), and for
    a statement that only casts when the error is about a shape."""
    if index is None or not isinstance(index, int) or (shape and text and _CAST_ONLY.match(text)):
        return ""
    if isinstance(cfg, Mapping):
        for start, stop, *_ in cfg.get(GENERATED_KEY) or ():
            if int(start) <= index < int(stop):
                return ""
        if cfg.get("preset"):
            return f"; made by statement [{index}] of AOA preset {cfg['preset']!r}: {text}"
    return f"; made by your AOA statement [{index}]: {text}"


def _would_be(sources: list, specs: Mapping[str, TensorSpec], wanted: tuple, got: tuple) -> str:
    """``"each would have to be [512, 256]"`` when the shapes differ along one axis that whole source tensors are
    stacked on, else ``""``."""
    axes = [a for a, (x, y) in enumerate(zip(wanted, got)) if x != y]
    if len(axes) != 1 or len(wanted) != len(got):
        return ""
    a = axes[0]
    shapes = set()
    for key, box, perm in sources:
        spec = specs.get(key)
        if spec is None or tuple(b - o for o, b in box) != tuple(spec.shape):
            return ""  # a slice of a source: no per-source size follows
        sa = perm[a] if perm is not None else a
        if (spec.shape[sa] * wanted[a]) % got[a]:
            return ""
        s = list(spec.shape)
        s[sa] = spec.shape[sa] * wanted[a] // got[a]
        shapes.add(tuple(s))
    if len(shapes) != 1:
        return ""
    (s,) = shapes
    names = {k for k, _, _ in sources}
    if len(names) == 1 and s == tuple(wanted):
        return ""
    return f" (to give {_shape(wanted)}, {'each' if len(names) > 1 else 'it'} would have to be {_shape(s)})"


def mismatch_error(e: Exception, cfg: Any, specs: Mapping[str, TensorSpec]) -> CheckpointMismatchError | None:
    """The AOA engine's destination mismatch ``e`` (its ``mismatch`` attribute) said in the user's terms; None
    for other errors."""
    info = getattr(e, "mismatch", None)
    if info is None:
        return None
    key, (wshape, wdtype), (gshape, gdtype), sources = info
    names = list(dict.fromkeys(k for k, _, _ in sources))
    parts = [f"{k!r} {_shape(specs[k].shape)} {specs[k].dtype}" if k in specs else repr(k) for k in names]
    made = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    where = user_statement(cfg, getattr(e, "statement_index", None), getattr(e, "statement", None),
                           shape=tuple(wshape) != tuple(gshape))
    if tuple(wshape) != tuple(gshape):
        what = (f"target {key!r} is {_shape(wshape)} {wdtype}, but the source key{'s' if len(names) > 1 else ''} "
                f"it is made from, {made}, give{'' if len(names) > 1 else 's'} {_shape(gshape)}"
                f"{_would_be(sources, specs, tuple(wshape), tuple(gshape))}: the two sides hold models of "
                "different sizes (a hidden or intermediate size, a head count, a vocabulary?) or the AOA config "
                "maps them wrongly")
    else:
        what = (f"target {key!r} is {wdtype}, but the source key{'s' if len(names) > 1 else ''} it is made from, "
                f"{made}, give{'' if len(names) > 1 else 's'} {gdtype}; casts happen only on request: add "
                f"\"{names[0]} -> {key}, dtype='{wdtype}'\" to the AOA config" if len(names) == 1 else
                f"target {key!r} is {wdtype}, but the source keys it is made from, {made}, give {gdtype}; casts "
                f"happen only on request: add \"{key} -> {key}, dtype='{wdtype}'\" to the AOA config")
    return CheckpointMismatchError(f"live reshard: {what}{where}")


def identity_mismatch(dest: Mapping[str, TensorSpec], specs: Mapping[str, TensorSpec]) -> None:
    """Without an AOA config a key has the same global shape and dtype on both sides: raise naming every key that
    does not (both shapes and dtypes)."""
    bad = []
    for k, want in dest.items():
        have = specs.get(k)
        if have is None or (tuple(have.shape) == tuple(want.shape) and have.dtype == want.dtype):
            continue
        bad.append(f"{k!r}: target {_shape(want.shape)} {want.dtype}, source {_shape(have.shape)} {have.dtype}")
    if not bad:
        return
    casts = [k for k, want in dest.items() if k in specs and tuple(specs[k].shape) == tuple(want.shape)
             and specs[k].dtype != want.dtype]
    hint = (f"; casts happen only on request: aoa_config=[\"{casts[0]} -> {casts[0]}, dtype='{dest[casts[0]].dtype}'\""
            ", ...]" if casts else "; to map one shape onto another (transpose, split, concat) pass an aoa_config")
    more = f" (and {len(bad) - 8} more)" if len(bad) > 8 else ""
    raise CheckpointMismatchError("live reshard: the targets do not match the sources: " + "; ".join(bad[:8]) + more
                                  + hint)
