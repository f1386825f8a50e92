"""The storage subpackage: the only code in the checkpoint package that touches files or object stores.

* :mod:`.backend`: the :class:`Storage` protocol (list, stat, ranged read into a buffer, streamed durable write,
  delete); :mod:`.local` (the filesystem, ``preadv``/``pwrite``), :mod:`.s3` (S3-compatible stores, boto3) and
  :mod:`.memory` (``mem://``, the tests' in-memory store) implement it.
* :mod:`.location`: what a user passed -> a local ``Path`` or an :class:`ObjectPath`, and the store holding it.
* :mod:`.commit`: the commit protocol (stage, publish, recover, the destination rule), one implementation per
  kind of store, reached through :func:`commit_for`.

The functions below keep the names and signatures the checkpoint code and users called before the storage
layer had its own package (``oarlock.checkpoint.storage`` was one module): each one dispatches to the commit
protocol of its location.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from typing import Any, Iterable

from oarlock.checkpoint.storage.backend import (ObjectStoreError, ObjectWriter, Storage, UnsupportedLocationError,
                                                pread_into)
from oarlock.checkpoint.storage.commit import (FORMAT_ALIASES, INCOMPLETE_MARKER, WRITTEN_MANIFEST, CommitProtocol,
                                               commit_for)
from oarlock.checkpoint.storage.commit.local import (fsync_dir, hold_staging, release_staging, remove_stale_staging,
                                                     written_entries)
from oarlock.checkpoint.storage.commit.objects import (check_object_destination, object_entries,
                                                       prepare_object_destination, publish_objects,
                                                       remove_uncommitted_objects, upload_directory)
from oarlock.checkpoint.storage.files import RangedFile
from oarlock.checkpoint.storage.local import LocalStorage
from oarlock.checkpoint.storage.location import (ObjectPath, is_object_path, location, register_store, storage_for,
                                                 storage_key)
from oarlock.checkpoint.storage.s3 import S3Storage  # importing it registers s3://

__all__ = ["CheckpointReader", "CommitProtocol", "FORMAT_ALIASES", "HF_INDEX", "HF_SINGLE", "INCOMPLETE_MARKER",
           "LocalStorage", "ObjectPath", "ObjectStoreError", "ObjectWriter", "PADDLE_HF_CACHE", "S3Storage",
           "SafetensorsFile", "Storage", "UnsupportedLocationError", "View", "WRITTEN_MANIFEST", "check_destination",
           "check_object_destination", "commit_for", "contiguous_run", "copy_file", "detect_format", "fsync_dir",
           "gather_view", "hold_staging", "is_committed", "is_object_path", "location", "np_prod", "object_entries",
           "open_checkpoint", "open_read", "pread_into", "prepare_object_destination", "publish_directory",
           "publish_objects", "read_metadata", "recover_publish", "register_store", "release_staging",
           "remove_stale_staging", "remove_uncommitted_objects", "rename_within", "resolve_manager_root",
           "safetensors_header", "staged_directory", "staging_path", "storage_for", "storage_key", "upload_directory",
           "write_safetensors", "written_entries"]


def detect_format(path: "str | os.PathLike | ObjectPath") -> str:
    """Name the checkpoint format at ``path``: ``"oarlock"``, ``"huggingface"``, ``"safetensors"``, ``"dcp"``,
    ``"paddle"``, ... (``docs/checkpoint-format.md``). An interrupted replacement of the checkpoint is completed
    first; in an object store the commit record decides (stores hold oarlock checkpoints only).

    Raises:
        CheckpointFormatError: path missing, or a directory that holds no checkpoint, an unfinished save, or
            mixes formats.
    """
    p = location(path)
    return commit_for(p).detect(p)


def is_committed(p: Any) -> bool:
    """Whether location ``p`` holds a committed oarlock checkpoint (see the commit protocol of its store)."""
    return commit_for(p).is_committed(location(p))


def recover_publish(final: "str | os.PathLike | ObjectPath") -> None:
    """Complete or undo a replacement of ``final`` whose writer died (a no-op in stores without rename)."""
    commit_for(final).recover(location(final))


def check_destination(final: "str | os.PathLike | ObjectPath", fmt: str, sources: Iterable[Any] = (), *,
                      overwrite: bool = False) -> set[str]:
    """The destination rule of every writer (``docs/checkpoint-format.md``, destination rule): ``final`` is
    refused when it overlaps one of ``sources``, exists and is not a directory, or holds anything oarlock did not
    write or is not a checkpoint of format ``fmt``, unless ``overwrite`` (the entries oarlock did not write are
    then kept). Returns the names of the entries to keep.

    Raises:
        CheckpointDestinationError: naming the destination, the reason, and the entries oarlock did not write.
    """
    final = location(final)
    return commit_for(final).check_destination(final, fmt, sources, overwrite=overwrite)


def staging_path(final: Any, token: str | None = None) -> Any:
    """Where a save to ``final`` writes its data (a hidden sibling on a filesystem; ``final`` in a store)."""
    final = location(final)
    return commit_for(final).staging_path(final, token)


def staged_directory(final: Any, *, incomplete_marker: bool = True, tmp: Path | None = None
                     ) -> "contextlib.AbstractContextManager[Path]":
    """A local directory to write a checkpoint for ``final`` into, removed if the block raises; publish it with
    :func:`publish_directory` inside the block (see :meth:`CommitProtocol.staged_directory`)."""
    final = location(final)
    return commit_for(final).staged_directory(final, incomplete_marker=incomplete_marker, tmp=tmp)


def publish_directory(tmp: Path, final: Any, metadata: Any = None, *, fsync_files: bool = True,
                      overwrite: bool = False) -> None:
    """Make the complete directory ``tmp`` appear as ``final`` atomically (a rename on a filesystem, an upload with
    the commit record last in a store); see :mod:`oarlock.checkpoint.storage.commit.local`.

    Raises:
        CheckpointDestinationError: ``final`` is refused by the destination rule. CheckpointError:
            ``metadata.json`` cannot be written. ObjectStoreError: a request failed.
    """
    final = location(final)
    commit_for(final).publish_directory(tmp, final, metadata, fsync_files=fsync_files, overwrite=overwrite)


def copy_file(src: "str | os.PathLike | ObjectPath", dst: Path) -> None:
    """Copy the file or object ``src`` (any location) into the local file ``dst``, in pieces of the source store's
    ``part_bytes`` (bounded memory).

    Raises:
        OSError, CheckpointFormatError, ObjectStoreError: the read or the write failed (naming the file).
    """
    st, key = storage_key(src)
    if isinstance(st, LocalStorage):
        import shutil

        shutil.copyfile(key, dst)  # copy_file_range where the kernel offers it
        return
    size = st.size(key)
    buf = bytearray(min(size, st.part_bytes) or 1)
    with open(dst, "wb") as f:
        for off in range(0, size, len(buf)):
            view = memoryview(buf)[:min(len(buf), size - off)]
            st.read_into(key, off, view)
            f.write(view)


def rename_within(directory: Path, old: str, new: str) -> None:
    """Rename entry ``old`` of the local staging directory ``directory`` to ``new`` (a writer that learns its
    files' final names only at the end: the HF export's ``model-XXXXX-of-YYYYY``)."""
    os.rename(directory / old, directory / new)


def open_read(p: "str | os.PathLike | ObjectPath") -> "io.BufferedIOBase":
    """A binary, seekable file object reading location ``p`` (for readers that take a stream: ``torch.load``,
    JSON, pickle through the restricted unpickler). A local file is opened as it is; an object in a store is read
    with ranged requests of the store's ``part_bytes``.

    Raises:
        FileNotFoundError, OSError: a local file that cannot be opened. CheckpointFormatError,
            ObjectStoreError: an object that is missing or cannot be read (naming it).
    """
    st, key = storage_key(p)
    if isinstance(st, LocalStorage):
        return open(key, "rb")
    f = RangedFile(p)
    return io.BufferedReader(f.window(0, f.size), buffer_size=min(st.part_bytes, 8 << 20))


# Names that lived in the one-module ``storage`` and belong elsewhere now: resolved on first use (they import
# the formats and the runtime, which import this package).
_MOVED = {
    "CheckpointReader": "oarlock.checkpoint.formats.reader",
    "SafetensorsFile": "oarlock.checkpoint.storage.safetensors",
    "contiguous_run": "oarlock.checkpoint.storage.safetensors", "np_prod": "oarlock.checkpoint.storage.safetensors",
    "safetensors_header": "oarlock.checkpoint.storage.safetensors",
    "write_safetensors": "oarlock.checkpoint.storage.safetensors",
    "HF_INDEX": "oarlock.checkpoint.formats.huggingface", "HF_SINGLE": "oarlock.checkpoint.formats.huggingface",
    "PADDLE_HF_CACHE": "oarlock.checkpoint.formats.huggingface",
    "open_checkpoint": "oarlock.checkpoint.formats.opening", "read_metadata": "oarlock.checkpoint.formats.opening",
    "View": "oarlock.checkpoint.runtime.view", "gather_view": "oarlock.checkpoint.runtime.view",
    "resolve_manager_root": "oarlock.checkpoint.lifecycle.manager",
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        import importlib

        value = getattr(importlib.import_module(_MOVED[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
