"""``oarlock verify``: a checkpoint checked on disk without loading it (:func:`verify_checkpoint`), its structure
and, where block checksums are recorded, every block; the result a :class:`VerifyReport` of :class:`Problem` s that
the CLI renders as text or JSON."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from oarlock.checkpoint.errors import CheckpointError, CheckpointFormatError
from oarlock.checkpoint.formats.opening import open_checkpoint
from oarlock.checkpoint.integrity.checksums import FileChecksums, recorded
from oarlock.checkpoint.integrity.hashing import ChecksumError
from oarlock.checkpoint.integrity.verifier import BlockVerifier
from oarlock.checkpoint.integrity.verify import corrupt_keys
from oarlock.checkpoint.planning.load import index_of
from oarlock.checkpoint.storage import detect_format


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
                                    f"{', '.join('the file header' if k == 'header' else f'key {k!r}' for k in keys)}", keys, b, lo, hi))
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
