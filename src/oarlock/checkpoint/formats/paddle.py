"""PaddlePaddle FlexCheckpoint directories: ``{uid}.metadata`` plus ``{rank}_{uid}.distcp`` pickles or
``{rank}_{uid}.safetensors`` files. Pickles (metadata and ``.distcp`` data) go through the restricted
unpickler of :mod:`oarlock.checkpoint.formats.paddle_pickle`, which builds only plain containers and numpy arrays."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from oarlock.checkpoint.formats import paddle_pickle as paddle_pickle
from oarlock.checkpoint.errors import CheckpointFormatError, UnsafePickleError
from oarlock.checkpoint.model.metadata import CheckpointMetadata, ShardMeta, TensorMeta
from oarlock.checkpoint.formats.reader import CheckpointReader, box_of_stored, checkpoint_file, register_format
from oarlock.checkpoint.storage.safetensors import np_prod
from oarlock.checkpoint.storage.files import list_names, local_path, read_file
from oarlock.utils import dtype_name, load_allowlisted, torch_dtype

PADDLE_META = re.compile(r"^(\d+)\.metadata$")
PADDLE_DATA = re.compile(r"^(\d+)_(\d+)\.(distcp|safetensors)$")


def _tuple(v: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in (v or ()))


def _flat_range(obj: Any) -> tuple[int, int] | None:
    fr = getattr(obj, "flattened_range", None)
    return (fr.start, fr.stop) if isinstance(fr, slice) else (tuple(fr) if fr else None)


def _load_pickle(path: Any) -> Any:
    """:func:`oarlock.checkpoint.formats.paddle_pickle.restricted_load` of a file at any location: a local file is
    unpickled as
    it streams from disk (a ``.distcp`` data file may hold gigabytes), an object in a store is fetched whole
    through the storage layer first."""
    if local_path(path) is not None:
        return paddle_pickle.restricted_load(path)
    return load_allowlisted(path, paddle_pickle.RestrictedUnpickler, UnsafePickleError, CheckpointFormatError,
                            data=read_file(path))


def read_paddle_metadata(root: Path) -> CheckpointMetadata:
    """The metadata of the newest (largest unique id) Paddle checkpoint in ``root``.

    Raises:
        CheckpointFormatError: mixed data kinds, a record of the wrong type, missing data files or dtypes
            oarlock does not know (naming the file and key).
    """
    names = list_names(root)
    uids = sorted(int(m.group(1)) for n in names if (m := PADDLE_META.match(n)))
    uid = uids[-1]  # like Paddle: the newest (largest) unique id wins
    data_kinds = {m.group(3) for n in names if (m := PADDLE_DATA.match(n)) and int(m.group(2)) == uid}
    if len(data_kinds) > 1:
        raise CheckpointFormatError(f"{root}: Paddle checkpoint {uid} mixes .distcp and .safetensors data files")
    mpath = checkpoint_file(root, f"{uid}.metadata", str(root))
    raw = _load_pickle(mpath)
    if not isinstance(raw, paddle_pickle.PaddleMetadata):
        raise CheckpointFormatError(f"{mpath}: expected a Paddle Metadata record, found {type(raw).__name__}")
    sdm = getattr(raw, "state_dict_metadata", None) or {}
    storage = getattr(raw, "storage_metadata", None) or {}
    file_of: dict[tuple, tuple[str, int | None]] = {}
    for idx, fname in storage.items():
        k = (idx.tensor_key, _tuple(idx.global_offset), _flat_range(idx))
        checkpoint_file(root, fname, f"{mpath}: tensor {getattr(idx, 'tensor_key', None)!r}")
        if not (root / fname).is_file():
            raise CheckpointFormatError(f"{mpath}: tensor {idx.tensor_key!r} is stored in {fname}, which is missing")
        rid = getattr(idx, "replica_id", None)
        if k not in file_of or (rid or 0) < (file_of[k][1] or 0):
            file_of[k] = (fname, rid)
    meta = CheckpointMetadata("paddle", extra={"unique_id": uid})
    for key, locals_ in sdm.items():
        shards = []
        gshape: tuple[int, ...] | None = None
        dtype = None
        for lm in locals_:
            gshape = _tuple(lm.global_shape)
            try:
                dtype = dtype_name(lm.dtype)
            except ValueError:
                raise CheckpointFormatError(f"{mpath}: tensor {key!r} has unsupported dtype {lm.dtype!r}") from None
            fr_t = _flat_range(lm)
            off = _tuple(lm.global_offset)
            loc = (key, off, fr_t)
            if loc not in file_of:
                raise CheckpointFormatError(f"{mpath}: shard of {key!r} at offset {off} has no data file")
            shards.append(ShardMeta(off, _tuple(lm.local_shape), file_of[loc][0], key, fr_t))
        if gshape is None or dtype is None:
            raise CheckpointFormatError(f"{mpath}: tensor {key!r} has no shards")
        meta.tensors[key] = TensorMeta(key, gshape, dtype, shards)
    return meta


@register_format
class PaddleReader(CheckpointReader):
    """Reader of Paddle FlexCheckpoint directories: ``.safetensors`` data by byte ranges (base class),
    ``.distcp`` pickles loaded whole once per file (restricted unpickler) and sliced."""

    format = "paddle"
    priority = 1
    hint = "*.metadata"

    def __init__(self, root: Path, metadata: CheckpointMetadata):
        super().__init__(root, metadata)
        self._pickles: dict[str, dict] = {}

    @classmethod
    def claim(cls, path: Path, names: set[str] | None) -> int:
        return 2 if names is not None and any(PADDLE_META.match(n) for n in names) else 0

    @classmethod
    def open(cls, path: Path, *, shipped: dict[str, bytes] | None = None, partial: bool = False
             ) -> "PaddleReader":
        try:
            return cls(path, read_paddle_metadata(path))
        except (AttributeError, TypeError, ValueError, KeyError) as e:  # records of the wrong shape
            raise CheckpointFormatError(f"{path}: malformed Paddle metadata ({type(e).__name__}: {e})") from None

    def close(self) -> None:
        self._pickles.clear()
        super().close()

    def _pickle(self, file: str) -> dict:
        h = self._pickles.get(file)
        if h is None:
            p = self.path_of(file)
            data = _load_pickle(p)
            if not isinstance(data, dict):
                raise CheckpointFormatError(f"{p}: expected a dict of arrays, found {type(data).__name__}")
            h = self._pickles[file] = data
            self.files_opened.append(file)
        return h

    def check_read(self, key: str, file: str, name: str, flat_start: int, shape: tuple[int, ...]) -> None:
        if not file.endswith(".distcp"):
            # a safetensors data file: its header is validated now, before any target byte is written (the base
            # class would only look for the file, since this reader has a read_box of its own)
            self.safetensors_file(file).check_array(name, flat_start, shape, self.metadata.tensors[key].dtype)
            return
        import numpy as np

        h = self._pickle(file)
        arr = h.get(name)
        if arr is None:
            raise CheckpointFormatError(f"{self.path_of(file)}: tensor {name!r} is missing")
        if not isinstance(arr, np.ndarray):
            raise CheckpointFormatError(f"{self.path_of(file)}: tensor {name!r} is a {type(arr).__name__}, not an "
                                        "array")
        if arr.size < flat_start + np_prod(shape):
            raise CheckpointFormatError(f"{self.path_of(file)}: tensor {name!r} holds {getattr(arr, 'size', 0)} "
                                        f"elements, the metadata reads {np_prod(shape)} from element {flat_start}")

    def read_box(self, key: str, file: str, name: str, flat_start: int, shape: tuple[int, ...],
                 box: tuple[tuple[int, int], ...], out: torch.Tensor | None = None) -> torch.Tensor:
        if not file.endswith(".distcp"):
            return super().read_box(key, file, name, flat_start, shape, box, out)
        dtype = self.metadata.tensors[key].dtype
        self.check_read(key, file, name, flat_start, shape)
        t = torch.from_numpy(self._pickle(file)[name].reshape(-1))
        if dtype == "bfloat16" and t.dtype in (torch.int16, torch.uint16):  # numpy has no bf16
            t = t.view(torch.bfloat16)
        if t.dtype != torch_dtype(dtype):
            raise CheckpointFormatError(f"{self.path_of(file)}: tensor {name!r} is {t.dtype}, metadata says {dtype}")
        return box_of_stored(t, flat_start, shape, box, out)

    def byte_run(self, key: str, file: str, name: str, flat_start: int, shape: tuple[int, ...],
                 box: tuple[tuple[int, int], ...]) -> tuple[int, int, int] | None:
        if file.endswith(".distcp"):
            return None
        return super().byte_run(key, file, name, flat_start, shape, box)
