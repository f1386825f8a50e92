"""Stored blocks hashed against their recorded checksums: :class:`BlockVerifier` checks blocks of the data files
of one opened checkpoint, each at most once -- a local file through page-cache mappings on a pool of hashing
threads, objects in a store by ranged reads of runs of blocks whose verified bytes the store may keep for the
load's reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import numpy as np

from oarlock.checkpoint.integrity.checksums import FileChecksums
from oarlock.checkpoint.integrity.hashing import ChecksumError, hex_digest, digest_block
from oarlock.checkpoint.runtime.executor import io_threads, pool_map
from oarlock.checkpoint.storage import storage_for
from oarlock.checkpoint.storage.pages import opened, read_ahead


class BlockVerifier:
    """Verifies blocks of the data files of one opened checkpoint, each block at most once.

    Args:
        path_of: a callable giving the path of a data file (``reader.path_of``).
        checksums: :func:`~oarlock.checkpoint.integrity.checksums.recorded` of the checkpoint.
    """

    def __init__(self, path_of: Any, checksums: dict[str, FileChecksums]):
        self.path_of = path_of
        self.checksums = checksums
        self.verified: set[tuple[str, int]] = set()
        self.bytes_verified = 0
        #: hashing threads on a filesystem (None: :func:`~oarlock.checkpoint.runtime.executor.io_threads`); 1 where the
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
            read_ahead(fd, todo, fc.block_size, size)
            digests = fc.blocks  # read here, once, not in the hashing threads (a digests file)

            def check(b: int) -> bool:
                lo, hi = b * fc.block_size, min(size, (b + 1) * fc.block_size)
                return digest_block(fd, lo, hi - lo) == digests[b]

            n = self.workers or io_threads()
            # xxhash releases the GIL on large inputs: blocks hash in parallel
            return self._run_checks(fc, todo, check, min(n, len(todo)), n > 1 and len(todo) > 2)

    def read_ahead(self, todo: dict[str, Iterable[int]]) -> None:
        """Start the disk reads of the given blocks of local files (file -> block indices) without waiting for them
        (:func:`~oarlock.checkpoint.storage.pages.read_ahead`); files in an object store, unknown files and files that cannot be opened are left to
        :meth:`bad_blocks_of`, which reports them."""
        for file, blocks in todo.items():
            fc = self.checksums.get(file)
            path = self.path_of(file)
            if fc is None or not storage_for(path).mappable:
                continue
            try:
                with opened(path) as (fd, _):
                    read_ahead(fd, sorted(set(blocks)), fc.block_size, fc.size)
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
                good = hex_digest(block) == digests[b]
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
