"""Helpers shared by every oarlock package: dtype names, progress bars, logging.

Keep this module small and dependency-free (torch, tqdm only): each capability package imports it.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import math
import os
import pickle
import sys
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch

T = TypeVar("T")

logger = logging.getLogger("oarlock")

# Framework-neutral dtype names (``docs/checkpoint-format.md``) <-> torch dtypes <-> safetensors codes.
_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float64": (torch.float64, "F64"),
    "float32": (torch.float32, "F32"),
    "float16": (torch.float16, "F16"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "int64": (torch.int64, "I64"),
    "int32": (torch.int32, "I32"),
    "int16": (torch.int16, "I16"),
    "int8": (torch.int8, "I8"),
    "uint8": (torch.uint8, "U8"),
    "uint16": (torch.uint16, "U16"),
    "uint32": (torch.uint32, "U32"),
    "uint64": (torch.uint64, "U64"),
    "bool": (torch.bool, "BOOL"),
    "float8_e4m3fn": (torch.float8_e4m3fn, "F8_E4M3"),
    "float8_e5m2": (torch.float8_e5m2, "F8_E5M2"),
    "complex64": (torch.complex64, "C64"),
}
_BY_TORCH = {v[0]: k for k, v in _DTYPES.items()}
_BY_ST = {v[1]: k for k, v in _DTYPES.items()}
_NAME_CACHE: dict = {**{k: k for k in _DTYPES}, **_BY_TORCH}
_ITEMSIZE: dict = {**{k: v[0].itemsize for k, v in _DTYPES.items()}, **{v[0]: v[0].itemsize for v in _DTYPES.values()}}
_ALIASES = {"float": "float32", "half": "float16", "double": "float64", "bf16": "bfloat16", "fp16": "float16",
            "fp32": "float32", "long": "int64", "int": "int32"}


def dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical dtype name (``"float32"``, ``"bfloat16"``, ...) of a torch dtype, a name, an alias or a
    safetensors code (``"F32"``). Raises ``ValueError`` naming the unknown dtype."""
    try:  # called per shard and per read item: the common answers are one lookup
        hit = _NAME_CACHE.get(dtype)
    except TypeError:  # unhashable: not a dtype; the message below names it
        hit = None
    if hit is not None:
        return hit
    if isinstance(dtype, torch.dtype):
        if dtype in _BY_TORCH:
            return _BY_TORCH[dtype]
        raise ValueError(f"dtype {dtype} is not supported by oarlock checkpoints")
    s = str(dtype)
    if s.startswith("torch."):
        s = s[len("torch."):]
    s = _ALIASES.get(s, s)
    if s in _DTYPES:
        return s
    if s in _BY_ST:
        return _BY_ST[s]
    raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(_DTYPES))}")


def torch_dtype(name: torch.dtype | str) -> torch.dtype:
    """The torch dtype for a canonical name, alias or safetensors code."""
    return _DTYPES[dtype_name(name)][0]


def safetensors_code(name: torch.dtype | str) -> str:
    """The safetensors header code (``"F32"``, ``"BF16"``, ...) for a dtype."""
    return _DTYPES[dtype_name(name)][1]


def dtype_itemsize(name: torch.dtype | str) -> int:
    """Bytes per element."""
    try:
        hit = _ITEMSIZE.get(name)
    except TypeError:
        hit = None
    return hit if hit is not None else torch_dtype(name).itemsize


def numel(shape: Iterable[int]) -> int:
    """Number of elements of a shape (1 for a scalar ``()``)."""
    return math.prod(shape)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector inside the block (restored after; nested uses are free).

    Why: planning a load creates millions of small tuples (read items) that hold no cycles; every 700 allocations
    the collector walks the young objects, and its older generations re-walk everything built so far, which made
    up 60% of a 288,000-item plan's time (``benchmarks/scale.py``, FSDP -> TP8 at 1024 ranks)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def submit(pool: Any, fn: Callable[..., T], *args: Any) -> Any:
    """``pool.submit(fn, *args)`` (a ``concurrent.futures`` executor), or, once the interpreter has begun to exit,
    ``fn(*args)`` run in the calling thread with its outcome in a finished ``Future``.

    Why: Python ends every ``concurrent.futures`` pool before ``atexit`` hooks run, and from then on ``submit``
    raises ``RuntimeError``; an asynchronous save started on a script's last line finishes after that point (its
    ``atexit`` hook waits for the commit), and its writes, uploads and hashing still have to run.

    Raises:
        RuntimeError: from ``pool.submit`` when the pool itself was shut down and the interpreter is not exiting.
    """
    from concurrent.futures import Future
    from concurrent.futures import thread as cf_thread

    try:
        return pool.submit(fn, *args)
    except RuntimeError:
        if not getattr(cf_thread, "_shutdown", False):
            raise
    fut: Future = Future()
    try:
        fut.set_result(fn(*args))
    except BaseException as e:  # delivered by result(), as the pool would
        fut.set_exception(e)
    return fut


def balanced_range(n: int, parts: int, index: int) -> range:
    """The ``index``-th of ``parts`` contiguous near-equal ranges of ``range(n)`` (the first ``n % parts`` get one
    more): the one split rule for pipeline stages (layers) and expert-parallel ranks (experts)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


def stage_of_layer(layer: int, num_layers: int, pp: int) -> int:
    """Pipeline stage holding ``layer`` of ``num_layers`` when they are split by :func:`balanced_range` over ``pp``
    stages (10 layers on 4 stages: 3, 3, 2, 2)."""
    base, extra = divmod(num_layers, pp)
    big = extra * (base + 1)  # layers held by the first `extra` stages, one more each
    return layer // (base + 1) if layer < big else extra + (layer - big) // max(base, 1)


def progress(iterable: Iterable[T], *, desc: str, total: int | None = None, unit: str = "it",
             unit_scale: bool = False, disable: bool | None = None) -> Iterator[T]:
    """Wrap an iterable in a tqdm progress bar on stderr.

    Bars are shown only on a terminal unless ``OARLOCK_PROGRESS=1``; ``OARLOCK_PROGRESS=0`` hides them.
    """
    from tqdm.auto import tqdm

    if disable is None:
        env = os.environ.get("OARLOCK_PROGRESS")
        disable = (env == "0") if env is not None else not sys.stderr.isatty()
    return iter(tqdm(iterable, desc=desc, total=total, unit=unit, unit_scale=unit_scale, disable=disable,
                     file=sys.stderr, dynamic_ncols=True, leave=False))


class _ArrayState:
    """Stand-in for an array under construction (numpy's ``_reconstruct`` followed by BUILD): keeps the state
    until :meth:`AllowlistUnpickler.load` checks it and builds the array from its bytes."""

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _DtypeState:
    """Stand-in for a numpy dtype under construction (``numpy.dtype(spec, align, copy)`` then BUILD)."""

    def __init__(self, spec: Any):
        self.spec, self.state = spec, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"dtype({self.spec!r})"


_MAX_NESTING = 200  # containers nested deeper than this in a pickle are refused


class AllowlistUnpickler(pickle.Unpickler):
    """A :class:`pickle.Unpickler` that resolves a global only when ``admit(module, name)`` returns it.

    Plain containers, strings and numbers never reach ``find_class``, so ``admit=lambda m, n: None`` reads
    pure-data pickles (PyTorch memory snapshots) and refuses everything else. A refused global raises
    ``refuse(message)`` (the caller's own error class) before any code runs.

    numpy is never trusted, whatever ``admit`` returns: arrays (``ndarray``, ``_reconstruct`` + state),
    scalars and dtypes are built by this class from checked values, never by numpy's own unpickling code, so that
    file bytes can never become pointers: only plain numeric/bool dtypes (no object, structured, sub-array or
    string dtypes), byte buffers exactly as long as the shape says (a huge shape with few bytes is refused before
    any allocation), no ndarray subclasses; any other numpy global is refused. Containers nested more than
    200 deep are refused too.
    """

    def __init__(self, file: Any, admit: Callable[[str, str], Any], refuse: Callable[[str], Exception],
                 source: str = "<pickle>", admitted_desc: str = "plain containers"):
        super().__init__(file)
        self._admit, self._refuse, self._source, self._desc = admit, refuse, source, admitted_desc
        self._stand_ins = 0

    def find_class(self, module: str, name: str) -> Any:
        obj = self._admit(module, name)
        if obj is None:
            raise self._refuse(f"{self._source}: refuses to unpickle {module}.{name} "
                               f"(only {self._desc} are admitted)")
        if module == "numpy" or module.startswith("numpy."):
            return self._numpy_stand_in(obj, f"{module}.{name}")
        return obj

    def load(self) -> Any:
        # A hostile length (BYTEARRAY8 of 2**56 bytes) makes the C unpickler's allocation fail with MemoryError, and
        # CPython then prints "SystemError: deallocated bytearray object has exported buffers" to sys.stderr from
        # the failed buffer's deallocation: noise beside the error the caller reports. What the load prints is
        # held and passed on, without that line.
        held = io.StringIO()
        try:
            with contextlib.redirect_stderr(held):
                obj = super().load()
        finally:
            noise = "".join(line for line in held.getvalue().splitlines(keepends=True)
                            if "has exported buffers" not in line)
            if noise:
                sys.stderr.write(noise)
        if self._stand_ins:
            try:
                obj = self._finish(obj, {}, 0)
            except RecursionError:
                raise self._refuse(f"{self._source}: nested too deeply") from None
        return obj

    # ------------------------------------------------------------ numpy, rebuilt from checked values

    def _bad(self, what: str) -> Exception:
        return self._refuse(f"{self._source}: refuses {what} (only arrays of plain numeric dtypes are built; "
                            "object arrays would let file bytes become pointers)")

    def _numpy_stand_in(self, obj: Any, qualname: str) -> Any:
        import numpy as np

        multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
        if obj is np.ndarray:
            return self._ndarray
        if obj is getattr(multiarray, "_reconstruct", None):
            return self._reconstruct
        if obj is getattr(multiarray, "scalar", None):
            return self._scalar
        if obj is np.dtype:
            return self._dtype_spec
        if isinstance(obj, type) and issubclass(obj, np.dtype):  # numpy.dtypes.Float32DType & co.
            return lambda *a: self._checked_dtype(obj(*a), qualname)
        raise self._bad(f"the numpy global {qualname}")

    def _checked_dtype(self, dt: Any, what: str = "dtype") -> Any:
        import numpy as np

        if isinstance(dt, _DtypeState):
            dt = self._build_dtype(dt)
        try:
            dt = np.dtype(dt) if isinstance(dt, (str, type)) and dt not in (object, "O", "object") else dt
        except TypeError:
            raise self._bad(f"{what} {dt!r}") from None
        if not isinstance(dt, np.dtype) or dt.hasobject or dt.fields is not None or dt.subdtype is not None \
                or dt.kind not in "biufc" or dt.itemsize == 0:
            raise self._bad(f"{what} {dt!r}")
        return dt

    def _dtype_spec(self, spec: Any = None, align: Any = False, copy: Any = False) -> _DtypeState:
        if not isinstance(spec, str):
            raise self._bad(f"a dtype built from {type(spec).__name__}")
        self._stand_ins += 1
        return _DtypeState(spec)

    def _build_dtype(self, d: _DtypeState) -> Any:
        import numpy as np

        try:
            dt = np.dtype(d.spec) if d.spec not in ("O", "O8", "O4", "object") else None
        except TypeError:
            dt = None
        if dt is None:
            raise self._bad(f"dtype {d.spec!r}")
        st = d.state
        if st is not None:  # (version, byte order, subarray, names, fields, itemsize, alignment, flags)
            if not isinstance(st, tuple) or len(st) < 5 or any(x is not None for x in st[2:5]):
                raise self._bad(f"dtype {d.spec!r} with state {st!r}")
            if st[1] in ("<", ">"):
                dt = dt.newbyteorder(st[1])
        return self._checked_dtype(dt, f"dtype {d.spec!r}")

    def _ndarray(self, shape: Any, dtype: Any = None, buffer: Any = None, offset: Any = 0, strides: Any = None,
                 order: Any = None) -> Any:
        import numpy as np

        dt = self._checked_dtype(dtype if dtype is not None else "float64")
        if not isinstance(buffer, (bytes, bytearray)) or strides is not None or not isinstance(offset, int):
            raise self._bad("ndarray(...) without a byte buffer")
        dims = self._shape(shape)
        n = math.prod(dims) * dt.itemsize
        if offset < 0 or offset + n > len(buffer):
            raise self._bad(f"an array of shape {list(dims)} {dt} from {len(buffer)} bytes")
        return np.frombuffer(buffer, dt, count=math.prod(dims), offset=offset).reshape(
            dims, order="F" if order == "F" else "C").copy()

    def _reconstruct(self, cls: Any, shape: Any = None, dtype: Any = None) -> _ArrayState:
        if cls != self._ndarray:  # bound methods compare equal, never identical
            raise self._bad(f"an array of class {getattr(cls, '__name__', cls)!r}")
        self._stand_ins += 1
        return _ArrayState()

    def _scalar(self, dtype: Any, data: Any = None) -> Any:
        import numpy as np

        dt = self._checked_dtype(dtype)
        if not isinstance(data, bytes) or len(data) != dt.itemsize:
            raise self._bad(f"a {dt} scalar from {type(data).__name__}")
        return np.frombuffer(data, dt)[0]

    def _shape(self, shape: Any) -> tuple[int, ...]:
        if isinstance(shape, int) and not isinstance(shape, bool):
            shape = (shape,)
        if not isinstance(shape, (tuple, list)) or len(shape) > 64 or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape):
            raise self._bad(f"an array of shape {shape!r}")
        return tuple(shape)

    def _build_array(self, a: _ArrayState) -> Any:
        import numpy as np

        st = getattr(a, "state", None)
        if isinstance(st, tuple) and len(st) == 5:
            st = st[1:]  # (version, shape, dtype, is_fortran, raw)
        if not isinstance(st, tuple) or len(st) != 4:
            raise self._bad("an array without a state")
        shape, dtype, fortran, raw = st
        dt = self._checked_dtype(dtype)
        dims = self._shape(shape)
        if not isinstance(raw, (bytes, bytearray)) or len(raw) != math.prod(dims) * dt.itemsize:
            raise self._bad(f"an array of shape {list(dims)} {dt} from "
                            f"{len(raw) if isinstance(raw, (bytes, bytearray)) else type(raw).__name__} bytes")
        return np.frombuffer(raw, dt).reshape(dims, order="F" if fortran else "C").copy()

    def _finish(self, obj: Any, done: dict[int, Any], depth: int) -> Any:
        """Replace the stand-ins in ``obj`` by the arrays and dtypes they describe (checked)."""
        if depth > _MAX_NESTING:
            raise self._refuse(f"{self._source}: nested more than {_MAX_NESTING} deep")
        key = id(obj)
        if key in done:
            return done[key]
        if isinstance(obj, _ArrayState):
            out = self._build_array(obj)
        elif isinstance(obj, _DtypeState):
            out = self._build_dtype(obj)
        elif isinstance(obj, dict):
            items = [(self._finish(k, done, depth + 1), self._finish(v, done, depth + 1)) for k, v in obj.items()]
            obj.clear()
            obj.update(items)
            out = obj
        elif isinstance(obj, list):
            obj[:] = [self._finish(v, done, depth + 1) for v in obj]
            out = obj
        elif isinstance(obj, (tuple, set, frozenset)):
            out = type(obj)(self._finish(v, done, depth + 1) for v in obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type) and type(obj).__module__ != "numpy":
            for k, v in list(vars(obj).items()):
                vars(obj)[k] = self._finish(v, done, depth + 1)
            out = obj
        else:
            out = obj
        done[key] = out
        return out


def error_reason(e: BaseException) -> str:
    """The line of an exception's message that says what went wrong: torch's weights-only refusals run to many
    lines of advice, of which the one naming the refused ``GLOBAL`` (``Trying to load unsupported GLOBAL posix.system
    ...``) or the unpickler's reason (``WeightsUnpickler error: ...``) says what the file holds; otherwise the
    first line (the class name when the message is empty)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    named = [ln for ln in lines if "GLOBAL" in ln or ln.startswith("WeightsUnpickler error:")]
    return (named or lines or [type(e).__name__])[0]


def load_allowlisted(path: str | os.PathLike, unpickler: Callable[[Any, str], AllowlistUnpickler],
                     refused: type[Exception], unreadable: type[Exception], *,
                     data: bytes | None = None, max_bytes: int | None = None, what: str = "readable pickle") -> Any:
    """Unpickle file ``path`` (or its bytes ``data``, when given) with ``unpickler(stream, source)``, an
    :class:`AllowlistUnpickler`: the one sequence every reader of foreign pickles follows.

    Args:
        refused: the error class the unpickler raises for a refused global (raised as is).
        unreadable: the error class for anything else (missing file, truncated or corrupt stream); raised as
            is when the unpickler raises it.
        max_bytes: a larger file is refused before unpickling.
        what: completes ``"{path}: not a {what} (ErrorType: reason)"``.

    Raises:
        ``refused``: the pickle names a global outside the allowlist (nothing it names ran).
        ``unreadable(...)``: ``"{path}: cannot read: {reason}"`` or ``"{path}: not a {what} (...)"``.
    """
    try:
        if data is not None:
            return unpickler(io.BytesIO(data), str(path)).load()
        with open(path, "rb") as f:
            if max_bytes is not None and os.fstat(f.fileno()).st_size > max_bytes:
                raise unreadable(f"{path}: larger than {max_bytes >> 20} MiB; refusing to unpickle it")
            return unpickler(f, str(path)).load()
    except (refused, unreadable):
        raise
    except OSError as e:
        raise unreadable(f"{path}: cannot read: {e.strerror or e}") from None
    except Exception as e:  # truncated or corrupt pickle streams raise many types
        raise unreadable(f"{path}: not a {what} ({type(e).__name__}: {e})") from None


def print_report(as_json: bool, data: Callable[[], Any], text: Callable[[], str], ok: bool = True) -> int:
    """The tail of a reporting CLI command: print ``data()`` as indented JSON (``--json``) or ``text()`` on
    stdout, and return the exit status, 0 when ``ok`` else 1 (``diff``: different; ``verify``: corrupt)."""
    if as_json:
        import json

        json.dump(data(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(text())
    return 0 if ok else 1
