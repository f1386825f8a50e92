"""The block hash and what a save writes: :class:`BlockHasher` hashes a data file's fixed-size blocks as it is
written (:data:`BLOCK_SIZE`, XXH3 64-bit, :data:`ALGORITHM`), :func:`file_checksums` hashes an existing file, and
the checksums are recorded in the metadata (:func:`make_record`, under :data:`CHECKSUMS_KEY` of ``extra``) either
inline or in a digests file next to the data file (:func:`write_digests`, :data:`DIGESTS_SUFFIX`). The files are
read and written through :mod:`oarlock.checkpoint.storage`."""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

import xxhash

from oarlock.checkpoint.errors import CheckpointFormatError
from oarlock.checkpoint.storage import storage_key
from oarlock.checkpoint.storage.pages import mapped, opened

ALGORITHM = "xxh3_64"
BLOCK_SIZE = 4 * 1024 * 1024
CHECKSUMS_KEY = "checksums"  # in CheckpointMetadata.extra


class ChecksumError(CheckpointFormatError):
    """Stored bytes do not match the checksum recorded at save: the file was corrupted after it was written."""


def _hasher():
    return xxhash.xxh3_64()


class BlockHasher:
    """Checksums of fixed-size blocks of a file being written, fed its bytes in file order.

    :meth:`feed` takes ``(position, bytes)``; bytes that arrive out of order, or that the writer does not see
    (kernel copies), stop the streaming and :meth:`finish` reads the rest of the file back instead.
    """

    def __init__(self, block_size: int = BLOCK_SIZE):
        self.block_size = int(block_size)
        self.blocks: list[str] = []
        self.pos = 0
        self.streaming = True
        self._h = _hasher()
        self._fill = 0
        self.record: dict[str, Any] | None = None

    def feed(self, pos: int, data: Any | None) -> None:
        """Bytes ``data`` (any buffer; None: unseen bytes) written at file offset ``pos``."""
        if not self.streaming:
            return
        if data is None or pos != self.pos:
            self.streaming = False
            return
        mv = memoryview(data).cast("B")
        while len(mv):
            take = min(len(mv), self.block_size - self._fill)
            self._h.update(mv[:take])
            self._fill += take
            self.pos += take
            mv = mv[take:]
            if self._fill == self.block_size:
                self.blocks.append(self._h.hexdigest())
                self._h.reset()
                self._fill = 0

    def finish(self, fd: int, size: int) -> dict[str, Any]:
        """The record of a file of ``size`` bytes open as ``fd``: ``{"size", "blocks"}``. Blocks not streamed
        are read back from ``fd``."""
        if self.streaming and self.pos == size:
            if self._fill:
                self.blocks.append(self._h.hexdigest())
        else:  # recompute from the first block not completed in order
            start = len(self.blocks) * self.block_size
            self.blocks.extend(_hash_range(fd, start, size, self.block_size, Path(f"<fd {fd}>")))
        self._fill = 0
        self.record = {"size": int(size), "blocks": list(self.blocks)}
        return self.record


def _hash_range(fd: int, start: int, end: int, block_size: int, path: Path) -> list[str]:
    """Block hashes of bytes ``[start, end)`` of ``fd`` (``start`` a multiple of ``block_size``), each block
    mapped rather than read: no copy into Python, and the resident set does not grow with the file."""
    size = os.fstat(fd).st_size
    if size < end:
        raise ChecksumError(f"{path}: file ends at byte {size}, the checksums cover {end} bytes")
    return [digest_block(fd, pos, min(block_size, end - pos)) for pos in range(start, end, block_size)]


def hex_digest(data: Any) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def digest_block(fd: int, offset: int, nbytes: int) -> str:
    """Hash ``nbytes`` of ``fd`` at ``offset`` through a populated mapping of just that block
    (:func:`~oarlock.checkpoint.storage.pages.mapped`): no copy, and the resident set does not grow with the
    file."""
    if nbytes == 0:
        return hex_digest(b"")
    with mapped(fd, offset, nbytes) as buf:
        return hex_digest(buf)


def file_checksums(path: str | Path, block_size: int = BLOCK_SIZE) -> dict[str, Any]:
    """Compute the record ``{"size", "blocks"}`` of an existing file (reads it whole)."""
    path = Path(path)
    with opened(path) as (fd, size):
        return {"size": size, "blocks": _hash_range(fd, 0, size, block_size, path)}


def make_record(files: dict[str, dict[str, Any]], block_size: int = BLOCK_SIZE) -> dict[str, Any]:
    """The ``extra.checksums`` entry of a checkpoint's metadata from per-file records: ``{"size", "blocks"}`` (put
    inline, compacted to ``digests``) or :func:`write_digests` records (kept as they are)."""
    # inline digests as one base64 string of the 8-byte values (10.7 characters per block instead of 19 for a
    # JSON list of hex strings)
    return {"algorithm": ALGORITHM, "block_size": int(block_size),
            "files": {f: _compact(r) for f, r in sorted(files.items())}}


def _compact(r: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(r.get("blocks"), list):
        return dict(r)
    out = {k: v for k, v in r.items() if k != "blocks"}
    out["digests"] = base64.b64encode(bytes.fromhex("".join(r["blocks"]))).decode("ascii")
    return out


#: The digests file of data file ``F`` is ``F + DIGESTS_SUFFIX``, next to it (a fixed rule: the metadata names no
#: other file, so no name from a checkpoint can point a reader elsewhere).
DIGESTS_SUFFIX = ".xxh3"


def digests_record(file: str, record: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """The metadata record of data file ``file`` whose block checksums (``{"size", "blocks"}``, from
    :class:`BlockHasher`) go into its digests file (``file + DIGESTS_SUFFIX``), and that file's bytes:
    ``({"size", "digests_xxh3"}, raw 8-byte digests)``."""
    raw = bytes.fromhex("".join(record["blocks"]))
    return {"size": int(record["size"]), "digests_xxh3": xxhash.xxh3_64_hexdigest(raw)}, raw


def write_digests(directory: Any, file: str, record: dict[str, Any]) -> dict[str, Any]:
    """Write the digests file of data file ``file`` into ``directory`` (a local directory or an object-store
    prefix; fsynced or uploaded before this returns) and return its metadata record (:func:`digests_record`).

    Raises:
        OSError, ObjectStoreError: the file cannot be written.
    """
    rec, raw = digests_record(file, record)
    st, key = storage_key(directory / (file + DIGESTS_SUFFIX))
    st.put_bytes(key, raw)
    return rec
