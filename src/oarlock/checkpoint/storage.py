"""Checkpoint sources on disk: detect the format, validate it, read its metadata and its bytes.

Formats recognised by :func:`open_checkpoint`:

* ``safetensors``: one ``.safetensors`` file; every tensor is one whole shard.
* ``huggingface``: a directory with ``model.safetensors``, or sharded files listed by
  ``model.safetensors.index.json`` (``{"metadata": {...}, "weight_map": {key: file}}``).
* ``oarlock``: a directory with ``metadata.json`` (see :mod:`oarlock.checkpoint.metadata`) and per-rank
  safetensors data files.
* ``paddle``: a PaddlePaddle FlexCheckpoint directory, ``{uid}.metadata`` plus ``{rank}_{uid}.distcp``
  pickles or ``{rank}_{uid}.safetensors`` files; pickles go through the restricted unpickler.

Reading never writes into the source directory. Headers are validated by the safetensors library before any
byte is trusted; its errors are re-raised as :class:`CheckpointFormatError` naming the file.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from oarlock.checkpoint import paddle as paddle_pickle
from oarlock.checkpoint.errors import CheckpointFormatError
from oarlock.checkpoint.metadata import METADATA_FILE, CheckpointMetadata, ShardMeta, TensorMeta
from oarlock.utils import dtype_name, torch_dtype

HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"
PADDLE_HF_CACHE = "flex-ckpt.auto_generated.metadata"  # Paddle writes this into HF dirs it has loaded
_PADDLE_META = re.compile(r"^(\d+)\.metadata$")
_PADDLE_DATA = re.compile(r"^(\d+)_(\d+)\.(distcp|safetensors)$")


def _safe_open(path: Path):
    from safetensors import safe_open

    if not path.is_file():
        raise CheckpointFormatError(f"{path}: file not found")
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # SafetensorError, OSError
        msg = str(e).replace("Error while deserializing header: ", "")
        raise CheckpointFormatError(f"{path}: invalid safetensors file: {msg}") from None


def safetensors_header(path: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Validated header of one safetensors file: ``{tensor name: (shape, dtype name)}`` in file order.

    Raises:
        CheckpointFormatError: missing/unreadable file, truncated header, offsets that overlap or exceed the
            file, or a dtype oarlock does not know (naming the file and the tensor).
    """
    path = Path(path)
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    with _safe_open(path) as f:
        for name in f.keys():
            sl = f.get_slice(name)
            code = sl.get_dtype()
            try:
                dt = dtype_name(code)
            except ValueError:
                raise CheckpointFormatError(f"{path}: tensor {name!r} has dtype {code}, which oarlock does not "
                                            "support") from None
            out[name] = (tuple(sl.get_shape()), dt)
    return out


def _whole_tensor_metadata(fmt: str, files: dict[str, Path], root: Path) -> CheckpointMetadata:
    """Metadata where every tensor of every file is one whole shard (safetensors file, HF directory)."""
    meta = CheckpointMetadata(fmt)
    owner: dict[str, str] = {}
    for rel, p in files.items():
        for name, (shape, dt) in safetensors_header(p).items():
            if name in owner:
                raise CheckpointFormatError(f"{root}: tensor {name!r} is stored twice, in {owner[name]} and {rel}")
            owner[name] = rel
            meta.tensors[name] = TensorMeta(name, shape, dt,
                                            [ShardMeta((0,) * len(shape), shape, rel, name)])
    return meta


def detect_format(path: str | Path) -> str:
    """Name the checkpoint format at ``path`` (see module docstring).

    Raises:
        CheckpointFormatError: path missing, or a directory that holds no checkpoint or mixes formats.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointFormatError(f"{p}: no such file or directory")
    if p.is_file():
        if p.suffix == ".safetensors":
            return "safetensors"
        if p.name == METADATA_FILE:
            return "oarlock"
        raise CheckpointFormatError(f"{p}: not a checkpoint file (expected a .safetensors file or a directory)")
    names = set(os.listdir(p))
    kinds = []
    if METADATA_FILE in names:
        kinds.append("oarlock")
    if any(_PADDLE_META.match(n) for n in names):
        kinds.append("paddle")
    if HF_INDEX in names or HF_SINGLE in names:
        kinds.append("huggingface")
    if len(kinds) > 1:
        raise CheckpointFormatError(f"{p}: directory mixes checkpoint formats ({' and '.join(kinds)}); "
                                    "keep one checkpoint per directory")
    if kinds:
        return kinds[0]
    if any(n.endswith(".safetensors") for n in names):
        return "huggingface"
    raise CheckpointFormatError(f"{p}: no checkpoint found (no {METADATA_FILE}, *.metadata, {HF_INDEX} "
                                "or *.safetensors)")


def read_metadata(path: str | Path) -> CheckpointMetadata:
    """Detect the format at ``path`` and return its validated :class:`CheckpointMetadata`."""
    return open_checkpoint(path).metadata


class CheckpointReader:
    """An opened checkpoint source: its metadata and a way to read any slice of any stored shard.

    ``read(shard, index)`` returns a CPU tensor holding ``stored[index]`` where ``stored`` is the shard as
    stored (its box, or its 1-D flat range); only the bytes of that slice are read for safetensors files
    (memory-mapped), whole pickles for Paddle ``.distcp`` files (cached per file).
    """

    def __init__(self, root: Path, metadata: CheckpointMetadata):
        self.root = root
        self.metadata = metadata
        self._handles: dict[str, Any] = {}
        self.files_opened: list[str] = []  # instrumentation: one entry per file actually opened

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for h in self._handles.values():
            if hasattr(h, "__exit__"):
                h.__exit__(None, None, None)
        self._handles.clear()

    def path_of(self, file: str) -> Path:
        return self.root / file if self.root.is_dir() else self.root

    def _handle(self, file: str) -> Any:
        h = self._handles.get(file)
        if h is None:
            p = self.path_of(file)
            if file.endswith(".distcp"):
                data = paddle_pickle.restricted_load(p)
                if not isinstance(data, dict):
                    raise CheckpointFormatError(f"{p}: expected a dict of arrays, found {type(data).__name__}")
                h = data
            else:
                h = _safe_open(p).__enter__()
            self._handles[file] = h
            self.files_opened.append(file)
        return h

    def read(self, key: str, shard: ShardMeta, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Read ``index`` (a tuple of slices over the stored tensor; None = all) of ``shard`` of ``key``."""
        h = self._handle(shard.file)
        dtype = self.metadata.tensors[key].dtype
        if isinstance(h, dict):
            if shard.name not in h:
                raise CheckpointFormatError(f"{self.path_of(shard.file)}: tensor {shard.name!r} is missing")
            arr = h[shard.name]
            arr = arr if index is None else arr[index]
            t = torch.from_numpy(arr.copy())
            if dtype == "bfloat16" and t.dtype in (torch.int16, torch.uint16):  # numpy has no bf16
                t = t.view(torch.bfloat16)
        else:
            try:
                sl = h.get_slice(shard.name)
            except Exception:
                raise CheckpointFormatError(f"{self.path_of(shard.file)}: tensor {shard.name!r} is missing") from None
            if index is None or len(index) == 0:
                t = h.get_tensor(shard.name)
                if index is not None:
                    t = t[index]
            else:
                t = sl[index]
        want = torch_dtype(dtype)
        if t.dtype != want:
            raise CheckpointFormatError(f"{self.path_of(shard.file)}: tensor {shard.name!r} is {t.dtype}, "
                                        f"metadata says {dtype}")
        return t


def open_checkpoint(path: str | Path) -> CheckpointReader:
    """Open any supported checkpoint at ``path`` for reading (see the module docstring for formats).

    Raises:
        CheckpointFormatError: naming the file and problem (missing shard file, truncated header, a tensor
            listed twice, unsafe pickle, mixed formats, ...). Nothing is ever written.
    """
    p = Path(path)
    fmt = detect_format(p)
    if fmt == "safetensors":
        return CheckpointReader(p, _whole_tensor_metadata("safetensors", {p.name: p}, p))
    if fmt == "oarlock":
        root = p if p.is_dir() else p.parent
        return CheckpointReader(root, _read_oarlock(root))
    if fmt == "huggingface":
        return CheckpointReader(p, _read_hf(p))
    return CheckpointReader(p, _read_paddle(p))


def _read_oarlock(root: Path) -> CheckpointMetadata:
    mpath = root / METADATA_FILE
    try:
        raw = json.loads(mpath.read_text())
    except OSError as e:
        raise CheckpointFormatError(f"{mpath}: cannot read: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(f"{mpath}: invalid JSON: {e}") from None
    meta = CheckpointMetadata.from_json(raw, source=str(mpath))
    for f in meta.files:
        if not (root / f).is_file():
            raise CheckpointFormatError(f"{root / f}: data file named in {METADATA_FILE} is missing")
    return meta


def _read_hf(root: Path) -> CheckpointMetadata:
    index_path = root / HF_INDEX
    if index_path.exists():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointFormatError(f"{index_path}: invalid index: {e}") from None
        files = {}
        for key, f in weight_map.items():
            if not (root / f).is_file():
                raise CheckpointFormatError(f"{index_path}: tensor {key!r} is mapped to {f}, which does not exist")
            files[f] = root / f
        meta = _whole_tensor_metadata("huggingface", dict(sorted(files.items())), root)
        for key, f in weight_map.items():
            t = meta.tensors.get(key)
            if t is None:
                raise CheckpointFormatError(f"{index_path}: tensor {key!r} is mapped to {f}, which does not hold it")
            if t.shards[0].file != f:
                raise CheckpointFormatError(f"{index_path}: tensor {key!r} is mapped to {f} but stored in "
                                            f"{t.shards[0].file}")
        meta.extra["index_metadata"] = index.get("metadata", {})
        return meta
    files = {n: root / n for n in sorted(os.listdir(root)) if n.endswith(".safetensors")}
    return _whole_tensor_metadata("huggingface", files, root)


def _paddle_tuple(v: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in (v or ()))


def _read_paddle(root: Path) -> CheckpointMetadata:
    names = os.listdir(root)
    uids = sorted(int(m.group(1)) for n in names if (m := _PADDLE_META.match(n)))
    uid = uids[-1]  # like Paddle: the newest (largest) unique id wins
    data_kinds = {m.group(3) for n in names if (m := _PADDLE_DATA.match(n)) and int(m.group(2)) == uid}
    if len(data_kinds) > 1:
        raise CheckpointFormatError(f"{root}: Paddle checkpoint {uid} mixes .distcp and .safetensors data files")
    mpath = root / f"{uid}.metadata"
    raw = paddle_pickle.restricted_load(mpath)
    if not isinstance(raw, paddle_pickle.PaddleMetadata):
        raise CheckpointFormatError(f"{mpath}: expected a Paddle Metadata record, found {type(raw).__name__}")
    sdm = getattr(raw, "state_dict_metadata", None) or {}
    storage = getattr(raw, "storage_metadata", None) or {}
    file_of: dict[tuple, tuple[str, int | None]] = {}
    for idx, fname in storage.items():
        fr = getattr(idx, "flattened_range", None)
        fr_t = (fr.start, fr.stop) if isinstance(fr, slice) else (tuple(fr) if fr else None)
        k = (idx.tensor_key, _paddle_tuple(idx.global_offset), fr_t)
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
            gshape = _paddle_tuple(lm.global_shape)
            try:
                dtype = dtype_name(lm.dtype)
            except ValueError:
                raise CheckpointFormatError(f"{mpath}: tensor {key!r} has unsupported dtype {lm.dtype!r}") from None
            fr = getattr(lm, "flattened_range", None)
            fr_t = (fr.start, fr.stop) if isinstance(fr, slice) else (tuple(fr) if fr else None)
            off = _paddle_tuple(lm.global_offset)
            loc = (key, off, fr_t)
            if loc not in file_of:
                raise CheckpointFormatError(f"{mpath}: shard of {key!r} at offset {off} has no data file")
            shards.append(ShardMeta(off, _paddle_tuple(lm.local_shape), file_of[loc][0], key, fr_t))
        if gshape is None or dtype is None:
            raise CheckpointFormatError(f"{mpath}: tensor {key!r} has no shards")
        meta.tensors[key] = TensorMeta(key, gshape, dtype, shards)
    return meta
