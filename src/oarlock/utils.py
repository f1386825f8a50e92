"""Helpers shared by every oarlock package: dtype names, progress bars, logging.

Keep this module small and dependency-free (torch, tqdm only): each capability package imports it.
"""

from __future__ import annotations

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
_ALIASES = {"float": "float32", "half": "float16", "double": "float64", "bf16": "bfloat16", "fp16": "float16",
            "fp32": "float32", "long": "int64", "int": "int32"}


def dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical dtype name (``"float32"``, ``"bfloat16"``, ...) of a torch dtype, a name, an alias or a
    safetensors code (``"F32"``). Raises ``ValueError`` naming the unknown dtype."""
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
    return torch_dtype(name).itemsize


def numel(shape: Iterable[int]) -> int:
    """Number of elements of a shape (1 for a scalar ``()``)."""
    return math.prod(shape)


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


class AllowlistUnpickler(pickle.Unpickler):
    """A :class:`pickle.Unpickler` that resolves a global only when ``admit(module, name)`` returns it.

    Plain containers, strings and numbers never reach ``find_class``, so ``admit=lambda m, n: None`` reads
    pure-data pickles (PyTorch memory snapshots) and refuses everything else. A refused global raises
    ``refuse(message)`` (the caller's own error class) before any code runs.
    """

    def __init__(self, file: Any, admit: Callable[[str, str], Any], refuse: Callable[[str], Exception],
                 source: str = "<pickle>", admitted_desc: str = "plain containers"):
        super().__init__(file)
        self._admit, self._refuse, self._source, self._desc = admit, refuse, source, admitted_desc

    def find_class(self, module: str, name: str) -> Any:
        obj = self._admit(module, name)
        if obj is None:
            raise self._refuse(f"{self._source}: refuses to unpickle {module}.{name} "
                               f"(only {self._desc} are admitted)")
        return obj
