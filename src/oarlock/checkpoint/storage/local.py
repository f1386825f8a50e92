"""The storage protocol on the local filesystem: keys are paths; reads are ``os.preadv`` straight into the
caller's buffer, writes ``os.write`` then ``fsync`` on close."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

from oarlock.checkpoint.storage.backend import ObjectWriter, Storage, pread_into

__all__ = ["LocalStorage"]


class _LocalWriter(ObjectWriter):
    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            mv = mv[os.write(self.fd, mv):]

    def close(self) -> None:
        if self.fd >= 0:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.path)
        except OSError:
            pass


class LocalStorage(Storage):
    """The protocol on the local filesystem (keys are paths). Reads use ``os.preadv`` straight into ``buf``."""

    renames = True
    mappable = True

    def list(self, prefix: str) -> dict[str, int]:
        out = {}
        for e in os.scandir(prefix or "."):
            out[e.name] = e.stat().st_size if e.is_file() else -1
        return out

    def names(self, prefix: str) -> list[str]:
        return os.listdir(prefix or ".")  # no stat per entry: a load lists a directory of one file per rank

    def size(self, key: str) -> int:
        return os.stat(key).st_size

    def exists(self, key: str) -> bool:
        return os.path.exists(key)

    def read_into(self, key: str, offset: int, buf: memoryview) -> None:
        fd = os.open(key, os.O_RDONLY)
        try:
            pread_into(fd, buf, offset, Path(key))
        finally:
            os.close(fd)

    def read_head(self, key: str, n: int) -> tuple[bytes, int]:
        fd = os.open(key, os.O_RDONLY)  # one descriptor answers both (no stat of the name before)
        try:
            size = os.fstat(fd).st_size
            buf = bytearray(min(n, size))
            pread_into(fd, memoryview(buf), 0, Path(key))
            return bytes(buf), size
        finally:
            os.close(fd)

    def read_bytes(self, key: str) -> bytes:
        return Path(key).read_bytes()

    def open_writer(self, key: str) -> ObjectWriter:
        return _LocalWriter(key)

    def delete(self, keys: Iterable[str]) -> None:
        for k in keys:
            try:
                os.unlink(k)
            except FileNotFoundError:
                pass
