"""File-shaped access to any location, for the format readers (``formats/``): listings, whole small files,
ranged reads of a file kept open, the filesystem path of a local file (for memory-mapped loads), and a stream
written into a local staging directory. Every call goes to the location's :class:`~.backend.Storage`; on the
local filesystem a file read by ranges keeps one descriptor (``os.preadv`` into the caller's buffer, and the
descriptor for kernel copies), in a store each range is one ranged request.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from oarlock.checkpoint.errors import CheckpointFormatError
from oarlock.checkpoint.storage.backend import ObjectWriter, pread_into
from oarlock.checkpoint.storage.location import location, storage_key

__all__ = ["AppendStream", "RangedFile", "list_names", "local_path", "read_file"]


def list_names(p: Any) -> list[str]:
    """The names directly inside directory (prefix) ``p``, files and sub-directories, in no particular order.

    Raises:
        OSError: a local directory that cannot be listed (FileNotFoundError, NotADirectoryError, ...).
        ObjectStoreError: a listing request failed.
    """
    st, key = storage_key(p)
    return st.names(key)


def local_path(p: Any) -> Path | None:
    """The filesystem path of location ``p`` when its store keeps objects as local files a library can open and
    memory-map itself (``Storage.mappable``: ``torch.load(mmap=True)``, ``numpy.memmap``); None for an object in a
    store (read it with :func:`oarlock.checkpoint.storage.open_read` or :class:`RangedFile`)."""
    st, key = storage_key(p)
    return Path(key) if st.mappable else None


def read_file(p: Any, max_bytes: int | None = None, what: str = "read it") -> bytes:
    """The whole content of the (small) file or object ``p``.

    Raises:
        CheckpointFormatError: ``"{p}: cannot read: {reason}"`` (missing, unreadable), or ``"{p}: larger than
            N MiB; refusing to {what}"`` past ``max_bytes``.
        ObjectStoreError: a request to the store failed.
    """
    st, key = storage_key(p)
    try:
        if max_bytes is not None and st.size(key) > max_bytes:
            raise CheckpointFormatError(f"{p}: larger than {max_bytes >> 20} MiB; refusing to {what}")
        return st.read_bytes(key)
    except OSError as e:
        raise CheckpointFormatError(f"{p}: cannot read: {e.strerror or e}") from None


class RangedFile:
    """One file or object opened for ranged reads (a data file a reader reads many ranges of).

    Attributes:
        path: its location (a local ``Path`` or an object path), for messages.
        fd: a read-only descriptor on the local file (for kernel copies: ``os.copy_file_range``), or -1 for an
            object in a store.
        size: its size in bytes when opened.

    Raises:
        CheckpointFormatError: a local file that cannot be opened (naming it); a missing object (naming it).
        ObjectStoreError: a request to the store failed.
    """

    def __init__(self, p: Any):
        self.path = location(p)
        self.storage, self.key = storage_key(self.path)
        self.fd = -1
        if not self.storage.mappable:
            self.size = self.storage.size(self.key)
            return
        try:
            self.fd = os.open(self.key, os.O_RDONLY)
        except OSError as e:
            raise CheckpointFormatError(f"{self.path}: cannot open: {e.strerror or e}") from None
        self.size = os.fstat(self.fd).st_size

    def read_into(self, buf: memoryview, offset: int) -> None:
        """Fill ``buf`` with bytes ``[offset, offset + len(buf))``; a short file raises
        :class:`CheckpointFormatError` naming it."""
        if self.fd >= 0:
            pread_into(self.fd, buf, offset, self.path)
        else:
            self.storage.read_into(self.key, offset, buf)

    def pread(self, n: int, offset: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer at the end of the file, like ``os.pread``)."""
        out = bytearray(max(0, min(n, self.size - offset)))
        if out:
            self.read_into(memoryview(out), offset)
        return bytes(out)

    def window(self, start: int, length: int) -> io.RawIOBase:
        """A read-only, seekable raw stream of bytes ``[start, start + length)`` (clipped at the end of the file):
        a ``torch.save`` archive or a zip inside the file, for ``torch.load`` and ``zipfile``."""
        return _Window(self, start, max(0, min(length, self.size - start)))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "RangedFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Window(io.RawIOBase):
    def __init__(self, f: RangedFile, start: int, length: int):
        super().__init__()
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, pos + (0, self.pos, self.length)[whence])
        return self.pos

    def readinto(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = max(0, min(len(mv), self.length - self.pos))
        if n:
            self.f.read_into(mv[:n], self.start + self.pos)
            self.pos += n
        return n


class AppendStream(ObjectWriter):
    """A file written front to back through the store's streamed writer (``Storage.open_writer``), with the
    ``write``/``flush``/``tell`` a serialiser such as ``torch.save`` or ``pickle.dump`` needs: small writes are
    gathered into pieces of at least 1 MiB (a ``torch.save`` archive is written as a dozen small records around its
    data), large ones go through as they are. :meth:`close` makes the file durable (the writer's close: ``fsync``
    on a filesystem), :meth:`abort` drops it; as a context manager it closes, or aborts when the block raises.
    """

    _SMALL = 64 * 1024
    _PIECE = 1 << 20

    def __init__(self, p: Any):
        st, key = storage_key(p)
        self.path = location(p)
        self._writer: ObjectWriter | None = st.open_writer(key)
        self._pending = bytearray()
        self.pos = 0

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        if len(mv) < self._SMALL:
            self._pending += mv
            if len(self._pending) >= self._PIECE:
                self._drain()
        else:
            self._drain()
            self._writer.write(mv)
        self.pos += len(mv)
        return len(mv)

    def _drain(self) -> None:
        if self._pending:
            self._writer.write(self._pending)
            self._pending = bytearray()  # a new buffer: the writer may still hold the one it was given

    def flush(self) -> None:
        """Nothing: the bytes become durable at :meth:`close`."""

    def tell(self) -> int:
        return self.pos

    def close(self) -> None:
        if self._writer is not None:
            self._drain()
            self._writer.close()
            self._writer = None

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
            self._pending = bytearray()
