"""Verification before (or while) a checkpoint is read: :func:`verify_group` (a load: every block the group's reads
touch, each hashed by one rank, the verdict shared), :func:`verify_reads_for_others` (pieces read only for ranks
that cannot see their file), :func:`verify_own_file` (the warm restart: a rank's own file) and
:func:`verify_all_blocks` (a conversion: every block). A mismatch raises :class:`ChecksumError` naming the file,
the block's byte range and what it holds (:func:`corrupt_keys`). ``verify_checksums="overlap"`` hashes beside the
reads (:func:`hash_beside`)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from oarlock.checkpoint.errors import CheckpointError, CheckpointFormatError
from oarlock.checkpoint.integrity.checksums import FileChecksums, parse_checksums, prefetch_digests, recorded
from oarlock.checkpoint.integrity.hashing import CHECKSUMS_KEY, ChecksumError
from oarlock.checkpoint.integrity.ownership import block_bytes, block_owners, touched_blocks, whole_blocks_read
from oarlock.checkpoint.integrity.verifier import BlockVerifier
from oarlock.checkpoint.model.names import METADATA_FILE
from oarlock.checkpoint.formats.reader import checkpoint_file
from oarlock.checkpoint.storage.safetensors import read_header


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


def verify_group(reader: Any, items: Iterable[Any], dist: Any, file_bytes: dict[str, int] | None = None,
                 touched: dict[str, dict[int, int]] | None = None, phases: dict[str, float] | None = None,
                 during: Any = None) -> int:
    """Collective over ``dist`` (a :class:`~oarlock.checkpoint.runtime.dist.DistWrapper`; every rank of the load calls
    it, also one with no items): verify every block that the group's read items touch, each block hashed by one
    rank, before anything is written. This rank's ``items`` are
    :class:`~oarlock.checkpoint.planning.load.ReadItem` s; :func:`block_owners` picks, for each touched block, the rank
    that reads the largest share of it; each rank hashes the blocks it owns (:class:`BlockVerifier`), and one
    :meth:`~oarlock.checkpoint.runtime.dist.DistWrapper.check` shares the verdicts. Files a rank cannot see are skipped
    by it (another rank reads them). From an object store a rank also hashes the blocks it reads (almost) whole
    that another rank owns, within the budget of kept blocks (:func:`whole_blocks_read`): the fetch that
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
        for f, b in whole_blocks_read(reader, touched, owned, checksums).items():
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
    :mod:`oarlock.checkpoint.runtime.comm`). :func:`verify_group` counts a block only for ranks that see its file, so a
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
    :func:`~oarlock.checkpoint.runtime.executor.io_threads`).

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
