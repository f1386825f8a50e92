"""Writing a ``torch.distributed.checkpoint`` ("DCP") directory that torch's ``dcp.load`` reads
(:class:`DcpWriter`, used by ``oarlock convert --to dcp``); the format is described in
:mod:`oarlock.checkpoint.formats.dcp`. Every byte goes through the storage layer (:class:`AppendStream`)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from oarlock.checkpoint.model.metadata import ShardMeta, TensorMeta
from oarlock.checkpoint.formats.dcp_metadata import DCP_METADATA, DCP_SUFFIX
from oarlock.checkpoint.storage import rename_within
from oarlock.checkpoint.storage.files import AppendStream
from oarlock.checkpoint.storage.location import location, storage_for
from oarlock.utils import torch_dtype


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
