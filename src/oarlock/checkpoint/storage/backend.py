"""The storage protocol every checkpoint byte goes through (``docs/storage.md``).

A :class:`Storage` is a flat namespace of byte objects named by ``/``-separated keys: a local filesystem (keys are
paths), one bucket of an S3-compatible store, or the in-memory store of the tests. The protocol is what a
checkpoint needs and no more:

* ``list(prefix)`` the entries directly under a prefix, ``size``/``exists`` of one object;
* ``read_into(key, offset, buf)``: a ranged read of exactly ``len(buf)`` bytes into caller memory (no copy
  through ``bytes``), ``read_head`` the first bytes and the size in one request, ``read_bytes`` a small object;
* ``open_writer(key)``: a streamed write that is durable when :meth:`ObjectWriter.close` returns and invisible
  (or removed) when it is aborted, ``put_bytes`` a small whole object;
* ``delete(keys)``.

Publishing a written checkpoint atomically is the commit protocol's business
(:mod:`oarlock.checkpoint.storage.commit`), which has one implementation for stores with a directory rename
(the filesystem) and one for stores without (object stores, whose commit record is written last).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterable

from oarlock.checkpoint.errors import CheckpointError, CheckpointFormatError

__all__ = ["ObjectStoreError", "ObjectWriter", "Storage", "UnsupportedLocationError", "pread_into"]


class UnsupportedLocationError(CheckpointError):
    """A checkpoint location with a URL scheme oarlock does not read or write (local paths, ``s3://`` and the
    schemes registered with :func:`~oarlock.checkpoint.storage.location.register_store`)."""


class ObjectStoreError(CheckpointError):
    """A request to an object store failed (after the retries); the message names the bucket, the object key and
    the operation."""


def pread_into(fd: int, buf: memoryview, offset: int, path: Path) -> None:
    """Fill ``buf`` from ``fd`` at ``offset`` (``os.preadv`` until full; the local data path); a short file raises
    :class:`CheckpointFormatError` naming ``path`` and the missing bytes."""
    n = 0
    while n < len(buf):
        got = os.preadv(fd, [buf[n:]], offset + n)
        if got <= 0:
            raise CheckpointFormatError(f"{path}: file ends at byte {offset + n}, expected {len(buf) - n} more")
        n += got


class ObjectWriter:
    """A streamed write of one object: :meth:`write` bytes in order, :meth:`close` to make the object appear
    durably (on an object store nothing is visible before), :meth:`abort` to drop it."""

    def write(self, data: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> "ObjectWriter":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class Storage:
    """The storage protocol (see the module docstring). Keys are ``/``-separated names relative to the store
    (a local path, or an object key in the bucket).

    Attributes:
        part_bytes: the size of the pieces a streamed copy into this store should write (bytes).
        read_concurrency: ranged reads worth keeping in flight at once per process (None: the reader's own
            default, right for a local disk; a number for latency-bound stores).
        renames: True when a directory can be renamed atomically (the filesystem): the commit protocol then
            stages a write in a hidden sibling and publishes it with one rename; False for stores whose commit
            record is written last under the final prefix.
        shared: every rank of a job sees the same objects (an object store): a load need not compare the ranks'
            listings (node-local disks may differ, so a filesystem says False).
        mappable: objects are files this process can open by descriptor, memory-map and hint to the kernel
            (the warm restart and the page-cache paths of verification use them).
    """

    part_bytes: int = 16 * 1024 * 1024
    read_concurrency: int | None = None
    renames: bool = False
    shared: bool = False
    mappable: bool = False

    def load_session(self) -> "contextlib.AbstractContextManager[None]":
        """Held for the duration of one load from this store (an S3 store keeps the blocks it verified for the
        load's reads in it)."""
        return contextlib.nullcontext()

    def keep_verified(self, key: str, lo: int, block_size: int, data: Any) -> None:
        """Offer the verified bytes of the block of ``key`` starting at ``lo`` to the current load's reads (a store
        that fetches over the network keeps them within a budget; others ignore it)."""

    def url(self, key: str) -> str:
        """How messages name object ``key``."""
        return key

    def list(self, prefix: str) -> dict[str, int]:
        """The entries directly under ``prefix`` (no recursion): name -> size in bytes (-1 for a sub-prefix)."""
        raise NotImplementedError

    def names(self, prefix: str) -> list[str]:
        """The names directly under ``prefix`` (what :meth:`list` gives, without the sizes), in no order."""
        return list(self.list(prefix))

    def size(self, key: str) -> int:
        """Size of object ``key`` in bytes."""
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def read_into(self, key: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with bytes ``[offset, offset + len(buf))`` of ``key``; a short object raises
        :class:`~oarlock.checkpoint.errors.CheckpointFormatError` naming it."""
        raise NotImplementedError

    def read_head(self, key: str, n: int) -> tuple[bytes, int]:
        """``(first min(n, size) bytes, size)`` of object ``key`` (one request where the store allows)."""
        size = self.size(key)
        buf = bytearray(min(n, size))
        self.read_into(key, 0, memoryview(buf))
        return bytes(buf), size

    def read_bytes(self, key: str) -> bytes:
        raise NotImplementedError

    def ranged_reader(self, key: str, head: int = 64 * 1024) -> "tuple[int, Any]":
        """``(size, pread)`` of object ``key``, ``pread(n, offset) -> bytes`` (clipped at the end): its first
        ``head`` bytes (where the header of most files ends) come in one request, later bytes in one each."""
        first, size = self.read_head(key, head)

        def pread(n: int, off: int) -> bytes:
            n = max(0, min(n, size - off))
            if off + n <= len(first):
                return bytes(first[off:off + n])
            out = bytearray(n)
            self.read_into(key, off, memoryview(out))
            return bytes(out)

        return size, pread

    def open_writer(self, key: str) -> ObjectWriter:
        raise NotImplementedError

    def put_bytes(self, key: str, data: bytes) -> None:
        """Write a whole (small) object in one request, durably."""
        with self.open_writer(key) as w:
            w.write(data)

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` (missing ones are not an error)."""
        raise NotImplementedError
