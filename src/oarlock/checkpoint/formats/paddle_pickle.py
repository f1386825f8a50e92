"""Reading PaddlePaddle FlexCheckpoint files without trusting them.

Paddle writes ``{uid}.metadata`` (a pickle of its ``Metadata`` dataclasses) and ``{rank}_{uid}.distcp`` (a
pickle of ``{key: numpy.ndarray}``). Unpickling runs whatever a file names, so both are read through
:class:`RestrictedUnpickler`, which admits only numpy arrays, plain containers and Paddle's three metadata
records (mapped onto inert local classes). Anything else raises :class:`UnsafePickleError` before it runs.
Record fields and how they map to oarlock metadata: ``docs/checkpoint-format.md``.

Not a format module (it registers no reader): :mod:`oarlock.checkpoint.formats.paddle` reads Paddle checkpoints
through it.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from oarlock.checkpoint.errors import CheckpointFormatError, UnsafePickleError
from oarlock.utils import AllowlistUnpickler, load_allowlisted


class _Record:
    """Inert stand-in for a Paddle metadata dataclass: holds the pickled fields, runs nothing."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) form
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise UnsafePickleError(f"unexpected state for {type(self).__name__}: {type(state).__name__}")
        self.__dict__.update(state)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted((k, _hashable(v)) for k, v in self.__dict__.items()))))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


def _hashable(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(v)
    if isinstance(v, slice):
        return (v.start, v.stop, v.step)
    return v


class PaddleMetadata(_Record):
    """Paddle ``Metadata``: ``state_dict_metadata``, ``storage_metadata``, ``flat_mapping``."""


class PaddleLocalTensorMetadata(_Record):
    """Paddle ``LocalTensorMetadata``: ``global_offset``, ``local_shape``, ``dtype``, ``global_shape``,
    ``is_flattened``, ``flattened_range``."""


class PaddleLocalTensorIndex(_Record):
    """Paddle ``LocalTensorIndex``: ``tensor_key``, ``global_offset``, ``is_flattened``, ``flattened_range``,
    ``local_shape``, ``replica_id``."""


_PADDLE_RECORDS = {"Metadata": PaddleMetadata, "LocalTensorMetadata": PaddleLocalTensorMetadata,
                   "LocalTensorIndex": PaddleLocalTensorIndex}
_PADDLE_MODULES = ("paddle.distributed.flex_checkpoint.dcp.metadata",)


def _admitted(module: str, name: str) -> Any:
    import builtins
    import collections

    import numpy

    if module in _PADDLE_MODULES and name in _PADDLE_RECORDS:
        return _PADDLE_RECORDS[name]
    if module in ("numpy._core.multiarray", "numpy.core.multiarray") and name in ("_reconstruct", "scalar"):
        return getattr(numpy._core.multiarray if hasattr(numpy, "_core") else numpy.core.multiarray, name)
    if module == "numpy" and name in ("ndarray", "dtype"):
        return getattr(numpy, name)
    if module == "numpy.dtypes" and name.endswith("DType"):
        return getattr(numpy.dtypes, name)
    if module == "builtins" and name in ("slice", "set", "frozenset", "complex"):
        return getattr(builtins, name)
    if module == "collections" and name == "OrderedDict":
        return collections.OrderedDict
    return None


class RestrictedUnpickler(AllowlistUnpickler):
    """A :class:`pickle.Unpickler` whose ``find_class`` admits only numpy arrays and dtypes, plain
    containers, ``slice`` and Paddle's checkpoint metadata records.

    Raises:
        UnsafePickleError: naming the file and the forbidden ``module.name`` the pickle asked for.
    """

    def __init__(self, file: io.BufferedIOBase, source: str = "<pickle>"):
        super().__init__(file, _admitted, UnsafePickleError, source,
                         "numpy arrays, containers and Paddle checkpoint metadata")


def restricted_load(path: str | Path) -> Any:
    """Unpickle ``path`` with :class:`RestrictedUnpickler`. Raises :class:`CheckpointFormatError` (or its
    subclass :class:`UnsafePickleError`) naming the file when it is unreadable, truncated or unsafe."""
    return load_allowlisted(Path(path), RestrictedUnpickler, UnsafePickleError, CheckpointFormatError)
