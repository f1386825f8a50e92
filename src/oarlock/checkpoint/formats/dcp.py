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

This module reads the data files (:class:`DcpReader`); the metadata side (the inert records, :class:`DcpUnpickler`,
:func:`parse_dcp_metadata`) lives in :mod:`oarlock.checkpoint.formats.dcp_metadata` and the writer
(:class:`DcpWriter`) in :mod:`oarlock.checkpoint.formats.dcp_writer`; their public names are re-exported here.
"""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path
from typing import Any

import torch

from oarlock.checkpoint.errors import CheckpointError, CheckpointFormatError
from oarlock.checkpoint.model.metadata import CheckpointMetadata
from oarlock.checkpoint.formats.dcp_metadata import (DCP_METADATA, DCP_SUFFIX, RANK_METADATA, ZSTD_DESCRIPTOR,
                                                     DcpBytesStorage, DcpChunk, DcpEntry, DcpIndex, DcpMetadata,
                                                     DcpPlanRecord, DcpRecord, DcpStorageInfo, DcpStorageMeta,
                                                     DcpTensorProperties, DcpTensorStorage, DcpUnpickler,
                                                     chunk_nbytes, is_dcp_dir, load_dcp_pickle, parse_dcp_metadata)
from oarlock.checkpoint.formats.dcp_writer import DcpWriter
from oarlock.checkpoint.formats.reader import (CheckpointReader, box_of_stored, checkpoint_file, load_weights_only,
                                               register_format)
from oarlock.checkpoint.storage.safetensors import MAX_HEADER_BYTES, SafetensorsFile, contiguous_run, np_prod
from oarlock.checkpoint.storage.files import RangedFile
from oarlock.checkpoint.storage.location import storage_key
from oarlock.utils import dtype_name, torch_dtype

__all__ = ["DCP_METADATA", "DCP_SUFFIX", "MEGATRON_METADATA", "RANK_METADATA", "ZSTD_DESCRIPTOR", "DcpBytesStorage",
           "DcpChunk", "DcpEntry", "DcpIndex", "DcpMetadata", "DcpPlanRecord", "DcpReader", "DcpRecord",
           "DcpStorageInfo", "DcpStorageMeta", "DcpTensorProperties", "DcpTensorStorage", "DcpUnpickler", "DcpWriter",
           "archive_tensor_view", "is_dcp_dir", "load_archive", "load_dcp_pickle", "parse_dcp_metadata",
           "regroup_list_objects"]


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
            if begin < 0 or end - begin != chunk_nbytes(shape, dt) or self.data_start + end > size:
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
        self.entries = {name: (dtype, shape, 0, chunk_nbytes(shape, dtype))}


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
