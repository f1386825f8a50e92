"""The checksums a checkpoint records, as a load reads them: :func:`recorded` / :func:`parse_checksums` parse
``extra.checksums`` into one :class:`FileChecksums` per data file (inline digests, or a digests file read on first
use and checked against the XXH3 the metadata records), :func:`prefetch_digests` reads many digests files at once,
and :func:`equal_by_checksum` compares two checkpoints by their records alone."""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any, Sequence

import xxhash

from oarlock.checkpoint.errors import CheckpointError, CheckpointFormatError
from oarlock.checkpoint.integrity.hashing import ALGORITHM, CHECKSUMS_KEY, DIGESTS_SUFFIX, ChecksumError
from oarlock.checkpoint.runtime.executor import io_threads, pool_map
from oarlock.checkpoint.storage import storage_for, storage_key


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
