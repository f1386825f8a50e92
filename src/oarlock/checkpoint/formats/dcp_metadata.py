"""The metadata of a ``torch.distributed.checkpoint`` ("DCP") directory, read without trusting it: the
``.metadata`` pickle (or the per-rank ``__{rank}.metadata`` pickles, merged) unpickled as inert records, then
validated into a :class:`~oarlock.checkpoint.model.metadata.CheckpointMetadata` and the byte ranges of every stored
item (:class:`DcpEntry`). No data file is opened here; :mod:`oarlock.checkpoint.formats.dcp` reads them (the
on-disk format is described there).

Safety: the ``.metadata`` pickle goes through :class:`DcpUnpickler`, which admits exactly the DCP metadata
classes (mapped onto inert local records), ``torch.Size``, dtypes, the layout and memory-format tags and plain
containers; anything else raises :class:`~oarlock.checkpoint.errors.UnsafePickleError` before it runs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from oarlock.checkpoint.errors import CheckpointFormatError, UnsafePickleError
from oarlock.checkpoint.model.metadata import CheckpointMetadata, ShardMeta, TensorMeta
from oarlock.checkpoint.formats.reader import checkpoint_file
from oarlock.checkpoint.storage.files import list_names, read_file
from oarlock.checkpoint.storage.location import location, storage_key
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


@dataclass
class _MergedMetadata:
    """The metadata pickles of one checkpoint (``files``) merged: ``sdm`` (``state_dict_metadata``, the chunk lists
    of a tensor key saved by several ranks joined), the ``storage_data`` items, ``planner_data``, and the versions and
    save ids the pickles name."""

    files: list[Path]
    sdm: dict[str, Any] = field(default_factory=dict)
    storage: list[tuple[Any, Any]] = field(default_factory=list)
    planner: dict[str, Any] = field(default_factory=dict)
    versions: set = field(default_factory=set)
    save_ids: set = field(default_factory=set)


def _merge_metadata(root: Path, shipped: dict[str, bytes] | None) -> _MergedMetadata:
    """Unpickle every metadata file of ``root`` (or its ``shipped`` bytes) and merge them."""
    merged = _MergedMetadata(_metadata_files(root, shipped))
    sdm = merged.sdm
    for mpath in merged.files:
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
        merged.storage.extend(sdata.items())
        if isinstance(raw.get("planner_data"), dict):
            merged.planner.update(raw.get("planner_data"))
        merged.versions.add(raw.get("version"))
        sm = raw.get("storage_meta")
        if isinstance(sm, DcpStorageMeta):
            merged.save_ids.add(sm.get("save_id"))
    return merged


def _storage_entry(root: Path, msrc: Path, idx: Any, info: Any) -> tuple[tuple[str, tuple[int, ...] | None],
                                                                          DcpEntry]:
    """One validated ``storage_data`` item: ``((fqn, global offset or None), entry)``. The relative path is checked
    to stay inside ``root``; the only stream transform admitted is zstd."""
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
    o = idx.get("offset")
    okey = None if o is None else _ints(o, f"storage offset of {fqn!r}", msrc)
    return (fqn, okey), DcpEntry(rel, off, length, tuple(td))


def _data_file_size(root: Path, rel: str, fqn: str, partial: bool) -> int:
    """The size of data file ``rel`` (holding ``fqn``); -1 when this rank cannot see it and ``partial`` allows it."""
    p = root / rel
    if p.is_file():
        st, key = storage_key(p)
        return st.size(key)
    if partial:
        return -1  # another rank sees it
    raise CheckpointFormatError(f"{p}: DCP data file holding {fqn!r} is missing")


def _storage_entries(root: Path, msrc: Path, storage: list[tuple[Any, Any]], partial: bool
                     ) -> tuple[dict[tuple[str, tuple[int, ...] | None], DcpEntry], dict[str, int], set[str]]:
    """``(entries, sizes, transforms)``: every storage item by ``(fqn, global offset or None)``, the size of every
    data file they name (-1: not visible here), and the stream transforms seen."""
    by_index: dict[tuple[str, tuple[int, ...] | None], DcpEntry] = {}
    sizes: dict[str, int] = {}
    transforms_seen: set[str] = set()
    for idx, info in storage:
        index, e = _storage_entry(root, msrc, idx, info)
        transforms_seen.update(e.transforms)
        if e.file not in sizes:
            sizes[e.file] = _data_file_size(root, e.file, index[0], partial)
        by_index[index] = e
    return by_index, sizes, transforms_seen


def _object_entries(root: Path, msrc: Path, sdm: dict[str, Any],
                    by_index: dict[tuple[str, tuple[int, ...] | None], DcpEntry],
                    sizes: dict[str, int]) -> dict[str, DcpEntry]:
    """The storage entry of every non-tensor key (``BytesStorageMetadata``), checked to fit its data file; every
    key is checked to be a string and every value to be tensor or bytes storage metadata."""
    object_entries: dict[str, DcpEntry] = {}
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
    return object_entries


def _chunks_per_file(msrc: Path, sdm: dict[str, Any],
                     by_index: dict[tuple[str, tuple[int, ...] | None], DcpEntry]) -> dict[tuple[str, str], int]:
    """Check every tensor's dtype, layout, size and chunk offsets (each chunk must have a storage entry) and count
    the chunks of each ``(file, key)``: a shard name carries its offset only where a file holds several."""
    chunk_files: dict[tuple[str, str], int] = {}
    for key, v in sdm.items():
        if not isinstance(v, DcpTensorStorage):
            continue
        props = v.get("properties")
        dt = props.get("dtype") if isinstance(props, DcpTensorProperties) else None
        if not isinstance(dt, torch.dtype):
            raise CheckpointFormatError(f"{msrc}: tensor {key!r} has no dtype")
        try:
            dtype_name(dt)
        except ValueError:
            raise CheckpointFormatError(f"{msrc}: tensor {key!r} has dtype {dt}, which oarlock does not support") from None
        if props.get("layout", "strided") != "strided":
            raise CheckpointFormatError(f"{msrc}: tensor {key!r} has layout {props.get('layout')}; only strided "
                                        "tensors are supported")
        _ints(v.get("size"), f"size of {key!r}", msrc)
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
    return chunk_files


def _add_tensors(meta: CheckpointMetadata, msrc: Path, sdm: dict[str, Any],
                 by_index: dict[tuple[str, tuple[int, ...] | None], DcpEntry],
                 chunk_files: dict[tuple[str, str], int]) -> tuple[dict[tuple[str, str], DcpEntry],
                                                                   dict[tuple[str, str], int]]:
    """Add one :class:`TensorMeta` per (checked) tensor key to ``meta``, each chunk checked to fit the global shape.
    Returns ``(entries, raw_nbytes)``, both keyed by ``(file, shard name)``."""
    tensor_entries: dict[tuple[str, str], DcpEntry] = {}
    raw_nbytes: dict[tuple[str, str], int] = {}
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
            raw_nbytes[(e.file, name)] = chunk_nbytes(loc, dtn)
            tm.shards.append(ShardMeta(off, loc, e.file, name))
        meta.tensors[key] = tm
    return tensor_entries, raw_nbytes


def _nested_paths(meta: CheckpointMetadata, planner: dict[str, Any], sdm: dict[str, Any]) -> None:
    """``meta.nested`` from the planner data: the path of every stored key whose path is not the key itself."""
    for key, path in planner.items():
        if key in sdm and isinstance(path, (tuple, list)) and all(isinstance(p, (str, int)) for p in path):
            if len(path) > 1 or (path and path[0] != key):
                meta.nested[key] = list(path)


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
    merged = _merge_metadata(root, shipped)
    mfiles, sdm = merged.files, merged.sdm
    mname = mfiles[0].name if len(mfiles) == 1 else f"__<rank>{DCP_METADATA}"
    msrc = root / mname
    by_index, sizes, transforms_seen = _storage_entries(root, msrc, merged.storage, partial)

    meta = CheckpointMetadata(fmt)
    object_entries = _object_entries(root, msrc, sdm, by_index, sizes)
    chunk_files = _chunks_per_file(msrc, sdm, by_index)
    tensor_entries, raw_nbytes = _add_tensors(meta, msrc, sdm, by_index, chunk_files)
    # Safetensors serialisation: the tensor chunks of a file share one offset (the embedded blob's start) and
    # their length is the raw byte count, so only the blob header can be checked against the file size.
    serial = _detect_serialization(tensor_entries, raw_nbytes)
    if serial == "safetensors":
        tensor_entries = {k: DcpEntry(e.file, e.offset, e.length, e.transforms, "safetensors")
                          for k, e in tensor_entries.items()}
    else:
        for (f, name), e in tensor_entries.items():
            _check_range(root, e, sizes, name)
    _nested_paths(meta, merged.planner, sdm)
    meta.extra["dcp"] = {"version": sorted(str(x) for x in merged.versions if x is not None),
                         "save_id": sorted(str(x) for x in merged.save_ids if x is not None),
                         "serialization": serial, "transforms": sorted(transforms_seen),
                         "metadata_files": [p.name for p in mfiles]}
    return meta, tensor_entries, object_entries


def chunk_nbytes(shape: tuple[int, ...], dtype: str) -> int:
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
