"""PyTorch Distributed Checkpoint (``torch.distributed.checkpoint``, "DCP") directories, read without trusting them.

What torch 2.x's ``FileSystemWriter`` puts on disk (the format oarlock reads; see ``docs/foreign-formats.md``):

* ``.metadata``: a pickle of ``torch.distributed.checkpoint.metadata.Metadata`` with
  ``state_dict_metadata`` (flat key -> ``TensorStorageMetadata(properties, size, chunks)`` or
  ``BytesStorageMetadata()``), ``planner_data`` (flat key -> path tuple of the nested state dict, for the
  default planner), ``storage_data`` (``MetadataIndex(fqn, offset)`` -> ``_StorageInfo(relative_path,
  offset, length[, transform_descriptors])``), ``storage_meta`` and ``version``. A checkpoint saved without
  collectives has one ``__{rank}.metadata`` per rank instead; they are merged.
* ``__{rank}_{i}.distcp``: data files. With the default ``SerializationFormat.TORCH_SAVE`` every tensor chunk
  and every non-tensor value is one ``torch.save`` archive at ``[offset, offset + length)``. With
  ``SerializationFormat.SAFETENSORS`` the non-tensor values come first (``torch.save`` archives as before) and
  all tensor chunks of the file follow as one embedded safetensors blob starting at the chunks' common
  ``offset``, keyed by flat key, with ``{"DCP_SHARDING_INFO": {key: {"saved_offsets": [...]}}}`` in its
  ``__metadata__``.
* ``transform_descriptors`` (for example ``["stream.zstd/1"]``) name stream transforms applied to an entry's
  bytes, outermost last; oarlock undoes ``stream.zstd`` with the ``zstandard`` package.

Safety: the ``.metadata`` pickle goes through :class:`DcpUnpickler`, which admits exactly the DCP metadata
classes (mapped onto inert local records), ``torch.Size``, dtypes, the layout and memory-format tags and plain
containers; anything else raises :class:`~oarlock.checkpoint.errors.UnsafePickleError` before it runs. Chunk
archives and non-tensor values are loaded with ``torch.load(weights_only=True)`` on their byte range only (tensor
chunks with ``map_location="meta"``, to locate their raw bytes: see :func:`archive_tensor_view`).
"""

from __future__ import annotations

import io
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from oarlock.checkpoint.errors import CheckpointError, CheckpointFormatError, UnsafePickleError
from oarlock.checkpoint.model.metadata import CheckpointMetadata, ShardMeta, TensorMeta
from oarlock.checkpoint.formats.reader import (CheckpointReader, box_of_stored, checkpoint_file, load_weights_only,
                                               register_format)
from oarlock.checkpoint.storage.safetensors import MAX_HEADER_BYTES, SafetensorsFile, contiguous_run, np_prod
from oarlock.checkpoint.storage import rename_within
from oarlock.checkpoint.storage.files import AppendStream, RangedFile, list_names, read_file
from oarlock.checkpoint.storage.location import location, storage_for, storage_key
from oarlock.utils import AllowlistUnpickler, dtype_name, load_allowlisted, torch_dtype

DCP_METADATA = ".metadata"
DCP_SUFFIX = ".distcp"
RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")
ZSTD_DESCRIPTOR = "stream.zstd"
_MAX_METADATA_BYTES = 1 << 30


# ---------------------------------------------------------------- inert records for the pickled classes

class DcpRecord:
    """Inert stand-in for one pickled DCP metadata dataclass: it stores the pickled fields and runs nothing.

    The pickle builds these with ``NEWOBJ`` (no constructor call) and ``BUILD`` (``__setstate__`` below), so a
    hostile file can set attributes but never call code.
    """

    _fields: tuple[str, ...] = ()

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict, slots) form
        if isinstance(state, tuple) and self._fields and len(state) == len(self._fields):
            state = dict(zip(self._fields, state))  # TensorProperties pickles a plain tuple
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise UnsafePickleError(f"unexpected pickled state for {type(self).__name__}: {type(state).__name__}")
        self.__dict__.update(state)

    def get(self, name: str, default: Any = None) -> Any:
        return self.__dict__.get(name, default)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class DcpMetadata(DcpRecord):
    """``Metadata``: ``state_dict_metadata``, ``planner_data``, ``storage_data``, ``storage_meta``, ``version``."""


class DcpTensorStorage(DcpRecord):
    """``TensorStorageMetadata``: ``properties``, ``size`` (global shape), ``chunks``."""


class DcpChunk(DcpRecord):
    """``ChunkStorageMetadata``: ``offsets`` (global offset), ``sizes`` (local shape)."""


class DcpBytesStorage(DcpRecord):
    """``BytesStorageMetadata``: a non-tensor value stored as a ``torch.save`` archive."""


class DcpTensorProperties(DcpRecord):
    """``TensorProperties``: pickled as the tuple ``(dtype, layout, requires_grad, memory_format, pin_memory)``."""

    _fields = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")


class DcpIndex(DcpRecord):
    """``MetadataIndex``: ``fqn``, ``offset`` (global offset of the chunk, None for non-tensors), ``index``."""


class DcpStorageMeta(DcpRecord):
    """``StorageMeta``: ``checkpoint_id``, ``save_id``, ``load_id``, ``modules``."""


class DcpStorageInfo(DcpRecord):
    """``_StorageInfo``: ``relative_path``, ``offset``, ``length``, ``transform_descriptors`` (optional)."""


class DcpPlanRecord(DcpRecord):
    """``SavePlan``, ``WriteItem``, ``TensorWriteData``, ``BytesIOWriteData`` or ``_StoragePrefix``: save plans
    that some writers (Megatron-Core's ``torch_dist``) keep in the metadata as ``all_local_plans``; kept inert
    and ignored."""


_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_RECORDS: dict[tuple[str, str], type] = {
    (_METADATA_MODULE, "Metadata"): DcpMetadata,
    (_METADATA_MODULE, "TensorStorageMetadata"): DcpTensorStorage,
    (_METADATA_MODULE, "ChunkStorageMetadata"): DcpChunk,
    (_METADATA_MODULE, "BytesStorageMetadata"): DcpBytesStorage,
    (_METADATA_MODULE, "TensorProperties"): DcpTensorProperties,
    (_METADATA_MODULE, "MetadataIndex"): DcpIndex,
    (_METADATA_MODULE, "StorageMeta"): DcpStorageMeta,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): DcpStorageInfo,
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"): DcpPlanRecord,
    **{("torch.distributed.checkpoint.planner", n): DcpPlanRecord
       for n in ("SavePlan", "WriteItem", "TensorWriteData", "BytesIOWriteData")},
}


def _size(dims: Any = ()) -> tuple[int, ...]:
    """Stand-in for ``torch.Size(dims)``: only a sequence of non-negative ints is accepted."""
    if not isinstance(dims, (tuple, list)) or not all(type(d) is int and d >= 0 for d in dims):
        raise UnsafePickleError(f"torch.Size with non-integer dimensions {dims!r}")
    return tuple(dims)


_LAYOUTS = {"torch.strided": "strided", "torch.sparse_coo": "sparse_coo"}


def _layout(name: Any) -> str:
    """Stand-in for ``torch.serialization._get_layout(name)``: returns the layout's name, admits known names only."""
    if name not in _LAYOUTS:
        raise UnsafePickleError(f"unknown tensor layout {name!r}")
    return _LAYOUTS[name]


def _memory_format(code: Any) -> int:
    """Stand-in for the ``_MEM_FORMAT_ENCODING`` enum (0 contiguous, 1 channels-last, 2 preserve)."""
    if code not in (0, 1, 2):
        raise UnsafePickleError(f"unknown memory-format code {code!r}")
    return int(code)


def _write_item_type(code: Any) -> int:
    """Stand-in for the ``WriteItemType`` enum (1 tensor, 2 shard, 3 bytes)."""
    if code not in (1, 2, 3):
        raise UnsafePickleError(f"unknown write-item type {code!r}")
    return int(code)


def _path_str(*parts: Any) -> str:
    """Stand-in for ``pathlib.PosixPath(*parts)`` (the pickled ``checkpoint_id``): the joined string."""
    if not all(isinstance(p, str) for p in parts):
        raise UnsafePickleError(f"path with non-string parts {parts!r}")
    return os.path.join(*parts) if parts else ""


def _admit(module: str, name: str) -> Any:
    rec = _RECORDS.get((module, name))
    if rec is not None:
        return rec
    if module == _METADATA_MODULE and name == "_MEM_FORMAT_ENCODING":
        return _memory_format
    if module == "torch.distributed.checkpoint.planner" and name == "WriteItemType":
        return _write_item_type
    if module == "torch" and name == "Size":
        return _size
    if module == "torch":
        obj = getattr(torch, name, None)
        return obj if isinstance(obj, torch.dtype) else None
    if module == "torch.serialization" and name == "_get_layout":
        return _layout
    if module == "pathlib" and name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
        return _path_str
    if module == "collections" and name == "OrderedDict":
        import collections

        return collections.OrderedDict
    return None


class DcpUnpickler(AllowlistUnpickler):
    """A :class:`pickle.Unpickler` for DCP ``.metadata`` files whose ``find_class`` admits only the DCP
    metadata classes (as inert :class:`DcpRecord` subclasses), ``torch.Size``, torch dtypes, the layout and
    memory-format tags, ``pathlib`` paths (as strings) and ``OrderedDict``.

    Raises:
        UnsafePickleError: naming the file and the forbidden ``module.name`` (``os.system``, ``builtins.eval``,
            numpy object arrays, ...) before anything it names is called.
    """

    def __init__(self, file: Any, source: str = "<pickle>"):
        super().__init__(file, _admit, UnsafePickleError, source,
                         "torch.distributed.checkpoint metadata records, torch.Size, dtypes and containers")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"{self._source}: refuses a persistent id in a DCP metadata pickle")


def load_dcp_pickle(path: str | Path, data: bytes | None = None) -> Any:
    """Unpickle one DCP ``.metadata`` file (or its bytes ``data``, received from another rank) with
    :class:`DcpUnpickler`.

    Raises:
        UnsafePickleError: the pickle names anything outside the admitted set.
        CheckpointFormatError: the file is missing, unreadable, truncated or not a pickle (naming it).
    """
    if data is None:  # read through the storage layer, refused past the bound before a byte is unpickled
        data = read_file(path, _MAX_METADATA_BYTES, "unpickle it")
    return load_allowlisted(path, DcpUnpickler, UnsafePickleError, CheckpointFormatError, data=data,
                            what="readable DCP metadata pickle")


# ---------------------------------------------------------------- metadata -> CheckpointMetadata

@dataclass(frozen=True)
class DcpEntry:
    """Where one stored item lives: ``file`` (relative path), byte ``offset`` and ``length`` in it, the stream
    ``transforms`` to undo (descriptors, applied in order when reading), and ``serialization``
    (``"torch_save"`` or ``"safetensors"``; see the module docstring)."""

    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()
    serialization: str = "torch_save"


def is_dcp_dir(names: set[str] | list[str]) -> bool:
    """True when a directory listing holds DCP metadata (``.metadata`` or ``__{rank}.metadata``)."""
    return DCP_METADATA in names or any(RANK_METADATA.match(n) for n in names)


def _metadata_files(root: Path, shipped: dict[str, bytes] | None = None) -> list[Path]:
    """The metadata pickles of ``root`` (checked to stay inside it before anything opens them)."""
    if (root / DCP_METADATA).is_file() or (shipped and DCP_METADATA in shipped):
        return [checkpoint_file(root, DCP_METADATA, f"{root}: DCP metadata")]
    ranks = sorted(int(m.group(1)) for n in list_names(root) if (m := RANK_METADATA.match(n)))
    if not ranks:
        raise CheckpointFormatError(f"{root}: no DCP metadata ({DCP_METADATA} or __<rank>{DCP_METADATA})")
    return [checkpoint_file(root, f"__{r}{DCP_METADATA}", f"{root}: DCP metadata") for r in ranks]


def _ints(v: Any, what: str, source: Path) -> tuple[int, ...]:
    if not isinstance(v, (tuple, list)) or not all(type(x) is int and x >= 0 for x in v):
        raise CheckpointFormatError(f"{source}: {what} is not a tuple of non-negative ints: {v!r}")
    return tuple(v)


def parse_dcp_metadata(root: str | Path, *, shipped: dict[str, bytes] | None = None, partial: bool = False,
                       fmt: str = "dcp") -> tuple[CheckpointMetadata, dict[tuple[str, str], DcpEntry],
                                                  dict[str, DcpEntry]]:
    """Read and validate the DCP metadata of directory ``root``.

    Returns:
        ``(metadata, tensor_entries, object_entries)``: ``metadata`` has one :class:`TensorMeta` per tensor key
        (global shape, dtype, one :class:`ShardMeta` per chunk, whose ``file`` is the ``.distcp`` file and whose
        ``name`` is unique within that file), ``nested`` paths from the planner data, and
        ``extra["dcp"]`` (version, save id, serialisation, transforms seen); ``tensor_entries`` maps
        ``(file, shard name)`` to the chunk's :class:`DcpEntry`; ``object_entries`` maps each non-tensor key to
        its :class:`DcpEntry`. No data file is opened. ``shipped`` holds the ``.metadata`` bytes when this rank
        cannot see the file (node-local disks); with ``partial`` data files this rank cannot see are not an error.
        ``fmt`` names the result's format (``"dcp"``, or a format built on DCP such as Megatron-Core's).

    Raises:
        UnsafePickleError: a metadata pickle names anything outside the admitted set.
        CheckpointFormatError: malformed metadata (naming the key), a chunk without storage entry, a data file
            that is missing or shorter than an entry it holds.
    """
    root = location(root)
    sdm: dict[str, Any] = {}
    storage: list[tuple[Any, Any]] = []
    planner: dict[str, Any] = {}
    versions, save_ids = set(), set()
    mfiles = _metadata_files(root, shipped)
    for mpath in mfiles:
        raw = load_dcp_pickle(mpath, (shipped or {}).get(mpath.name))
        if not isinstance(raw, DcpMetadata):
            raise CheckpointFormatError(f"{mpath}: expected a DCP Metadata record, found {type(raw).__name__}")
        part = raw.get("state_dict_metadata")
        sdata = raw.get("storage_data")
        if not isinstance(part, dict) or not isinstance(sdata, dict):
            raise CheckpointFormatError(f"{mpath}: DCP metadata lacks state_dict_metadata or storage_data "
                                        "(saved by a storage writer other than FileSystemWriter?)")
        for key, v in part.items():
            if isinstance(v, DcpTensorStorage) and isinstance(sdm.get(key), DcpTensorStorage):
                sdm[key].chunks = list(sdm[key].get("chunks") or []) + list(v.get("chunks") or [])
            else:
                sdm[key] = v
        storage.extend(sdata.items())
        if isinstance(raw.get("planner_data"), dict):
            planner.update(raw.get("planner_data"))
        versions.add(raw.get("version"))
        sm = raw.get("storage_meta")
        if isinstance(sm, DcpStorageMeta):
            save_ids.add(sm.get("save_id"))
    mname = mfiles[0].name if len(mfiles) == 1 else f"__<rank>{DCP_METADATA}"
    msrc = root / mname

    by_index: dict[tuple[str, tuple[int, ...] | None], DcpEntry] = {}
    sizes: dict[str, int] = {}
    transforms_seen: set[str] = set()
    for idx, info in storage:
        if not isinstance(idx, DcpIndex) or not isinstance(info, DcpStorageInfo):
            raise CheckpointFormatError(f"{msrc}: storage_data holds {type(idx).__name__} -> "
                                        f"{type(info).__name__}, expected MetadataIndex -> _StorageInfo")
        fqn = idx.get("fqn")
        rel = info.get("relative_path")
        off, length = info.get("offset"), info.get("length")
        if (not isinstance(fqn, str) or not isinstance(rel, str) or type(off) is not int or type(length) is not int
                or off < 0 or length < 0):
            raise CheckpointFormatError(f"{msrc}: malformed storage entry for {fqn!r}: {info!r}")
        checkpoint_file(root, rel, f"{msrc}: key {fqn!r}")  # no absolute path, no "..", no symlink out
        td = info.get("transform_descriptors") or ()
        if not isinstance(td, (list, tuple)) or not all(isinstance(t, str) for t in td):
            raise CheckpointFormatError(f"{msrc}: key {fqn!r} has malformed transform_descriptors {td!r}")
        for t in td:
            if t.partition("/")[0] != ZSTD_DESCRIPTOR:
                raise CheckpointFormatError(f"{msrc}: key {fqn!r} is stored with stream transform {t!r}; oarlock "
                                            f"undoes only {ZSTD_DESCRIPTOR}/1")
            transforms_seen.add(t)
        o = idx.get("offset")
        okey = None if o is None else _ints(o, f"storage offset of {fqn!r}", msrc)
        if rel not in sizes:
            p = root / rel
            if p.is_file():
                st, key = storage_key(p)
                sizes[rel] = st.size(key)
            elif partial:
                sizes[rel] = -1  # another rank sees it
            else:
                raise CheckpointFormatError(f"{p}: DCP data file holding {fqn!r} is missing")
        by_index[(fqn, okey)] = DcpEntry(rel, off, length, tuple(td))

    meta = CheckpointMetadata(fmt)
    tensor_entries: dict[tuple[str, str], DcpEntry] = {}
    object_entries: dict[str, DcpEntry] = {}
    chunk_files: dict[tuple[str, str], int] = {}
    raw_nbytes: dict[tuple[str, str], int] = {}
    for key, v in sdm.items():
        if not isinstance(key, str):
            raise CheckpointFormatError(f"{msrc}: state_dict_metadata has a non-string key {key!r}")
        if isinstance(v, DcpTensorStorage):
            continue
        if not isinstance(v, DcpBytesStorage):
            raise CheckpointFormatError(f"{msrc}: key {key!r} has storage metadata {type(v).__name__}")
        e = by_index.get((key, None))
        if e is None:
            raise CheckpointFormatError(f"{msrc}: non-tensor key {key!r} has no storage entry")
        _check_range(root, e, sizes, key)
        object_entries[key] = e
    for key, v in sdm.items():
        if not isinstance(v, DcpTensorStorage):
            continue
        props = v.get("properties")
        dt = props.get("dtype") if isinstance(props, DcpTensorProperties) else None
        if not isinstance(dt, torch.dtype):
            raise CheckpointFormatError(f"{msrc}: tensor {key!r} has no dtype")
        try:
            dtn = dtype_name(dt)
        except ValueError:
            raise CheckpointFormatError(f"{msrc}: tensor {key!r} has dtype {dt}, which oarlock does not support") from None
        if props.get("layout", "strided") != "strided":
            raise CheckpointFormatError(f"{msrc}: tensor {key!r} has layout {props.get('layout')}; only strided "
                                        "tensors are supported")
        gshape = _ints(v.get("size"), f"size of {key!r}", msrc)
        chunks = v.get("chunks")
        if not isinstance(chunks, list):
            raise CheckpointFormatError(f"{msrc}: tensor {key!r} has no chunk list")
        for c in chunks:
            if not isinstance(c, DcpChunk):
                raise CheckpointFormatError(f"{msrc}: tensor {key!r} has a chunk of type {type(c).__name__}")
            off = _ints(c.get("offsets"), f"chunk offset of {key!r}", msrc)
            e = by_index.get((key, off))
            if e is None:
                raise CheckpointFormatError(f"{msrc}: chunk of {key!r} at offset {list(off)} has no storage entry")
            chunk_files[(e.file, key)] = chunk_files.get((e.file, key), 0) + 1
    for key, v in sdm.items():
        if not isinstance(v, DcpTensorStorage):
            continue
        dtn = dtype_name(v.properties.get("dtype"))
        gshape = tuple(v.size)
        tm = TensorMeta(key, gshape, dtn)
        for c in v.chunks:
            off, loc = tuple(c.offsets), _ints(c.get("sizes"), f"chunk size of {key!r}", msrc)
            if len(off) != len(gshape) or len(loc) != len(gshape) or any(
                    o + s > g for o, s, g in zip(off, loc, gshape)):
                raise CheckpointFormatError(f"{msrc}: chunk of {key!r} at offset {list(off)} with shape {list(loc)} "
                                            f"does not fit the global shape {list(gshape)}")
            e = by_index[(key, off)]
            name = key if chunk_files[(e.file, key)] == 1 else f"{key}@{','.join(map(str, off))}"
            tensor_entries[(e.file, name)] = e
            raw_nbytes[(e.file, name)] = _nbytes(loc, dtn)
            tm.shards.append(ShardMeta(off, loc, e.file, name))
        meta.tensors[key] = tm
    # Safetensors serialisation: the tensor chunks of a file share one offset (the embedded blob's start) and
    # their length is the raw byte count, so only the blob header can be checked against the file size.
    serial = _detect_serialization(tensor_entries, raw_nbytes)
    if serial == "safetensors":
        tensor_entries = {k: DcpEntry(e.file, e.offset, e.length, e.transforms, "safetensors")
                          for k, e in tensor_entries.items()}
    else:
        for (f, name), e in tensor_entries.items():
            _check_range(root, e, sizes, name)
    for key, path in planner.items():
        if key in sdm and isinstance(path, (tuple, list)) and all(isinstance(p, (str, int)) for p in path):
            if len(path) > 1 or (path and path[0] != key):
                meta.nested[key] = list(path)
    meta.extra["dcp"] = {"version": sorted(str(x) for x in versions if x is not None),
                         "save_id": sorted(str(x) for x in save_ids if x is not None),
                         "serialization": serial, "transforms": sorted(transforms_seen),
                         "metadata_files": [p.name for p in mfiles]}
    return meta, tensor_entries, object_entries


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch_dtype(dtype).itemsize


def _check_range(root: Path, e: DcpEntry, sizes: dict[str, int], what: str) -> None:
    if sizes[e.file] >= 0 and e.offset + e.length > sizes[e.file]:
        raise CheckpointFormatError(f"{root / e.file}: truncated: {what!r} is stored at bytes "
                                    f"[{e.offset}, {e.offset + e.length}) but the file has {sizes[e.file]} bytes")


def _detect_serialization(entries: dict[tuple[str, str], DcpEntry], nbytes: dict[tuple[str, str], int]) -> str:
    """``"safetensors"`` when every tensor entry's length is exactly its chunk's raw byte count (the embedded
    safetensors serialisation records raw lengths); a ``torch.save`` archive is always longer than its data
    (zip records and the pickle). Decided from the metadata alone, so ranks that see no data file agree."""
    if entries and all(not e.transforms and e.length == nbytes[k] for k, e in entries.items()):
        return "safetensors"
    return "torch_save"


# ---------------------------------------------------------------- byte-range reads

def _undo_transforms(raw: io.RawIOBase | io.BytesIO, transforms: tuple[str, ...], where: str) -> Any:
    """A seekable stream of the entry's bytes with its stream transforms undone (zstd frames decompressed)."""
    if not transforms:
        return raw
    try:
        import zstandard
    except ImportError:
        raise CheckpointFormatError(f"{where}: stored zstd-compressed ({', '.join(transforms)}); install the "
                                    "'zstandard' package to read it") from None
    data = raw.read()
    for _ in transforms:
        try:
            data = zstandard.ZstdDecompressor().decompressobj().decompress(data)
        except zstandard.ZstdError as e:
            raise CheckpointFormatError(f"{where}: corrupt zstd stream ({e})") from None
    return io.BytesIO(data)


def load_archive(path: Path, src: RangedFile, entry: DcpEntry, what: str) -> Any:
    """``torch.load(weights_only=True)`` of the ``torch.save`` archive at ``entry``'s byte range of the data file
    ``src`` (opened for ranged reads through the storage layer).

    Raises:
        CheckpointFormatError: the range is not a loadable weights-only archive (naming the file and ``what``);
            a pickle inside it that asks for anything beyond tensors and plain data is refused by torch's
            weights-only unpickler, and reported here.
    """
    where = f"{path} [{entry.offset}, {entry.offset + entry.length}) ({what!r})"
    stream = _undo_transforms(src.window(entry.offset, entry.length), entry.transforms, where)
    return load_weights_only(stream, where)


class _InDataFile(SafetensorsFile):
    """Tensor bytes at known places of a DCP data file, read with the byte-range machinery of
    :class:`SafetensorsFile` through the reader's :class:`RangedFile` (``data_start`` is absolute in the file;
    ``fd`` is the file's descriptor for kernel copies, -1 in a store)."""

    def __init__(self, path: Path, src: RangedFile):  # noqa: super().__init__ would parse a header at byte 0
        self.path, self.src, self.fd = path, src, src.fd

    def read_into(self, buf: memoryview, offset: int) -> None:
        self.src.read_into(buf, offset)

    def close(self) -> None:  # the data file belongs to the reader
        self.fd = -1


class _EmbeddedSafetensors(_InDataFile):
    """The safetensors blob that DCP's safetensors serialisation embeds at byte ``start`` of a ``.distcp`` file.
    The header is checked like a file's: offsets inside the file, sizes matching shapes and dtypes."""

    def __init__(self, path: Path, src: RangedFile, start: int):
        super().__init__(path, src)
        size = src.size
        head = src.pread(8, start)
        if len(head) < 8:
            raise CheckpointFormatError(f"{path}: truncated: no safetensors blob at byte {start}")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - start - 8, MAX_HEADER_BYTES):
            raise CheckpointFormatError(f"{path}: truncated or corrupt: safetensors blob at byte {start} has a "
                                        f"header length {n} past the end of the file")
        try:
            header = json.loads(src.pread(n, start + 8))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointFormatError(f"{path}: safetensors blob at byte {start}: invalid header ({err})") from None
        if not isinstance(header, dict):
            raise CheckpointFormatError(f"{path}: safetensors blob at byte {start}: header is not a JSON object")
        self.data_start = start + 8 + n
        meta = header.get("__metadata__")
        self.header_metadata = dict(meta) if isinstance(meta, dict) else {}
        self.entries = {}
        for name, ent in header.items():
            if name == "__metadata__":
                continue
            try:
                dt = dtype_name(ent["dtype"])
                shape = tuple(int(x) for x in ent["shape"])
                begin, end = (int(x) for x in ent["data_offsets"])
            except (KeyError, TypeError, ValueError) as err:
                raise CheckpointFormatError(f"{path}: blob tensor {name!r}: bad header entry ({err})") from None
            if begin < 0 or end - begin != _nbytes(shape, dt) or self.data_start + end > size:
                raise CheckpointFormatError(f"{path}: truncated or corrupt: blob tensor {name!r} at data offsets "
                                            f"[{begin}, {end}) does not fit shape {list(shape)} {dt} in a file of "
                                            f"{size} bytes")
            self.entries[name] = (dt, shape, begin, end)


class _ArchiveView(_InDataFile):
    """The tensor bytes inside one ``torch.save`` archive: ``entries`` holds the one stored tensor under
    ``name``."""

    def __init__(self, path: Path, src: RangedFile, name: str, dtype: str, shape: tuple[int, ...], start: int):
        super().__init__(path, src)
        self.data_start = start
        self.header_metadata = {}
        self.entries = {name: (dtype, shape, 0, _nbytes(shape, dtype))}


def archive_tensor_view(path: Path, src: RangedFile, entry: DcpEntry, name: str, dtype: str,
                        shape: tuple[int, ...]) -> _ArchiveView | None:
    """Locate the raw bytes of the one tensor a DCP ``torch.save`` chunk archive holds (at ``entry``'s byte range
    of the data file ``src``), without loading them.

    The archive's pickle is loaded with ``torch.load(weights_only=True, map_location="meta")`` (it reads the few
    KiB of records, never the data) to learn the tensor's dtype, shape, contiguity and storage offset; the zip
    directory (Python's ``zipfile``) gives the one ``data/<key>`` record, which must be stored uncompressed, hold
    exactly the storage's bytes and be little-endian (``byteorder`` record); the record's local header gives where
    its bytes start. Returns None (the caller then loads the whole archive) for anything else: stream transforms,
    a non-contiguous tensor, several storages.

    Raises:
        CheckpointFormatError: the archive is not a weights-only torch.save archive, or holds another tensor than
            the metadata describes.
    """
    import zipfile

    if entry.transforms:
        return None
    where = f"{path} [{entry.offset}, {entry.offset + entry.length}) ({name!r})"
    t = load_weights_only(src.window(entry.offset, entry.length), where, map_location="meta")
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != torch_dtype(dtype):
        got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise CheckpointFormatError(f"{where}: holds {got}, metadata says {dtype} {list(shape)}")
    if not t.is_contiguous():
        return None
    try:
        z = zipfile.ZipFile(src.window(entry.offset, entry.length))
        infos = z.infolist()
        data = [i for i in infos if "/data/" in i.filename and not i.filename.endswith("/")]
        order = [i for i in infos if i.filename.endswith("/byteorder")]
        little = not order or z.read(order[0]).strip() == b"little"
    except (zipfile.BadZipFile, OSError, ValueError):
        return None
    nbytes = t.untyped_storage().nbytes()
    if len(data) != 1 or data[0].compress_type != zipfile.ZIP_STORED or data[0].file_size != nbytes or not little:
        return None
    head = src.pread(30, entry.offset + data[0].header_offset)
    if len(head) < 30 or head[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    start = data[0].header_offset + 30 + name_len + extra_len
    if start + nbytes > entry.length:
        return None
    return _ArchiveView(path, src, name, dtype, tuple(shape),
                        entry.offset + start + t.storage_offset() * t.element_size())


@register_format
class DcpReader(CheckpointReader):
    """Reader of ``torch.distributed.checkpoint`` directories (see the module docstring).

    Every chunk is read by byte ranges (``os.preadv`` into the destination; :meth:`byte_run` for zero-copy
    conversion): in the safetensors serialisation through the embedded blob's header, in the ``torch.save`` one
    through the tensor record located inside the archive (:func:`archive_tensor_view`, after a weights-only
    ``map_location="meta"`` load of its pickle). Archives that cannot be read that way (zstd-compressed ones) are
    loaded whole with ``torch.load(weights_only=True)``, the last one cached.
    Non-tensor values (``BytesStorageMetadata``) are loaded at open time into ``metadata.objects``; any a
    weights-only load refuses is listed in ``metadata.extra["dcp"]["refused_objects"]`` and never unpickled.
    """

    format = "dcp"
    priority = 1
    hint = ".metadata + __<rank>_<i>.distcp (torch.distributed.checkpoint)"
    metadata_files = (DCP_METADATA,)

    def __init__(self, root: Path, metadata: CheckpointMetadata, entries: dict[tuple[str, str], DcpEntry]):
        super().__init__(root, metadata)
        self.entries = entries
        self._data: dict[str, RangedFile] = {}
        self._blobs: dict[tuple[str, int], _EmbeddedSafetensors] = {}
        self._views: dict[tuple[str, str], _ArchiveView | None] = {}
        self._last: tuple[tuple[str, str], torch.Tensor] | None = None

    @classmethod
    def claim(cls, path: Path, names: set[str] | None) -> int:
        return 2 if names is not None and is_dcp_dir(names) and not _is_megatron(path, names) else 0

    @classmethod
    def open(cls, path: Path, *, shipped: dict[str, bytes] | None = None, partial: bool = False) -> "DcpReader":
        return cls.open_as(path, shipped=shipped, partial=partial, fmt=cls.format)

    @classmethod
    def open_as(cls, path: Path, *, shipped: dict[str, bytes] | None, partial: bool, fmt: str) -> Any:
        meta, entries, objects = parse_dcp_metadata(path, shipped=shipped, partial=partial, fmt=fmt)
        reader = cls(path, meta, entries)
        values, refused = reader.load_objects(objects)
        meta.objects.update(values)
        meta.extra["dcp"]["refused_objects"] = refused
        regroup_list_objects(meta)
        return reader

    def close(self) -> None:
        super().close()
        for f in self._data.values():
            f.close()
        self._data.clear()
        self._blobs.clear()
        self._views.clear()
        self._last = None

    def data_file(self, file: str) -> RangedFile:
        """Data file ``file`` opened for ranged reads through the storage layer (opened once)."""
        f = self._data.get(file)
        if f is None:
            f = self._data[file] = RangedFile(self.path_of(file))
            self.files_opened.append(file)
        return f

    def fd(self, file: str) -> int:
        """The descriptor of data file ``file`` (-1 for an object in a store; see :meth:`data_file`)."""
        return self.data_file(file).fd

    def load_objects(self, entries: dict[str, DcpEntry]) -> tuple[dict[str, Any], dict[str, str]]:
        """Load non-tensor values with ``torch.load(weights_only=True)`` from the data files this rank sees.

        Returns ``(values, refused)``: key -> value, and key -> reason for archives a weights-only load refuses
        (a custom class, a pickle calling a function): reported, never unpickled."""
        values: dict[str, Any] = {}
        refused: dict[str, str] = {}
        for key, e in entries.items():
            if not self.path_of(e.file).is_file():
                continue
            try:
                values[key] = load_archive(self.path_of(e.file), self.data_file(e.file), e, key)
            except CheckpointFormatError as err:
                refused[key] = str(err)
        return values, refused

    def _blob(self, e: DcpEntry) -> _EmbeddedSafetensors:
        b = self._blobs.get((e.file, e.offset))
        if b is None:
            b = self._blobs[(e.file, e.offset)] = _EmbeddedSafetensors(self.path_of(e.file), self.data_file(e.file),
                                                                       e.offset)
        return b

    def _entry(self, key: str, file: str, name: str) -> DcpEntry:
        e = self.entries.get((file, name))
        if e is None:
            raise CheckpointFormatError(f"{self.path_of(file)}: no DCP storage entry for chunk {name!r} of {key!r}")
        return e

    def chunk(self, key: str, file: str, name: str) -> torch.Tensor:
        """The whole stored chunk ``name`` of ``file`` (tensor ``key``) as a CPU tensor of its local shape.

        Raises:
            CheckpointFormatError: missing entry, unreadable bytes, or a stored tensor whose shape or dtype
                differs from the metadata (naming file and key).
        """
        if self._last is not None and self._last[0] == (file, name):
            return self._last[1]
        e = self._entry(key, file, name)
        tm = self.metadata.tensors[key]
        shape = next(s.local_shape for s in tm.shards if s.file == file and s.name == name)
        path = self.path_of(file)
        if e.serialization == "safetensors":
            t = self._blob(e).read_box(key, 0, shape, tuple((0, n) for n in shape), tm.dtype)
        else:
            t = load_archive(path, self.data_file(file), e, key)
            if not isinstance(t, torch.Tensor):
                raise CheckpointFormatError(f"{path}: chunk of {key!r} holds {type(t).__name__}, not a tensor")
            if tuple(t.shape) != tuple(shape) or t.dtype != torch_dtype(tm.dtype):
                raise CheckpointFormatError(f"{path}: chunk of {key!r} is {t.dtype} {list(t.shape)}, metadata says "
                                            f"{tm.dtype} {list(shape)}")
        self._last = ((file, name), t)
        return t

    def _view(self, key: str, file: str, name: str) -> tuple[SafetensorsFile, str] | None:
        """Byte-range access to chunk ``name``: the embedded safetensors blob, or the raw bytes located inside its
        torch.save archive; None when only a whole-archive load can read it (zstd, odd archives)."""
        e = self._entry(key, file, name)
        if e.serialization == "safetensors":
            blob = self._blob(e)
            if key not in blob.entries:
                raise CheckpointFormatError(f"{self.path_of(file)}: embedded safetensors blob at byte {e.offset} "
                                            f"lacks tensor {key!r}")
            return blob, key
        if (file, name) not in self._views:
            tm = self.metadata.tensors[key]
            shape = next(s.local_shape for s in tm.shards if s.file == file and s.name == name)
            self._views[(file, name)] = archive_tensor_view(self.path_of(file), self.data_file(file), e, name,
                                                            tm.dtype, shape)
        v = self._views[(file, name)]
        return (v, name) if v is not None else None

    def check_read(self, key: str, file: str, name: str, flat_start: int, shape: tuple[int, ...]) -> None:
        """The file is there and, where the chunk has byte-range access (an embedded safetensors blob, a raw
        torch.save record), its header holds the array: checked before any target byte is written.

        Raises:
            CheckpointFormatError: naming the file and chunk.
        """
        super().check_read(key, file, name, flat_start, shape)
        view = self._view(key, file, name)
        if view is not None:
            view[0].check_array(view[1], flat_start, shape, self.metadata.tensors[key].dtype)

    def read_box(self, key: str, file: str, name: str, flat_start: int, shape: tuple[int, ...],
                 box: tuple[tuple[int, int], ...], out: torch.Tensor | None = None) -> torch.Tensor:
        view = self._view(key, file, name)
        if view is not None:
            return view[0].read_box(view[1], flat_start, shape, box, self.metadata.tensors[key].dtype, out)
        return box_of_stored(self.chunk(key, file, name), flat_start, shape, box, out)

    def byte_run(self, key: str, file: str, name: str, flat_start: int, shape: tuple[int, ...],
                 box: tuple[tuple[int, int], ...]) -> tuple[int, int, int] | None:
        view = self._view(key, file, name)
        if view is None:
            return None
        f, stored = view
        ent = f.entries.get(stored)
        if f.fd < 0:  # an object in a store: no descriptor for kernel copies (read_box fetches it)
            return None
        run = contiguous_run(shape, box)
        dtype = self.metadata.tensors[key].dtype
        if run is None or ent is None or ent[0] != dtype or flat_start + np_prod(shape) > np_prod(ent[1]):
            return None
        isz = torch_dtype(dtype).itemsize
        return f.fd, f.data_start + ent[2] + (flat_start + run[0]) * isz, run[1] * isz


def regroup_list_objects(meta: CheckpointMetadata) -> None:
    """Give non-tensor lists oarlock's key convention.

    DCP flattens lists of dicts element by element (``optim.param_groups.0.lr``, with the path
    ``("optim", "param_groups", 0, "lr")`` in the planner data); oarlock keeps a list without tensors as one value
    (``optim.param_groups``). Values whose path has a list index, under a prefix that holds no tensor, are
    reassembled into that one list-valued object (in place); everything else is left as it is."""
    groups: dict[tuple, list[tuple[tuple, str]]] = {}
    for key in list(meta.objects):
        path = tuple(meta.nested.get(key, [key]))
        cut = next((i for i, p in enumerate(path) if isinstance(p, int)), None)
        if cut is None or cut == 0:
            continue
        groups.setdefault(path[:cut], []).append((path[cut:], key))
    tensor_paths = [tuple(meta.nested.get(k, [k])) for k in meta.tensors]
    for prefix, members in groups.items():
        if any(tp[:len(prefix)] == prefix for tp in tensor_paths):
            continue
        root: list = []
        for rest, key in sorted(members, key=lambda m: [str(x) for x in m[0]]):
            node: Any = root
            for i, (p, nxt) in enumerate(zip(rest, rest[1:] + (None,))):
                last = nxt is None
                if isinstance(node, list):
                    if not isinstance(p, int):
                        break
                    while len(node) <= p:
                        node.append(None)
                    if last:
                        node[p] = meta.objects[key]
                    else:
                        if node[p] is None:
                            node[p] = [] if isinstance(nxt, int) else {}
                        node = node[p]
                else:
                    if last:
                        node[p] = meta.objects[key]
                    else:
                        node = node.setdefault(p, [] if isinstance(nxt, int) else {})
            else:
                del meta.objects[key]
                meta.nested.pop(key, None)
        name = ".".join(str(p) for p in prefix)
        meta.objects[name] = root
        if len(prefix) > 1 or prefix[0] != name:
            meta.nested[name] = list(prefix)


MEGATRON_METADATA = "metadata.json"


def _is_megatron(path: Path, names: set[str]) -> bool:
    """A Megatron-Core ``torch_dist`` directory: ``metadata.json`` naming ``sharded_backend`` (read by
    :mod:`oarlock.checkpoint.formats.megatron`)."""
    if MEGATRON_METADATA not in names:
        return False
    try:
        st, key = storage_key(checkpoint_file(path, MEGATRON_METADATA, MEGATRON_METADATA))
        head = st.read_head(key, 4096)[0]
    except (OSError, CheckpointError):
        return False
    return b'"sharded_backend"' in head


# ---------------------------------------------------------------- writing DCP

def _dcp_terminal(value: Any) -> bool:
    if isinstance(value, dict):
        return False
    if isinstance(value, list):
        return all(_dcp_terminal(v) for v in value)
    return True


def _dcp_flatten(path: tuple, value: Any) -> Any:
    """``(path, leaf)`` pairs of a value as torch DCP's ``traverse_state_dict`` flattens it: dicts are always
    entered, lists only when they hold a dict or a list that is entered, tuples never."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _dcp_flatten(path + (str(k),), v)
    elif _dcp_terminal(value):
        yield path, value
    else:
        for i, v in enumerate(value):
            yield from _dcp_flatten(path + (i,), v)


class DcpWriter:
    """Writes a ``torch.distributed.checkpoint`` directory that torch's ``dcp.load`` reads: one
    ``__{rank}_0.distcp`` file per writing rank holding each chunk as a ``torch.save`` archive, non-tensor values
    as ``torch.save`` archives in rank 0's file, and ``.metadata`` (the pickled ``Metadata`` built from torch's own
    classes) written last.

    Args:
        root: the directory to fill (normally a staging directory, published by the caller).
        tensors: key -> :class:`TensorMeta` whose shards name the writing rank's file (any name; files are
            renamed ``__{i}_0.distcp`` in sorted order).
        nested: flat key -> path in the nested state dict (the ``planner_data`` DCP's default planner writes).

    Use :meth:`put` for every shard, :meth:`put_object` for values, then :meth:`finish`.
    """

    def __init__(self, root: Path, tensors: dict[str, TensorMeta], nested: dict[str, list] | None = None):
        self.root = location(root)
        self.tensors = tensors
        self.nested = dict(nested or {})
        names = sorted({s.file for t in tensors.values() for s in t.shards})
        self.file_of = {n: f"__{i}_0{DCP_SUFFIX}" for i, n in enumerate(names)}
        self._streams: dict[str, AppendStream] = {}
        self._storage: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
        self._objects: list[str] = []

    def _stream(self, file: str) -> Any:
        f = self._streams.get(file)
        if f is None:
            f = self._streams[file] = AppendStream(self.root / file)
        return f

    def _append(self, file: str, obj: Any) -> tuple[int, int]:
        f = self._stream(file)
        start = f.tell()
        torch.save(obj, f)
        return start, f.tell() - start

    def put(self, key: str, shard: ShardMeta, tensor: torch.Tensor) -> int:
        """Write one chunk (the shard's box of ``key``); returns its bytes."""
        t = tensor.detach().to("cpu").contiguous()
        if t.untyped_storage().nbytes() != t.nbytes or t.storage_offset():
            t = t.clone()  # torch.save writes the whole storage: a view would drag its base along
        file = self.file_of[shard.file]
        off, n = self._append(file, t)
        self._storage[(key, tuple(shard.global_offset))] = (file, off, n)
        return t.nbytes

    def put_object(self, key: str, value: Any) -> None:
        """Write one non-tensor value (``BytesStorageMetadata``) into the first data file, split the way DCP's
        default planner flattens state dicts (dicts, and lists holding dicts or lists, become one entry per
        element), so that ``dcp.load`` into the nested state dict finds every entry."""
        path = tuple(self.nested.get(key, [key]))
        for sub, leaf in _dcp_flatten(path, value):
            flat = ".".join(str(p) for p in sub)
            buf = io.BytesIO()
            torch.save(leaf, buf)
            file = f"__0_0{DCP_SUFFIX}"
            f = self._stream(file)
            start = f.tell()
            f.write(buf.getbuffer())
            self._storage[(flat, None)] = (file, start, f.tell() - start)
            self._objects.append(flat)
            self.nested[flat] = list(sub)

    def close(self) -> None:
        """Drop the data files of an unfinished write (after :meth:`finish`, nothing is left to do)."""
        for f in self._streams.values():
            f.abort()
        self._streams.clear()

    def finish(self) -> None:
        """Make the data files durable (the store's writer: ``fsync`` on a filesystem), then write ``.metadata``
        (durably; on a filesystem under a temporary name, then renamed)."""
        import pickle
        import uuid

        from torch.distributed.checkpoint import filesystem as dcp_fs
        from torch.distributed.checkpoint import metadata as dcp_md

        for f in self._streams.values():
            f.close()
        self._streams.clear()
        sdm: dict[str, Any] = {}
        storage: dict[Any, Any] = {}
        for key, t in self.tensors.items():
            props = dcp_md.TensorProperties(dtype=torch_dtype(t.dtype))
            chunks = [dcp_md.ChunkStorageMetadata(torch.Size(s.global_offset), torch.Size(s.local_shape))
                      for s in t.shards]
            sdm[key] = dcp_md.TensorStorageMetadata(props, torch.Size(t.global_shape), chunks)
            for i, s in enumerate(t.shards):
                file, off, n = self._storage[(key, tuple(s.global_offset))]
                storage[dcp_md.MetadataIndex(key, s.global_offset, i)] = dcp_fs._StorageInfo(file, off, n)
        for key in self._objects:
            sdm[key] = dcp_md.BytesStorageMetadata()
            file, off, n = self._storage[(key, None)]
            storage[dcp_md.MetadataIndex(key)] = dcp_fs._StorageInfo(file, off, n)
        planner = {k: tuple(self.nested.get(k, [k])) for k in sdm}
        md = dcp_md.Metadata(sdm, planner_data=planner, storage_data=storage,
                             storage_meta=dcp_md.StorageMeta(save_id=str(uuid.uuid4())), version="1.0.0")
        # on a filesystem under a temporary name, then renamed; a store's object appears whole when written
        renames = storage_for(self.root).renames
        name = DCP_METADATA + ".tmp" if renames else DCP_METADATA
        with AppendStream(self.root / name) as f:
            pickle.dump(md, f)
        if renames:
            rename_within(self.root, name, DCP_METADATA)
