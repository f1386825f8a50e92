"""An in-memory object store (``mem://BUCKET/PREFIX``): the storage protocol over a dict, for tests and as the
smallest example of a store. Registering it is all a new store takes: the commit protocol, the readers, the
writers, the manager and the commands reach it through the protocol alone.

Objects live in this process only (a multi-process job does not share them). Writes become visible whole when
their writer closes, like an object store's upload; a failed or aborted write leaves nothing.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

from oarlock.checkpoint.errors import CheckpointFormatError
from oarlock.checkpoint.storage.backend import ObjectWriter, Storage
from oarlock.checkpoint.storage.location import register_store

__all__ = ["MemoryStorage"]

_BUCKETS: dict[str, dict[str, bytes]] = {}
_LOCK = threading.Lock()


class _MemoryWriter(ObjectWriter):
    def __init__(self, store: "MemoryStorage", key: str):
        self.store, self.key, self.parts = store, key, []

    def write(self, data: Any) -> None:
        self.parts.append(bytes(memoryview(data).cast("B")))

    def close(self) -> None:
        if self.parts is not None:
            with _LOCK:
                self.store.objects[self.key] = b"".join(self.parts)
            self.parts = None

    def abort(self) -> None:
        self.parts = None


class MemoryStorage(Storage):
    """The storage protocol on one bucket of the process's in-memory store (see the module docstring)."""

    part_bytes = 1 << 20
    read_concurrency = 4
    shared = True  # within the process

    def __init__(self, bucket: str):
        self.bucket = bucket
        with _LOCK:
            self.objects = _BUCKETS.setdefault(bucket, {})

    @classmethod
    def for_bucket(cls, bucket: str) -> "MemoryStorage":
        return cls(bucket)

    @staticmethod
    def clear() -> None:
        """Drop every bucket (tests call this between cases)."""
        with _LOCK:
            for objects in _BUCKETS.values():
                objects.clear()

    def url(self, key: str) -> str:
        return f"mem://{self.bucket}/{key}"

    def list(self, prefix: str) -> dict[str, int]:
        pre = prefix.strip("/") + "/" if prefix.strip("/") else ""
        out: dict[str, int] = {}
        with _LOCK:
            for k, v in self.objects.items():
                if k.startswith(pre):
                    head, sep, _ = k[len(pre):].partition("/")
                    out[head] = -1 if sep else len(v)
        return out

    def _get(self, key: str) -> bytes:
        try:
            return self.objects[key]
        except KeyError:
            raise CheckpointFormatError(f"{self.url(key)}: no such object") from None

    def size(self, key: str) -> int:
        return len(self._get(key))

    def exists(self, key: str) -> bool:
        return key in self.objects

    def read_into(self, key: str, offset: int, buf: memoryview) -> None:
        data = self._get(key)
        if offset + len(buf) > len(data):
            raise CheckpointFormatError(f"{self.url(key)}: object ends at byte {len(data)}, expected "
                                        f"{offset + len(buf) - len(data)} more")
        buf.cast("B")[:] = data[offset:offset + len(buf)]

    def read_head(self, key: str, n: int) -> tuple[bytes, int]:
        data = self._get(key)
        return data[:n], len(data)

    def read_bytes(self, key: str) -> bytes:
        return self._get(key)

    def open_writer(self, key: str) -> ObjectWriter:
        return _MemoryWriter(self, key)

    def delete(self, keys: Iterable[str]) -> None:
        with _LOCK:
            for k in list(keys):
                self.objects.pop(k, None)


register_store("mem", MemoryStorage.for_bucket)
