"""Block checksums of checkpoint data files: computed while a file is written, recorded with the checkpoint,
verified before a load writes anything, and checked in full by ``oarlock verify``.

Every data file of an oarlock checkpoint is cut into fixed-size blocks of its bytes (:data:`BLOCK_SIZE`; the
last block may be shorter), header included; each block's XXH3 64-bit hash (the ``xxhash`` library,
https://xxhash.com) is kept as 8 big-endian bytes. ``metadata.json`` records them under ``extra.checksums``, per
file either in a *digests file* next to the data file (what a save writes, format version 4: ``F.xxh3`` for data
file ``F``, the raw 8-byte digests in block order, with the XXH3 of those bytes in the metadata; ``oarlock convert`` writes them too) or
inline, as earlier versions wrote them (``digests``: base64 of the same bytes; ``blocks``: a list of 16-hex-digit
strings; both still read)::

    {"algorithm": "xxh3_64", "block_size": 4194304,
     "files": {"rank-00000.safetensors": {"size": 123456, "digests_xxh3": "5f0e3c9a1b2d4e6f"}}}

With digests files, what the save's coordinator receives and what every loading rank parses is a fixed few dozen
bytes per data file, whatever the checkpoint's size (inline, a 5 TB checkpoint's 1.2 M blocks would be 12 MiB of
``metadata.json`` parsed by every rank and gathered to rank 0 at each save); a rank reads the digests only of
the files whose blocks it hashes.

A load verifies, before any destination tensor is written, every block that holds a byte the group's reads take
(a partial read checks only the blocks it touches), each block hashed by one rank: :func:`verify_group` (the
owner of a block is the rank reading most of it, agreed in one ``all_reduce``). A same-layout restart verifies
each rank's own file (:func:`verify_own_file`). A mismatch raises :class:`ChecksumError` on every rank, naming the
file, the block's byte range and every key stored in it. Checkpoints without ``extra.checksums`` (written by
earlier oarlock versions, or foreign formats) load without a check. See ``docs/checkpoint-format.md``.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import math
import os
import threading
import time
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import xxhash

from oarlock.checkpoint.errors import CheckpointError, CheckpointFormatError
from oarlock.checkpoint.executor import io_threads, pool_map
from oarlock.checkpoint.metadata import METADATA_FILE
from oarlock.checkpoint.storage import storage_for, storage_key
from oarlock.checkpoint.storage.pages import mapped, opened, read_ahead
from oarlock.checkpoint.storage.s3 import kept_room
from oarlock.checkpoint.plan import index_of
from oarlock.checkpoint.reader import checkpoint_file
from oarlock.checkpoint.safetensors_io import read_header
from oarlock.checkpoint.sharded import box_volume
from oarlock.checkpoint.formats.opening import open_checkpoint
from oarlock.checkpoint.storage import detect_format
from oarlock.utils import dtype_itemsize

ALGORITHM = "xxh3_64"
BLOCK_SIZE = 4 * 1024 * 1024
CHECKSUMS_KEY = "checksums"  # in CheckpointMetadata.extra


#: ``verify_checksums="overlap"``: blocks are hashed while the reads write the targets (see :func:`verify_mode`).
OVERLAP = "overlap"


def verify_mode(value: Any) -> bool | str:
    """``value`` checked as a ``verify_checksums`` argument: True (every block a load touches is verified before
    any target is written), :data:`OVERLAP` (hashed while the reads write the targets: as fast as an unverified
    load, and a mismatch still raises, but then the targets hold unspecified contents) or False.

    Raises:
        CheckpointError: any other value, naming it."""
    if isinstance(value, bool) or value == OVERLAP:
        return value
    raise CheckpointError(f"verify_checksums={value!r}: use True (verify before writing any target), "
                          f"{OVERLAP!r} (verify while the targets are written) or False")


def hash_beside(hash_fn: Any, during: Any) -> tuple[BaseException | None, float]:
    """``verify_checksums="overlap"``: run ``hash_fn()`` on a second thread while ``during()`` (the load's reads)
    runs in this one. Returns the exception the hashing raised (None when it passed) and the seconds ``during()``
    took; an exception of ``during()`` propagates once the hashing has stopped."""
    found: list[BaseException] = []

    def run() -> None:
        try:
            hash_fn()
        except Exception as e:  # handed to the caller, who shares it with the group
            found.append(e)

    hasher = threading.Thread(target=run, name="oarlock-verify", daemon=True)
    hasher.start()
    t0 = time.perf_counter()
    try:
        during()
    finally:
        reading = time.perf_counter() - t0
        hasher.join()
    return (found[0] if found else None), reading


def overlapped_error(err: BaseException | None) -> BaseException | None:
    """``err`` as it reads after an overlapped load: a :class:`CheckpointError` no longer says that nothing was
    loaded and says instead that the targets hold unspecified contents (they were written while hashing)."""
    if not isinstance(err, CheckpointError):
        return err
    return type(err)(str(err).replace("; nothing was loaded", "") + f" (verify_checksums={OVERLAP!r}: the targets "
                     "were being written while the blocks were hashed, so every target of this load now holds "
                     "unspecified contents)")


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
    return [_digest_block(fd, pos, min(block_size, end - pos)) for pos in range(start, end, block_size)]


def _digest(data: Any) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def _digest_block(fd: int, offset: int, nbytes: int) -> str:
    """Hash ``nbytes`` of ``fd`` at ``offset`` through a populated mapping of just that block
    (:func:`~oarlock.checkpoint.storage.pages.mapped`): no copy, and the resident set does not grow with the
    file."""
    if nbytes == 0:
        return _digest(b"")
    with mapped(fd, offset, nbytes) as buf:
        return _digest(buf)


_read_ahead = read_ahead


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


class FileChecksums:
    """The recorded checksums of one data file: ``size`` bytes in blocks of ``block_size``. ``blocks`` (the
    16-hex-digit digests in block order) are given, or read on first use from the file's digests file through
    ``path_of`` (a callable giving the path of a file of the checkpoint), checked against ``digests_xxh3``."""

    def __init__(self, file: str, size: int, block_size: int, blocks: list[str] | None = None, *,
                 digests_file: str | None = None, digests_xxh3: str | None = None, path_of: Any = None):
        self.file, self.size, self.block_size = file, int(size), int(block_size)
        self._blocks = blocks
        self.digests_file, self.digests_xxh3, self._path_of = digests_file, digests_xxh3, path_of

    def __repr__(self) -> str:
        where = f"digests_file={self.digests_file!r}" if self._blocks is None else f"{len(self._blocks)} blocks"
        return f"FileChecksums({self.file!r}, size={self.size}, block_size={self.block_size}, {where})"

    @property
    def n_blocks(self) -> int:
        """The number of blocks (known without reading the digests)."""
        return -(-self.size // self.block_size)

    @property
    def blocks(self) -> list[str]:
        """The block digests (16 hex digits each), read from the digests file on first use.

        Raises:
            ChecksumError: the digests file is missing, has the wrong size, or does not match the XXH3 recorded
                in ``metadata.json`` (naming both files).
        """
        if self._blocks is None:
            self._blocks = self._read_digests()
        return self._blocks

    def signature(self) -> tuple:
        """``(size, block_size, XXH3 of the raw digests)``: equal for two files exactly when their recorded
        checksums are (inline or in a digests file alike), without reading a digests file."""
        if self.digests_xxh3 is not None:
            return self.size, self.block_size, self.digests_xxh3
        return self.size, self.block_size, xxhash.xxh3_64_hexdigest(bytes.fromhex("".join(self.blocks)))

    def _read_digests(self) -> list[str]:
        if self._path_of is None:
            raise ChecksumError(f"data file {self.file!r}: its block checksums are in {self.digests_file!r}, which "
                                "this caller cannot open (no checkpoint location given)")
        path = self._path_of(self.digests_file)
        want = 8 * self.n_blocks
        what = f"{path} (the block checksums of data file {self.file!r})"
        try:
            st, key = storage_key(path)  # one ranged GET answers both the bytes and an object's size
            data, size = st.read_head(key, want) if want else (b"", st.size(key))
            data = data if size == want else None
        except FileNotFoundError:
            raise ChecksumError(f"{what} is missing: the checkpoint is incomplete; nothing was loaded") from None
        except (OSError, CheckpointError) as e:
            raise ChecksumError(f"{what} cannot be read: {getattr(e, 'strerror', None) or e}") from None
        if data is None or len(data) != want:
            raise ChecksumError(f"{what} has {size} bytes, {want} were written at save (8 per block of a "
                                f"{self.size}-byte file): truncated or replaced; nothing was loaded")
        if xxhash.xxh3_64_hexdigest(data) != self.digests_xxh3:
            raise ChecksumError(f"{what} does not match the checksum metadata.json records for it: corrupted or "
                                "replaced after it was written; nothing was loaded")
        hexed = bytes(data).hex()
        return [hexed[i:i + 16] for i in range(0, len(hexed), 16)]

    def block_length(self, b: int) -> int:
        """Bytes in block ``b`` (the last block may be shorter)."""
        return min(self.size, (b + 1) * self.block_size) - b * self.block_size

    def block_range(self, start: int, stop: int) -> range:
        """Indices of the blocks holding any byte of ``[start, stop)``."""
        if stop <= start:
            return range(0)
        return range(start // self.block_size, (stop - 1) // self.block_size + 1)


def prefetch_digests(sums: Sequence[FileChecksums]) -> None:
    """Read the digests files of ``sums`` not read yet, several at once (``io_threads`` in flight; twice that for
    an object store, where each is a request with its latency): a rank owning blocks of many files would otherwise
    wait for one small read after another.

    Raises:
        ChecksumError: the first digests file (in the given order) that is missing or corrupt.
    """
    todo = [fc for fc in sums if fc._blocks is None]
    if len(todo) < 2:
        return
    latency_bound = todo[0]._path_of is not None and bool(
        storage_for(todo[0]._path_of(todo[0].digests_file)).read_concurrency)
    n = min(len(todo), io_threads() * (2 if latency_bound else 1))
    if n < 2:
        return
    pool_map(lambda fc: fc.blocks, todo, n)


def recorded(metadata: Any, path_of: Any = None) -> dict[str, FileChecksums] | None:
    """The checksums recorded in a checkpoint's metadata (file -> :class:`FileChecksums`), or None when it has
    none (older oarlock checkpoints, foreign formats). ``path_of`` (``reader.path_of``) opens digests files when
    their blocks are first needed.

    Raises:
        CheckpointFormatError: a malformed ``extra.checksums`` entry or an unknown algorithm.
    """
    return parse_checksums((getattr(metadata, "extra", None) or {}).get(CHECKSUMS_KEY), path_of)


def parse_checksums(rec: Any, path_of: Any = None) -> dict[str, FileChecksums] | None:
    """Parse an ``extra.checksums`` entry (see :func:`recorded`)."""
    if rec is None:
        return None
    try:
        if rec["algorithm"] != ALGORITHM:
            raise CheckpointFormatError(f"checksum algorithm {rec['algorithm']!r} is not supported (this oarlock "
                                        f"reads {ALGORITHM})")
        bs = int(rec["block_size"])
        if bs <= 0:
            raise ValueError("block_size must be positive")
        out = {}
        for f, r in rec["files"].items():
            size = int(r["size"])
            if size < 0:
                raise ValueError(f"file {f!r}: negative size {size}")
            if "digests_xxh3" in r:  # format 4: the digests in the file's digests file, checked by their XXH3
                check = r["digests_xxh3"]
                if not isinstance(check, str) or re.fullmatch("[0-9a-f]{16}", check) is None:
                    raise ValueError(f"file {f!r}: \"digests_xxh3\" {check!r} is not 16 hex digits")
                out[str(f)] = FileChecksums(str(f), size, bs, digests_file=str(f) + DIGESTS_SUFFIX,
                                            digests_xxh3=check, path_of=path_of)
                continue
            if "digests" in r:  # the compact form: base64 of the 8-byte big-endian digests, in block order
                raw = r["digests"]
                if not isinstance(raw, str) or re.fullmatch("[A-Za-z0-9+/]*={0,2}", raw) is None:
                    raise ValueError(f"file {f!r}: \"digests\" is not base64 text")
                try:
                    data = base64.b64decode(raw, validate=True)
                except (binascii.Error, ValueError):
                    raise ValueError(f"file {f!r}: \"digests\" is not base64 text") from None
                if len(data) % 8:
                    raise ValueError(f"file {f!r}: \"digests\" holds {len(data)} bytes, not 8 per block")
                hexed = data.hex()
                blocks = [hexed[i:i + 16] for i in range(0, len(hexed), 16)]
            else:
                blocks = [str(b) for b in r["blocks"]]
            if len(blocks) != -(-size // bs):
                raise ValueError(f"file {f!r}: {len(blocks)} blocks recorded for {size} bytes")
            out[str(f)] = FileChecksums(str(f), size, bs, blocks)
        return out
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointFormatError(f"malformed checksums in the checkpoint metadata: {e}") from None


class BlockVerifier:
    """Verifies blocks of the data files of one opened checkpoint, each block at most once.

    Args:
        root_of: a callable giving the path of a data file (``reader.path_of``).
        checksums: :func:`recorded` of the checkpoint.
    """

    def __init__(self, path_of: Any, checksums: dict[str, FileChecksums]):
        self.path_of = path_of
        self.checksums = checksums
        self.verified: set[tuple[str, int]] = set()
        self.bytes_verified = 0
        #: hashing threads on a filesystem (None: :func:`~oarlock.checkpoint.executor.io_threads`); 1 where the
        #: hashing runs beside the load's reads, which have the thread pool
        self.workers: int | None = None

    def bad_blocks(self, file: str, blocks: Iterable[int]) -> list[int]:
        """Check ``blocks`` of ``file`` (skipping ones already verified); returns the indices that do not match.

        Raises:
            ChecksumError: the file's size differs from the recorded one (truncated or extended), or its digests
                file is missing or corrupt.
        """
        fc = self.checksums.get(file)
        if fc is None:
            return []
        todo = sorted({b for b in blocks if (file, b) not in self.verified})
        if not todo:
            return []
        path = self.path_of(file)
        if not storage_for(path).mappable:  # fetched and hashed by ranged reads, kept for the load's reads
            return self.bad_blocks_of({file: todo}).get(file, [])
        path = Path(path)
        with opened(path) as (fd, size):
            if size != fc.size:
                raise ChecksumError(f"{path}: file has {size} bytes, {fc.size} were written at save (truncated or "
                                    "overwritten)")
            _read_ahead(fd, todo, fc.block_size, size)
            digests = fc.blocks  # read here, once, not in the hashing threads (a digests file)

            def check(b: int) -> bool:
                lo, hi = b * fc.block_size, min(size, (b + 1) * fc.block_size)
                return _digest_block(fd, lo, hi - lo) == digests[b]

            n = self.workers or io_threads()
            # xxhash releases the GIL on large inputs: blocks hash in parallel
            return self._run_checks(fc, todo, check, min(n, len(todo)), n > 1 and len(todo) > 2)

    def read_ahead(self, todo: dict[str, Iterable[int]]) -> None:
        """Start the disk reads of the given blocks of local files (file -> block indices) without waiting for them
        (:func:`_read_ahead`); files in an object store, unknown files and files that cannot be opened are left to
        :meth:`bad_blocks_of`, which reports them."""
        for file, blocks in todo.items():
            fc = self.checksums.get(file)
            path = self.path_of(file)
            if fc is None or not storage_for(path).mappable:
                continue
            try:
                with opened(path) as (fd, _):
                    _read_ahead(fd, sorted(set(blocks)), fc.block_size, fc.size)
            except OSError:
                continue

    def bad_blocks_of(self, todo: dict[str, Iterable[int]]) -> dict[str, list[int]]:
        """:meth:`bad_blocks` of several files: file -> indices that do not match (files with none left out).
        Objects in a store are checked together: their sizes first, then runs of consecutive blocks fetched with
        ranged GETs of exactly their bytes (up to the store's ``READ_PART`` each), all by one pool of
        ``read_concurrency`` requests in flight (latency-bound requests, not one
        file after another), hashed, and kept for the load's reads where the budget allows
        (:meth:`~oarlock.checkpoint.storage.backend.Storage.keep_verified`).

        Raises:
            ChecksumError: as :meth:`bad_blocks`; an object's size is checked before any of its blocks is fetched.
        """
        out: dict[str, list[int]] = {}
        objects: list[tuple[FileChecksums, Any, list[int]]] = []
        for file in sorted(todo):
            fc = self.checksums.get(file)
            if fc is None:
                continue
            path = self.path_of(file)
            if storage_for(path).mappable:
                bad = self.bad_blocks(file, todo[file])
                if bad:
                    out[file] = bad
                continue
            blocks = sorted({b for b in todo[file] if (file, b) not in self.verified})
            if blocks:
                objects.append((fc, path, blocks))
        if not objects:
            return out
        n = min(storage_for(objects[0][1]).read_concurrency or io_threads(), len(objects) + sum(len(b) for _, _, b in objects))
        for (fc, path, _), size in zip(objects, pool_map(lambda o: o[1].storage.size(o[1].key), objects, n)):
            if size != fc.size:
                raise ChecksumError(f"{path}: object has {size} bytes, {fc.size} were written at save "
                                    "(truncated or overwritten)")
        tasks: list[tuple[FileChecksums, Any, list[str], list[int]]] = []
        for fc, path, blocks in objects:
            digests = fc.blocks
            # runs of consecutive blocks fetched by one GET of up to the store's read part (fewer requests)
            per_get = max(1, getattr(path.storage, "READ_PART", 0) // fc.block_size)
            run: list[int] = []
            for b in blocks:
                if run and (b != run[-1] + 1 or len(run) == per_get):
                    tasks.append((fc, path, digests, run))
                    run = []
                run.append(b)
            tasks.append((fc, path, digests, run))

        def check(task: tuple) -> list[bool]:
            fc, path, digests, run = task
            bs = fc.block_size
            lo = run[0] * bs
            buf = np.empty(run[-1] * bs + fc.block_length(run[-1]) - lo, dtype=np.uint8)  # every byte fetched
            path.storage.read_into(path.key, lo, memoryview(buf))
            ok = []
            for b in run:
                block = buf[b * bs - lo:b * bs - lo + fc.block_length(b)]
                good = _digest(block) == digests[b]
                if good:  # the load's reads of this block copy these bytes instead of fetching them again
                    path.storage.keep_verified(path.key, b * bs, bs, block)
                ok.append(good)
            return ok

        verdicts = pool_map(check, tasks, n)
        for (fc, _, _, run), ok in zip(tasks, verdicts):
            bad = [b for b, good in zip(run, ok) if not self._record(fc, b, good)]
            if bad:
                out.setdefault(fc.file, []).extend(bad)
        return out

    def _record(self, fc: FileChecksums, b: int, good: bool) -> bool:
        """Count block ``b`` of ``fc`` as hashed, and as verified when ``good``; returns ``good``."""
        if good:
            self.verified.add((fc.file, b))
        self.bytes_verified += fc.block_length(b)
        return good

    def _run_checks(self, fc: FileChecksums, todo: list[int], check: Any, workers: int, parallel: bool
                    ) -> list[int]:
        """Run ``check(block) -> bool`` over ``todo`` (on ``workers`` threads when ``parallel``), record the good
        blocks and the bytes hashed; returns the bad blocks."""
        ok = pool_map(check, todo, workers if parallel else 1)
        return [b for b, good in zip(todo, ok) if not self._record(fc, b, good)]


def _read_layout(reader: Any, file: str, name: str, flat_start: int, shape: Sequence[int],
                 box: Sequence[tuple[int, int]]) -> tuple[int, int, list[int], list[tuple[int, int]]] | None:
    """Where a read of ``box`` lies in safetensors data file ``file``: ``(base, itemsize, strides, box)``, with
    ``base`` the file offset of the read array's element 0 and C-order ``strides`` in elements (a 0-d array is
    seen as shape ``(1,)``); None when the box is empty, the tensor is not in the file, or ``file`` is not a
    safetensors file."""
    if not file.endswith(".safetensors") or any(b <= a for a, b in box):
        return None
    f = reader.safetensors_file(file)
    e = f.entries.get(name)
    if e is None:
        return None
    dtype, _, begin, _ = e
    isz = dtype_itemsize(dtype)
    if not len(shape):
        shape, box = (1,), [(0, 1)]
    return f.data_start + begin + int(flat_start) * isz, isz, c_strides(tuple(shape)), box


@functools.lru_cache(maxsize=4096)
def c_strides(shape: tuple[int, ...]) -> list[int]:
    """C-order strides in elements of an array of ``shape`` (cached: a checkpoint has few distinct shapes)."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * int(shape[d + 1])
    return strides


def _elements_before(x: int, strides: list[int], box: list[tuple[int, int]], inner: list[int]) -> int:
    """How many elements of ``box`` (of a C-order array with ``strides``) lie at flat offsets below ``x``;
    ``inner[d]``: elements of the box in dimensions after ``d``. O(ndim): only the index of dimension ``d`` that
    holds offset ``x`` is partly below it."""
    n = 0
    for d, ((a, b), s) in enumerate(zip(box, strides)):
        k, x = divmod(x, s)  # x falls in index k of dimension d, x elements into it
        n += max(0, min(k, b) - a) * inner[d]
        if not a <= k < b:
            break
    return n


def block_bytes(reader: Any, fc: FileChecksums, name: str, flat_start: int, shape: Sequence[int],
                box: Sequence[tuple[int, int]]) -> dict[int, int]:
    """Bytes a read of ``box`` of stored tensor ``name`` (an array of ``shape`` starting ``flat_start`` elements
    into it) takes from each block of data file ``fc.file``: block index -> bytes, exact for strided boxes (a
    column slice of a row-major tensor takes a part of every block its span crosses). Empty for empty boxes and
    files that are not safetensors."""
    lay = _read_layout(reader, fc.file, name, flat_start, shape, box)
    if lay is None:
        return {}
    base, isz, strides, box = lay
    first = sum(a * s for (a, _), s in zip(box, strides))
    last = sum((b - 1) * s for (_, b), s in zip(box, strides))
    blocks = fc.block_range(base + first * isz, base + (last + 1) * isz)
    if len(blocks) == 1:  # the common case of many small shards: no per-dimension counting
        return {blocks[0]: math.prod(b - a for a, b in box) * isz}
    inner = [1] * len(box)
    for d in range(len(box) - 2, -1, -1):
        inner[d] = inner[d + 1] * (box[d + 1][1] - box[d + 1][0])

    def before(pos: int) -> int:  # elements of the read starting below file offset pos
        return _elements_before(-(-(pos - base) // isz), strides, box, inner)

    out = {}
    for b in blocks:
        n = (before(min(fc.size, (b + 1) * fc.block_size)) - before(b * fc.block_size)) * isz
        if n > 0:
            out[b] = n
    return out


def _block_contents(reader: Any, file: str, b: int, block_size: int) -> str:
    """What block ``b`` of data file ``file`` holds, for an error: every key stored there with its shard box
    (``key 'a' shard box offset [0, 0] shape [4, 8]``), ``the file header`` when it holds header bytes."""
    by_name: dict[str, str] = {}
    for t in reader.metadata.tensors.values():
        for sh in t.shards:
            if sh.file == file:
                by_name.setdefault(sh.name, f"key {t.key!r} {_shard_words(reader.metadata, t.key, file, sh.name)}")
    names = corrupt_keys(reader.path_of(file), [b], block_size, reader, file)
    return ", ".join("the file header" if n == "header" else by_name.get(n, f"stored tensor {n!r}") for n in names)


def _shard_words(metadata: Any, key: str, file: str, name: str) -> str:
    """``shard box offset [..] shape [..]`` of the stored shard ``file``/``name`` of ``key``."""
    t = metadata.tensors.get(key)
    for sh in (t.shards if t is not None else ()):
        if sh.file == file and sh.name == name:
            words = f"shard box offset {list(sh.global_offset)} shape {list(sh.local_shape)}"
            if sh.flattened_range is not None:
                words += f" flat range {list(sh.flattened_range)}"
            return words
    return f"stored tensor {name!r}"


def touched_blocks(reader: Any, items: Iterable[Any], checksums: dict[str, FileChecksums],
                   file_bytes: dict[str, int] | None = None, files: set[str] | None = None
                   ) -> dict[str, dict[int, int]]:
    """The blocks this rank's read items touch in the data files it can see, with the bytes it reads from each:
    file -> block index -> bytes (summed over items, at most the block's length). Items are
    :class:`~oarlock.checkpoint.plan.ReadItem` s (``file``, ``name``, ``src_flat_start``, ``src_shape``,
    ``src_box``); files without recorded checksums and files this rank cannot see are left out. ``file_bytes``:
    the bytes the items need per file where already summed (the load's prepared reads), used for one-block
    files instead of summing the items again. ``files``: the files of ``items`` when known (``items`` is then
    iterated once, as it comes: a load's items made file by file are never all held at once)."""
    if files is None:
        items = items if isinstance(items, (list, tuple)) else list(items)
        files = {it.file for it in items}
    visible = reader.visible_files(files)  # only the files this rank reads
    out: dict[str, dict[int, int]] = {}
    state: dict[str, tuple | None] = {}  # file -> (checksums, per-block bytes, one block?); None: not summed here
    sizes: dict[str, int] = {}  # item size per key
    tensors = reader.metadata.tensors

    def one_block(f: str, fc: FileChecksums) -> bool:
        return fc.size <= fc.block_size and f.endswith(".safetensors")

    for f, n in (file_bytes or {}).items():
        fc = checksums.get(f)
        if fc is not None and f in visible and one_block(f, fc):
            out[f] = {0: min(n, fc.size)}
            state[f] = None  # summed already: its items are skipped below
    for it in items:
        entry = state.get(it.file, False)
        if entry is False:
            fc = checksums.get(it.file)
            entry = state[it.file] = None if fc is None or it.file not in visible else \
                (fc, out.setdefault(it.file, {}), one_block(it.file, fc))
        if entry is None:
            continue
        fc, per, single = entry
        if single:
            # a one-block file (many small shards): every byte read is in block 0, no layout needed
            isz = sizes.get(it.src_key)
            if isz is None:
                isz = sizes[it.src_key] = dtype_itemsize(tensors[it.src_key].dtype)
            n = box_volume(it.src_box) * isz
            if n:
                per[0] = min(per.get(0, 0) + n, fc.size)
            continue
        for b, n in block_bytes(reader, fc, it.name, it.src_flat_start, it.src_shape, it.src_box).items():
            per[b] = min(per.get(b, 0) + n, fc.block_length(b))
    return {f: per for f, per in out.items() if per}


#: A block goes to the rank reading the largest share of it, counted in 1/LEVELS of the block: ranks whose shares
#: differ by less (a column slice each) share such blocks round robin instead of one rank taking them all.
LEVELS = 16


#: Blocks given in turn to ranks with equal shares of them go in runs of this many consecutive blocks (32 MiB).
OWNER_RUN = 8


def block_owners(touched: dict[str, dict[int, int]], checksums: dict[str, FileChecksums], dist: Any
                 ) -> dict[str, list[int]]:
    """Collective over ``dist`` (a :class:`~oarlock.checkpoint.dist.DistWrapper`; every rank calls it, with
    ``touched`` empty where it reads nothing): the blocks this rank hashes for the group, file -> block indices.

    The blocks of all files in ``checksums`` are numbered globally (files sorted, each file's blocks in order),
    so the exchange is one ``all_reduce`` MAX of an int64 vector of one entry per block of the checkpoint,
    whatever the world size. A rank puts into the entry of each block it touches ``(level + 1) << shift | low``:
    ``level`` its share of the block in sixteenths (dithered per block, so near-equal shares seldom fall on two
    sides of a step), ``low = (rank + q) % world + 1`` with ``q = s + b // run`` for block ``b`` of a file whose
    blocks start at global index ``s``, distinct per rank, so the maximum names one toucher, and equal shares give
    runs of ``run`` consecutive blocks to each toucher in turn: ``run`` is the file's block count over the world
    size, between 1 and :data:`OWNER_RUN` (long runs: each owner reads long stretches of a file, which the disk
    streams, where single blocks in turn made two owners of one file each read every other block; short ones for
    small files, which would otherwise go whole to one rank). Without a process group this rank owns every block
    it touches.
    """
    if not dist.active:
        return {f: sorted(per) for f, per in touched.items()}
    import torch

    files = sorted(checksums)
    world, rank = dist.size, dist.rank
    start, run, total = {}, {}, 0
    for f in files:
        start[f] = total
        run[f] = max(1, min(OWNER_RUN, checksums[f].n_blocks // world))
        total += checksums[f].n_blocks
    shift = max(8, world.bit_length())
    idx, val = [], []
    for f, per in touched.items():
        fc = checksums[f]
        for b, n in per.items():
            g = start[f] + b
            length = fc.block_length(b)
            # a fixed sequence spread over [0, 1) in 1/65536 (golden-ratio steps), starting at one half: even
            # splits (a half, a quarter, ...) then sit mid-step, never on the step between two levels
            dither = (g * 40503 + 0x8000) & 0xFFFF
            level = (min(n, length) * LEVELS * 65536 // length + dither) >> 16
            idx.append(g)
            val.append(((level + 1) << shift) | ((rank + start[f] + b // run[f]) % world + 1))
    prio = torch.zeros(total, dtype=torch.int64)
    if idx:
        prio[torch.tensor(idx, dtype=torch.int64)] = torch.tensor(val, dtype=torch.int64)
    prio = dist.all_max_tensor(prio)
    g = torch.arange(total, dtype=torch.int64)
    counts = torch.tensor([checksums[f].n_blocks for f in files], dtype=torch.int64)
    s0 = torch.repeat_interleave(torch.tensor([start[f] for f in files], dtype=torch.int64), counts)
    q = s0 + torch.div(g - s0, torch.repeat_interleave(torch.tensor([run[f] for f in files], dtype=torch.int64),
                                                       counts), rounding_mode="floor")
    owner = torch.remainder((prio & ((1 << shift) - 1)) - 1 - q, world)
    mine = ((prio > 0) & (owner == rank)).nonzero().flatten().tolist()
    out: dict[str, list[int]] = {}
    fi = 0
    for gi in mine:  # ascending: walk the files along
        while gi >= start[files[fi]] + checksums[files[fi]].n_blocks:
            fi += 1
        out.setdefault(files[fi], []).append(gi - start[files[fi]])
    return out


def _whole_blocks_read(reader: Any, touched: dict[str, dict[int, int]], owned: dict[str, list[int]],
                       checksums: dict[str, FileChecksums]) -> dict[str, list[int]]:
    """Blocks of objects in a store that this rank reads (almost) whole but another rank owns: hashed here too,
    so that the one fetch that verifies them also serves this rank's reads (a second rank reading a block would
    otherwise fetch it once more after the verdict, in a phase of its own). Bounded by the room left in the
    budget of kept blocks once the owned ones are in (:func:`~oarlock.checkpoint.storage.s3.kept_room`); none
    on a filesystem, where a second read of a block costs little and each block is hashed once per group."""
    room = kept_room()
    if not room:
        return {}
    objects = [f for f in sorted(touched) if not storage_for(reader.path_of(f)).mappable]
    room -= sum(checksums[f].block_length(b) for f in objects for b in owned.get(f, ()))
    out: dict[str, list[int]] = {}
    for f in objects:
        fc, mine = checksums[f], set(owned.get(f, ()))
        for b, n in sorted(touched[f].items()):
            length = fc.block_length(b)
            if b in mine or n * 8 < length * 7 or length > room:
                continue
            out.setdefault(f, []).append(b)
            room -= length
    return out


def verify_group(reader: Any, items: Iterable[Any], dist: Any, file_bytes: dict[str, int] | None = None,
                 touched: dict[str, dict[int, int]] | None = None, phases: dict[str, float] | None = None,
                 during: Any = None) -> int:
    """Collective over ``dist`` (a :class:`~oarlock.checkpoint.dist.DistWrapper`; every rank of the load calls
    it, also one with no items): verify every block that the group's read items touch, each block hashed by one
    rank, before anything is written. This rank's ``items`` are
    :class:`~oarlock.checkpoint.plan.ReadItem` s; :func:`block_owners` picks, for each touched block, the rank
    that reads the largest share of it; each rank hashes the blocks it owns (:class:`BlockVerifier`), and one
    :meth:`~oarlock.checkpoint.dist.DistWrapper.check` shares the verdicts. Files a rank cannot see are skipped
    by it (another rank reads them). From an object store a rank also hashes the blocks it reads (almost) whole
    that another rank owns, within the budget of kept blocks (:func:`_whole_blocks_read`): the fetch that
    verifies them then serves its reads. ``file_bytes``: see :func:`touched_blocks`; ``touched``: its
    result when already summed (``items`` is then not read); ``phases``: seconds of ``verify`` (this rank's
    hashing) and ``verdict`` (the wait for the group) are added to it. ``during``: a callable (the load's reads)
    run in this thread while the blocks are hashed on another, before the verdict (``verify_checksums="overlap"``:
    the bytes are read from disk once, by whichever comes first, and hashing costs no time of its own); its
    exceptions propagate after the hashing has stopped. Without it, nothing runs before the verdict. Returns the
    bytes this rank hashed; 0 when the checkpoint records no checksums (then no collective runs: every rank reads
    the same metadata, and ``during`` just runs).

    Raises:
        ChecksumError: on every rank (prefixed ``"rank R: "`` on ranks other than the one that found it): a
            block's bytes differ from their checksum, naming the file, the block's byte range and index, and
            every key stored in that block with its shard box; or a file's size differs from the recorded one.
    """
    checksums = recorded(reader.metadata, reader.path_of)
    if not checksums:
        if during is not None:
            during()
        return 0
    t0 = time.perf_counter()
    err: BaseException | None = None
    if touched is None:
        touched = {}
        try:
            touched = touched_blocks(reader, items, checksums, file_bytes)
        except Exception as e:  # reported in the check below, after this rank has joined the exchange
            err = e
    owned = block_owners(touched, checksums, dist)
    verifier = BlockVerifier(reader.path_of, checksums)
    if during is not None:
        verifier.workers = 1

    def hash_owned() -> None:
        todo = {f: list(b) for f, b in owned.items()}
        for f, b in _whole_blocks_read(reader, touched, owned, checksums).items():
            todo.setdefault(f, []).extend(b)
        verifier.read_ahead(todo)  # every file's disk reads start now, not one file after another
        prefetch_digests([checksums[f] for f in todo])
        bad = verifier.bad_blocks_of(todo)
        if bad:
            file = min(bad)
            raise ChecksumError(_mismatch(reader, checksums[file], bad[file]))

    reading = 0.0
    if err is None and during is None:
        try:
            hash_owned()
        except Exception as e:
            err = e
    elif err is None:
        err, reading = hash_beside(hash_owned, during)
        err = overlapped_error(err)
    t1 = time.perf_counter()
    dist.check(err)
    if phases is not None:  # with ``during``: its time is "read", the hashing left after it is "verify"
        if reading:
            phases["read"] = phases.get("read", 0.0) + reading
        phases["verify"] = phases.get("verify", 0.0) + t1 - t0 - reading
        phases["verdict"] = phases.get("verdict", 0.0) + time.perf_counter() - t1
    return verifier.bytes_verified


def verify_reads_for_others(reader: Any, pieces: Iterable[tuple], own_items: Iterable[Any]) -> int:
    """Hash the blocks that ``pieces`` touch and this rank's own read items ``own_items`` do not: the pieces a rank
    reads only to ship them to ranks that cannot see their file (node-local disks, see
    :mod:`oarlock.checkpoint.comm`). :func:`verify_group` counts a block only for ranks that see its file, so a
    block read solely for such ranks has no owner there; the blocks this rank's own items touch had one.
    ``pieces``: ``(file, name, key, flat_start, shape, box)``. Not collective (the caller agrees on the verdict
    before any piece is read). Returns the bytes hashed; 0 when the checkpoint records no checksums.

    Raises:
        ChecksumError: naming the file, the block and the keys stored in it.
    """
    checksums = recorded(reader.metadata, reader.path_of)
    if not checksums:
        return 0
    own = touched_blocks(reader, own_items, checksums)
    todo: dict[str, set[int]] = {}
    for file, name, _key, flat_start, shape, box in pieces:
        fc = checksums.get(file)
        if fc is None:
            continue
        seen = own.get(file, {})
        todo.setdefault(file, set()).update(b for b in block_bytes(reader, fc, name, flat_start, shape, box)
                                            if b not in seen)
    todo = {f: sorted(b) for f, b in todo.items() if b}
    if not todo:
        return 0
    prefetch_digests([checksums[f] for f in todo])
    verifier = BlockVerifier(reader.path_of, checksums)
    bad = verifier.bad_blocks_of(todo)
    if bad:
        file = min(bad)
        raise ChecksumError(_mismatch(reader, checksums[file], bad[file]))
    return verifier.bytes_verified


def _mismatch(reader: Any, fc: FileChecksums, bad: list[int]) -> str:
    b = bad[0]
    lo, hi = b * fc.block_size, min(fc.size, (b + 1) * fc.block_size)
    more = f" (and {len(bad) - 1} more corrupt block(s))" if len(bad) > 1 else ""
    return (f"{reader.path_of(fc.file)}: checksum mismatch in bytes [{lo}, {hi}) (block {b}) holding "
            f"{_block_contents(reader, fc.file, b, fc.block_size)}{more}: the file was corrupted after it was "
            "written; nothing was loaded")


def corrupt_keys(file_path: str | Path, blocks: Sequence[int], block_size: int, reader: Any = None,
                 file: str | None = None) -> list[str]:
    """Names of the tensors of safetensors file ``file_path`` whose bytes overlap any of ``blocks`` ("header"
    when a block holds header bytes). With ``reader`` (the opened checkpoint) and ``file`` (its name there), the
    pieces of a packed data file are named by their keys; else by the header alone."""
    h: Any = None
    if reader is not None and file is not None:
        try:
            h = reader.safetensors_file(file)
        except CheckpointFormatError:
            h = None
    if h is None:
        try:
            h = read_header(file_path)
        except CheckpointFormatError:
            return ["header"]
    out: list[str] = []
    for b in blocks:
        lo, hi = b * block_size, (b + 1) * block_size
        if lo < h.data_start:
            out.append("header")
        for name, (_, _, begin, end) in h.entries.items():
            if end > begin and h.data_start + begin < hi and h.data_start + end > lo:
                out.append(name)
    return list(dict.fromkeys(out))


def _own_file_keys(root: Path, file: str, b: int, block_size: int) -> list[str]:
    """:func:`corrupt_keys` of block ``b`` of ``root / file``, resolving a packed file through the metadata (only
    on this error path: the warm restart does not open the checkpoint otherwise)."""
    from oarlock.checkpoint.formats import load_formats

    try:
        with load_formats()["oarlock"].open(root, partial=True) as r:
            return corrupt_keys(root / file, [b], block_size, r, file)
    except Exception:  # the message still names the file and block
        return corrupt_keys(root / file, [b], block_size)


def verify_own_file(root: str | Path, file: str, workers: int | None = None) -> int:
    """Verify every block of data file ``file`` of the oarlock checkpoint directory ``root`` against the checksums
    in its ``metadata.json`` (the warm restart reads whole own files: no other rank's bytes are hashed). Returns
    the bytes hashed: 0 when no checksums are recorded (nothing to do). ``workers``: hashing threads (None:
    :func:`~oarlock.checkpoint.executor.io_threads`).

    Raises:
        ChecksumError: naming the file, the first corrupt block's byte range and index, and every key stored in
            it (``key 'a', key 'b'``; in this rank's own file the stored tensors are named by their keys).
    """
    root = Path(root)
    try:
        extra = json.loads((root / METADATA_FILE).read_text()).get("extra") or {}
    except (OSError, ValueError):
        return 0  # the normal path reports an unreadable metadata file; the warm path never needed it
    sums = parse_checksums(extra.get(CHECKSUMS_KEY), lambda f: checkpoint_file(root, f, f"{root}: checksums file"))
    if not sums or file not in sums:
        return 0
    fc = sums[file]
    v = BlockVerifier(lambda f: root / f, sums)
    v.workers = workers
    bad = v.bad_blocks(file, range(fc.n_blocks))
    if bad:
        b = bad[0]
        lo, hi = b * fc.block_size, min(fc.size, (b + 1) * fc.block_size)
        keys = _own_file_keys(root, file, b, fc.block_size)
        held = ", ".join("the file header" if k == "header" else f"key {k!r}" for k in keys)
        more = f" (and {len(bad) - 1} more corrupt block(s))" if len(bad) > 1 else ""
        raise ChecksumError(f"{root / file}: checksum mismatch in bytes [{lo}, {hi}) (block {b}) holding "
                            f"{held}{more}: the file was corrupted after it was written; nothing was loaded")
    return v.bytes_verified


def verify_all_blocks(reader: Any) -> int:
    """Verify every block of every data file of an opened checkpoint that records checksums (conversions read
    whole checkpoints: check them before writing anything). Returns the bytes hashed (0 without checksums).

    Raises:
        ChecksumError: naming the file, the first corrupt block's byte range and the tensors stored there.
    """
    sums = recorded(reader.metadata, reader.path_of)
    if not sums:
        return 0
    v = BlockVerifier(reader.path_of, sums)
    for file in sorted(set(reader.metadata.files) & set(sums)):
        if file.endswith(".safetensors"):  # header and save id first: a file of another save is named as such
            reader.safetensors_file(file)
        fc = sums[file]
        bad = v.bad_blocks(file, range(fc.n_blocks))
        if bad:
            b = bad[0]
            lo, hi = b * fc.block_size, min(fc.size, (b + 1) * fc.block_size)
            keys = corrupt_keys(reader.path_of(file), [b], fc.block_size, reader, file)
            raise ChecksumError(f"{reader.path_of(file)}: checksum mismatch in bytes [{lo}, {hi}) (block {b}) holding "
                                f"{', '.join(repr(k) for k in keys)}: the file was corrupted after it was written")
    return v.bytes_verified


def equal_by_checksum(a: Any, b: Any) -> set[str]:
    """Keys of metadata ``a`` and ``b`` whose stored bytes are equal as proven by checksums alone: the key has the
    same dtype and the same shards (boxes, flat ranges, stored names) on both sides, and each shard lies in files
    whose recorded sizes and block checksums are identical (so the files, header included, are the same bytes).
    Empty when either side has no checksums."""
    sa, sb = recorded(a), recorded(b)
    if not sa or not sb:
        return set()

    def sig(meta: Any, sums: dict[str, FileChecksums], key: str) -> tuple | None:
        t = meta.tensors[key]
        out = []
        for sh in t.shards:
            fc = sums.get(sh.file)
            if fc is None:
                return None
            out.append((tuple(sh.global_offset), tuple(sh.local_shape), sh.flattened_range, sh.name,
                        sh.replica_id or 0, fc.signature()))
        return (t.dtype, tuple(t.global_shape), tuple(sorted(out, key=repr)))

    same = set()
    for k in a.tensors:
        if k in b.tensors:
            x = sig(a, sa, k)
            if x is not None and x == sig(b, sb, k):
                same.add(k)
    return same


# ---------------------------------------------------------------- oarlock verify

@dataclass
class Problem:
    """One thing wrong with a checkpoint: ``file`` (relative; "" for the checkpoint as a whole), the byte range
    of a corrupt block (``block``/``start``/``stop``; None for structural problems), the ``keys`` stored there
    and a message."""

    file: str
    message: str
    keys: list[str]
    block: int | None = None
    start: int | None = None
    stop: int | None = None

    def __post_init__(self) -> None:
        # the report names the file once: an error's own leading path of the same file is dropped from the message
        head, sep, rest = self.message.partition(": ")
        if self.file and sep and (head == self.file or head.endswith(("/" + self.file, os.sep + self.file))):
            self.message = rest


@dataclass
class VerifyReport:
    """The result of :func:`verify_checkpoint`. ``checksums``: whether the checkpoint records block checksums
    (every block then hashed); without them only the structure is checked."""

    path: str
    format: str
    checksums: bool
    files_checked: int = 0
    bytes_hashed: int = 0
    problems: list[Problem] = None  # type: ignore[assignment]
    opened: bool = True  # False: the checkpoint could not be opened (its problem says why), nothing was hashed

    def __post_init__(self) -> None:
        if self.problems is None:
            self.problems = []

    @property
    def intact(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["intact"] = self.intact
        return d

    def render(self) -> str:
        def line(p: Problem) -> str:
            if p.file:
                return f"{p.file}: {p.message}"
            # an error that names its own file inside the checkpoint is printed as it is (the path once)
            head = p.message.partition(": ")[0]
            inside = head == self.path or head.startswith(self.path.rstrip("/") + "/")
            return p.message if inside else f"{self.path}: {p.message}"

        lines = [line(p) for p in self.problems]
        what = "every block checked against its checksum" if self.checksums else \
            "no checksums recorded: headers, sizes, offsets and shard coverage checked"
        if not self.opened:
            lines.append(f"{self.path}: {self.format} checkpoint, could not be opened, "
                         f"{len(self.problems)} problem(s) (nothing was hashed)")
            return "\n".join(lines)
        lines.append(f"{self.path}: {self.format} checkpoint, {self.files_checked} file(s), "
                     f"{'intact' if self.intact else f'{len(self.problems)} problem(s)'} ({what})")
        return "\n".join(lines)


def _check_structure(reader: Any, rep: VerifyReport) -> None:
    """Checks that need no checksums: every key's shards tile its box, every data file opens with a valid header
    (offsets inside the file, sizes matching shapes and dtypes), and holds each shard the metadata names with
    the metadata's dtype and element count."""
    for t in reader.metadata.tensors.values():
        try:
            index_of(t)
        except CheckpointError as e:  # CheckpointTilingError: a gap, an overlap, a box out of bounds
            rep.problems.append(Problem("", str(e), [t.key]))
    by_file: dict[str, list[tuple[str, Any]]] = {}
    for t in reader.metadata.tensors.values():
        for sh in t.shards:
            by_file.setdefault(sh.file, []).append((t.key, sh))
    for file, shards in sorted(by_file.items()):
        rep.files_checked += 1
        if not reader.path_of(file).is_file():
            rep.problems.append(Problem(file, "data file is missing", sorted({k for k, _ in shards})))
            continue
        if not file.endswith(".safetensors"):  # Paddle pickles: read one element of every shard
            for key, sh in shards:
                try:
                    if sh.numel:
                        n = len(sh.local_shape) if sh.flattened_range is None else 1
                        shape = tuple(sh.local_shape) if sh.flattened_range is None else (sh.numel,)
                        reader.read_box(key, file, sh.name, 0, shape, tuple((0, 1) for _ in range(n)))
                except Exception as e:
                    rep.problems.append(Problem(file, f"key {key!r}: {e}", [key]))
            continue
        try:
            f = reader.safetensors_file(file)
        except CheckpointFormatError as e:
            rep.problems.append(Problem(file, str(e), sorted({k for k, _ in shards})))
            continue
        for key, sh in shards:
            e = f.entries.get(sh.name)
            dtype = reader.metadata.tensors[key].dtype
            if e is None:
                rep.problems.append(Problem(file, f"tensor {sh.name!r} of key {key!r} is missing", [key]))
            elif e[0] != dtype:
                rep.problems.append(Problem(file, f"tensor {sh.name!r} is {e[0]}, the metadata says {dtype}", [key]))
            else:
                have = 1
                for x in e[1]:
                    have *= int(x)
                if sh.numel > have:
                    rep.problems.append(Problem(file, f"tensor {sh.name!r} holds {have} elements, the metadata's "
                                                      f"shard of key {key!r} needs {sh.numel}", [key]))


def _hash_file(reader: Any, fc: FileChecksums) -> tuple[list[Problem], int]:
    path = reader.path_of(fc.file)
    v = BlockVerifier(reader.path_of, {fc.file: fc})
    try:
        bad = v.bad_blocks(fc.file, range(fc.n_blocks))
    except ChecksumError as e:
        return [Problem(fc.file, str(e), [])], 0
    except CheckpointFormatError as e:  # an object store's answer: no such object, a short object
        if not path.is_file():
            return [], 0  # _check_structure reports the missing file, as for a local one
        return [Problem(fc.file, str(e), [])], 0
    except OSError as e:
        return [Problem(fc.file, f"cannot read: {e.strerror or e}", [])], 0
    out = []
    for b in bad:
        lo, hi = b * fc.block_size, min(fc.size, (b + 1) * fc.block_size)
        keys = corrupt_keys(path, [b], fc.block_size, reader, fc.file)
        out.append(Problem(fc.file, f"checksum mismatch in bytes [{lo}, {hi}) (block {b}) holding "
                                    f"{', '.join(repr(k) for k in keys)}", keys, b, lo, hi))
    return out, v.bytes_verified


def verify_checkpoint(path: str | Path) -> VerifyReport:
    """Check a checkpoint on disk without loading it (``oarlock verify``): its structure (headers, offsets, sizes,
    the shards the metadata names, coverage of every key) and, when block checksums are recorded, every block of
    every data file (hashed in parallel on ``OARLOCK_IO_THREADS`` threads, default ``min(4, CPUs)``). Data files
    the metadata does not name are not opened.

    Raises:
        CheckpointFormatError: ``path`` is not a checkpoint (no format detected) -- bad input, not corruption.
    """
    fmt = detect_format(path)
    try:
        reader = open_checkpoint(path)
    except CheckpointFormatError as e:  # detected but unreadable metadata or header: corruption
        rep = VerifyReport(str(path), fmt, False, opened=False)
        rep.problems.append(Problem("", str(e), []))
        return rep
    with reader:
        sums = recorded(reader.metadata, reader.path_of)
        rep = VerifyReport(str(path), fmt, bool(sums))
        if sums:
            missing = set(reader.metadata.files) - set(sums)
            for f in sorted(missing):
                rep.problems.append(Problem(f, "data file has no recorded checksums", []))
            for f in sorted(sums):  # the blocks of each file are hashed in parallel (BlockVerifier)
                probs, nbytes = _hash_file(reader, sums[f])
                rep.problems.extend(probs)
                rep.bytes_hashed += nbytes
        _check_structure(reader, rep)
    return rep
