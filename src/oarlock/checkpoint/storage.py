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
import shutil
import struct
import uuid
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


def _check_dtype_codes(path: Path) -> None:
    """Name the tensor when a header holds a dtype code oarlock does not know (the safetensors library's own
    message names neither the tensor nor the code). Malformed headers are left to the library's checks."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return
            (n,) = struct.unpack("<Q", head)
            if n > 100 * 1024 * 1024:
                return
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError):
        return
    if not isinstance(header, dict):
        return
    for name, e in header.items():
        if name == "__metadata__" or not isinstance(e, dict):
            continue
        code = e.get("dtype")
        try:
            dtype_name(str(code))
        except ValueError:
            raise CheckpointFormatError(f"{path}: tensor {name!r} has dtype {code!r}, which oarlock does not "
                                        "support (safetensors codes: F64 F32 F16 BF16 F8_E4M3 F8_E5M2 I64 I32 I16 "
                                        "I8 U64 U32 U16 U8 BOOL C64)") from None


def safetensors_header(path: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Validated header of one safetensors file: ``{tensor name: (shape, dtype name)}`` in file order.

    Raises:
        CheckpointFormatError: missing/unreadable file, truncated header, offsets that overlap or exceed the
            file, or a dtype oarlock does not know (naming the file and the tensor).
    """
    path = Path(path)
    _check_dtype_codes(path)
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
    if INCOMPLETE_MARKER in names:
        raise CheckpointFormatError(f"{p}: incomplete checkpoint (a save into this directory did not finish; "
                                    "it holds no usable data)")
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
        self._st_files: dict[str, SafetensorsFile] = {}
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
        for f in self._st_files.values():
            f.close()
        self._st_files.clear()

    def data_offset(self, file: str, name: str) -> int:
        """Byte offset of tensor ``name`` inside ``file`` (0 where unknown): lets callers read in file order."""
        if file.endswith(".distcp"):
            return 0
        f = self._st_files.get(file)
        if f is None:
            f = self._st_files[file] = SafetensorsFile(self.path_of(file))
            self.files_opened.append(file)
        e = f.entries.get(name)
        return e[2] if e is not None else 0

    def read_box(self, key: str, file: str, name: str, flat_start: int, shape: tuple[int, ...],
                 box: tuple[tuple[int, int], ...], out: torch.Tensor | None = None) -> torch.Tensor:
        """Read ``array[box]`` of stored key ``key``, where ``array`` is the C-contiguous ``shape`` array starting
        ``flat_start`` elements into tensor ``name`` of ``file`` (a regular shard: ``flat_start`` 0 and its local
        shape; a piece of a flattened shard: see :class:`oarlock.checkpoint.plan.StoredPiece`). Writes into
        ``out`` when given (a tensor of the box's extent) and returns it. Safetensors files are read by byte
        range; Paddle ``.distcp`` pickles are loaded whole once and sliced."""
        dtype = self.metadata.tensors[key].dtype
        if not file.endswith(".distcp"):
            f = self._st_files.get(file)
            if f is None:
                f = self._st_files[file] = SafetensorsFile(self.path_of(file))
                self.files_opened.append(file)
            return f.read_box(name, flat_start, shape, box, dtype, out)
        h = self._handle(file)
        if name not in h:
            raise CheckpointFormatError(f"{self.path_of(file)}: tensor {name!r} is missing")
        arr = h[name].reshape(-1)[flat_start:flat_start + np_prod(shape)].reshape(shape)
        t = torch.from_numpy(arr[tuple(slice(a, b) for a, b in box)].copy())
        if dtype == "bfloat16" and t.dtype in (torch.int16, torch.uint16):  # numpy has no bf16
            t = t.view(torch.bfloat16)
        if t.dtype != torch_dtype(dtype):
            raise CheckpointFormatError(f"{self.path_of(file)}: tensor {name!r} is {t.dtype}, metadata says {dtype}")
        if out is None:
            return t
        out.copy_(t)
        return out

    def byte_run(self, key: str, file: str, name: str, flat_start: int, shape: tuple[int, ...],
                 box: tuple[tuple[int, int], ...]) -> tuple[int, int, int] | None:
        """``(fd, offset, nbytes)`` when ``array[box]`` (arguments as for :meth:`read_box`) is one contiguous byte
        run of a safetensors file, for zero-copy transfers (``os.copy_file_range``); None otherwise (Paddle
        pickles, strided boxes, a stored dtype other than the metadata's)."""
        if file.endswith(".distcp"):
            return None
        run = contiguous_run(shape, box)
        if run is None:
            return None
        f = self._st_files.get(file)
        if f is None:
            f = self._st_files[file] = SafetensorsFile(self.path_of(file))
            self.files_opened.append(file)
        e = f.entries.get(name)
        dtype = self.metadata.tensors[key].dtype
        if e is None or e[0] != dtype or flat_start + np_prod(shape) > np_prod(e[1]):
            return None
        isz = torch_dtype(dtype).itemsize
        return f.fd, f.data_start + e[2] + (flat_start + run[0]) * isz, run[1] * isz

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


# ---------------------------------------------------------------- byte-range reads and atomic writes

INCOMPLETE_MARKER = ".oarlock-incomplete"  # present in a save's temporary directory until it is committed
_RUN_BYTES = 256 * 1024  # contiguous runs at least this long are read one pread each
_CHUNK_BYTES = 64 * 1024 * 1024  # bound on the staging buffer of a strided read


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _pread_into(fd: int, buf: memoryview, offset: int, path: Path) -> None:
    n = 0
    while n < len(buf):
        got = os.preadv(fd, [buf[n:]], offset + n)
        if got <= 0:
            raise CheckpointFormatError(f"{path}: file ends at byte {offset + n}, expected {len(buf) - n} more")
        n += got


class SafetensorsFile:
    """A safetensors file opened for byte-range reads (``os.preadv`` straight into the destination memory).

    The header is parsed and checked (offsets inside the file, sizes matching shapes and dtypes) before any
    data byte is read; the format is specified at https://github.com/huggingface/safetensors#format.

    Raises:
        CheckpointFormatError: naming the file and tensor at fault.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointFormatError(f"{self.path}: cannot open: {e.strerror or e}") from None
        try:
            size = os.fstat(self.fd).st_size
            head = os.pread(self.fd, 8, 0)
            if len(head) < 8:
                raise CheckpointFormatError(f"{self.path}: invalid safetensors file: shorter than its 8-byte header")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 * 1024 * 1024):
                raise CheckpointFormatError(f"{self.path}: invalid safetensors file: header length {n} exceeds the file")
            try:
                header = json.loads(os.pread(self.fd, n, 8))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointFormatError(f"{self.path}: invalid safetensors header: {e}") from None
            self.data_start = 8 + n
            self.header_metadata: dict[str, str] = header.get("__metadata__") or {}
            self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
            for name, e in header.items():
                if name == "__metadata__":
                    continue
                try:
                    dt = dtype_name(e["dtype"])
                    shape = tuple(int(x) for x in e["shape"])
                    begin, end = (int(x) for x in e["data_offsets"])
                except (KeyError, TypeError, ValueError) as err:
                    raise CheckpointFormatError(f"{self.path}: tensor {name!r}: bad header entry ({err})") from None
                want = int(np_prod(shape)) * torch_dtype(dt).itemsize
                if end - begin != want or begin < 0 or self.data_start + end > size:
                    raise CheckpointFormatError(f"{self.path}: tensor {name!r}: data offsets [{begin}, {end}) do not "
                                                f"fit shape {list(shape)} {dt} in a file of {size} bytes")
                self.entries[name] = (dt, shape, begin, end)
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def read_box(self, name: str, flat_start: int, shape: tuple[int, ...], box: tuple[tuple[int, int], ...],
                 dtype: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read ``array[box]``, where ``array`` is the C-contiguous ``shape`` array that starts ``flat_start``
        elements into stored tensor ``name``; into ``out`` (a CPU tensor of the box's extent, any strides) or a
        new tensor. Only the needed byte ranges are read: one pread per contiguous run, or, when the runs are
        short, whole rows of the box in chunks of at most 64 MiB that are then sliced.

        Raises:
            CheckpointFormatError: tensor missing, dtype different from ``dtype``, or the array not inside it.
        """
        e = self.entries.get(name)
        if e is None:
            raise CheckpointFormatError(f"{self.path}: tensor {name!r} is missing")
        sdt, sshape, begin, _ = e
        if sdt != dtype:
            raise CheckpointFormatError(f"{self.path}: tensor {name!r} is {sdt}, metadata says {dtype}")
        count = int(np_prod(shape))
        if flat_start < 0 or flat_start + count > int(np_prod(sshape)) or (flat_start == 0 and len(sshape) > 1
                                                                          and tuple(sshape) != tuple(shape)):
            raise CheckpointFormatError(f"{self.path}: tensor {name!r} of shape {list(sshape)} does not hold the "
                                        f"{list(shape)} array at element {flat_start} that the metadata describes")
        tdt = torch_dtype(dtype)
        isz = tdt.itemsize
        ext = [b - a for a, b in box]
        if out is None:
            out = torch.empty(ext, dtype=tdt)
        if int(np_prod(ext)) == 0:
            return out
        base = self.data_start + begin + flat_start * isz
        nd = len(shape)
        strides = [int(np_prod(shape[d + 1:])) for d in range(nd)]
        if nd == 0:
            self._read_runs(out, [base], isz)
            return out
        k = nd - 1  # dims after k are read whole; dims before k index the runs
        while k > 0 and tuple(box[k]) == (0, shape[k]):
            k -= 1
        run = ext[k] * strides[k]
        start = sum(box[d][0] * strides[d] for d in range(nd))
        nruns = int(np_prod(ext[:k]))
        if nruns == 1:
            self._read_runs(out, [base + start * isz], run * isz)
            return out
        overhead = int(np_prod(shape[1:])) / int(np_prod(ext[1:]))
        if run * isz >= _RUN_BYTES or overhead > 4:
            import numpy as np

            offs = np.zeros((), dtype=np.int64)
            for d in range(k):
                offs = offs[..., None] + np.arange(box[d][0], box[d][1], dtype=np.int64) * strides[d]
            offs = (offs.reshape(-1) + box[k][0] * strides[k]) * isz + base
            self._read_runs(out, offs.tolist(), run * isz)
            return out
        # short runs: read whole rows of dim 0 (contiguous), then slice the box out of them
        row = strides[0]
        rows_per_chunk = max(1, _CHUNK_BYTES // max(1, row * isz))
        inner = tuple(slice(a, b) for a, b in box[1:])
        r = box[0][0]
        while r < box[0][1]:
            r2 = min(box[0][1], r + rows_per_chunk)
            buf = torch.empty((r2 - r, *shape[1:]), dtype=tdt)
            _pread_into(self.fd, _tensor_bytes(buf), base + r * row * isz, self.path)
            out[r - box[0][0]:r2 - box[0][0]].copy_(buf[(slice(None), *inner)])
            r = r2
        return out

    def _read_runs(self, out: torch.Tensor, offsets: list[int], run_bytes: int) -> None:
        """Read ``len(offsets)`` runs of ``run_bytes`` each, in order, into ``out`` (C order)."""
        direct = out.is_contiguous() and out.device.type == "cpu"
        dst = out if direct else torch.empty(out.shape, dtype=out.dtype)
        mv = _tensor_bytes(dst)
        pos = 0
        for off in offsets:
            _pread_into(self.fd, mv[pos:pos + run_bytes], off, self.path)
            pos += run_bytes
        if not direct:
            out.copy_(dst)


def contiguous_run(shape: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> tuple[int, int] | None:
    """``(first element, element count)`` when ``box`` of a C-contiguous array of ``shape`` is one contiguous run
    (leading dims of extent 1, one partial dim, then full dims), else None."""
    nd = len(shape)
    k = nd - 1
    while k > 0 and tuple(box[k]) == (0, shape[k]):
        k -= 1
    if nd and any(b - a != 1 for a, b in box[:k]):
        return None
    strides = [np_prod(shape[d + 1:]) for d in range(nd)]
    start = sum(box[d][0] * strides[d] for d in range(nd))
    return start, np_prod(b - a for a, b in box)


def np_prod(xs) -> int:
    p = 1
    for x in xs:
        p *= int(x)
    return p


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], *, fsync: bool = True,
                      metadata: dict[str, str] | None = None) -> int:
    """Write ``tensors`` (CPU or device, any layout) as one safetensors file, streaming each tensor's bytes
    without an intermediate copy for contiguous CPU tensors, and fsync it. Returns the bytes written.
    ``metadata`` (str -> str) is added to the header's ``__metadata__`` block.

    Raises:
        CheckpointFormatError: a dtype that safetensors cannot store (naming the tensor).
    """
    from oarlock.utils import safetensors_code

    path = Path(path)
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    prepared = []
    off = 0
    for name, t in tensors.items():
        try:
            code = safetensors_code(t.dtype)
        except (ValueError, KeyError):
            raise CheckpointFormatError(f"{path}: tensor {name!r} has dtype {t.dtype}, which safetensors cannot "
                                        "store") from None
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        n = t.numel() * t.element_size()
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [off, off + n]}
        prepared.append(t)
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb", buffering=0) as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        pos = flushed = 8 + len(hb)
        for t in prepared:
            if t.numel():
                mv = _tensor_bytes(t)
                while len(mv):
                    n = f.write(mv)
                    mv = mv[n:]
                    pos += n
                if fsync and pos - flushed >= _WRITEBACK_BYTES:
                    _start_writeback(f.fileno(), flushed, pos - flushed)
                    flushed = pos
        if fsync:
            os.fsync(f.fileno())
    return 8 + len(hb) + off


_WRITEBACK_BYTES = 16 * 1024 * 1024
_sync_file_range = None


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` to disk now (Linux ``sync_file_range`` with
    ``SYNC_FILE_RANGE_WRITE``), so the disk works while later tensors are still being copied and the final
    fsync has little left to do. A no-op where the call is unavailable."""
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        try:
            import ctypes
            import ctypes.util

            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fn = libc.sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            _sync_file_range = fn
        except (OSError, AttributeError):
            pass
    if _sync_file_range:
        _sync_file_range(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE


def fsync_dir(path: str | Path) -> None:
    """fsync a directory so that entries created or renamed in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_directory(tmp: Path, final: Path, metadata: CheckpointMetadata | None = None) -> None:
    """The commit step of every writer (save, convert, HF export): make the fully written, fsynced directory
    ``tmp`` appear as ``final`` in one rename.

    With ``metadata``, first write ``metadata.json`` (via a ``.part`` file, fsync, rename) and remove the
    incomplete-marker. An existing ``final`` is replaced only now that the new directory is complete: it is
    moved aside, the new one renamed in, then the old one removed; a crash at any point leaves either the old
    or the new complete directory at ``final`` (plus hidden leftovers), never a partial one.
    """
    if metadata is not None:
        part = tmp / (METADATA_FILE + ".part")
        with open(part, "w") as f:
            f.write(metadata.dumps())
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, tmp / METADATA_FILE)
        marker = tmp / INCOMPLETE_MARKER
        if marker.exists():
            os.unlink(marker)
    fsync_dir(tmp)
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:12]}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)
