"""Checkpoint sources and destinations on disk: detect a source's format and open it through its reader
(:mod:`oarlock.checkpoint.reader`, one module per format in :mod:`oarlock.checkpoint.formats`), share the view of
a checkpoint between ranks with node-local disks, and publish written directories atomically.

Formats recognised by :func:`open_checkpoint` (see ``docs/checkpoint-format.md``):

* ``safetensors``: one ``.safetensors`` file; every tensor is one whole shard.
* ``huggingface``: a directory with ``model.safetensors``, or sharded files listed by
  ``model.safetensors.index.json`` (``{"metadata": {...}, "weight_map": {key: file}}``).
* ``oarlock``: a directory with ``metadata.json`` (see :mod:`oarlock.checkpoint.metadata`) and per-rank
  safetensors data files.
* ``paddle``: a PaddlePaddle FlexCheckpoint directory, ``{uid}.metadata`` plus ``{rank}_{uid}.distcp``
  pickles or ``{rank}_{uid}.safetensors`` files; pickles go through the restricted unpickler.

Reading never writes into the source directory. Headers are validated by the safetensors library before any
byte is trusted; its errors are re-raised as :class:`CheckpointFormatError` naming the file.

Writing (save, convert, HF export) goes through one commit protocol: :func:`staging_path` names a hidden
temporary sibling of the destination, :func:`staged_directory` creates it (removing it again on any error),
and :func:`publish_directory` makes it appear under its final name in one rename.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from oarlock.checkpoint.dist import DistWrapper
from oarlock.checkpoint.errors import CheckpointFormatError
from oarlock.checkpoint.formats import load_formats
from oarlock.checkpoint.formats.huggingface import HF_INDEX, HF_SINGLE, PADDLE_HF_CACHE
from oarlock.checkpoint.metadata import METADATA_FILE, CheckpointMetadata
from oarlock.checkpoint.reader import CheckpointReader, checkpoint_file
from oarlock.checkpoint.safetensors_io import (SafetensorsFile, contiguous_run, np_prod, safetensors_header,
                                               write_safetensors)

__all__ = ["CheckpointReader", "SafetensorsFile", "View", "contiguous_run", "detect_format", "fsync_dir",
           "gather_view", "np_prod", "open_checkpoint", "publish_directory", "check_destination", "recover_publish", "read_metadata", "safetensors_header",
           "staged_directory", "staging_path", "write_safetensors", "HF_INDEX", "HF_SINGLE", "INCOMPLETE_MARKER",
           "PADDLE_HF_CACHE"]

INCOMPLETE_MARKER = ".oarlock-incomplete"  # present in a save's temporary directory until it is committed


# ---------------------------------------------------------------- detection and opening

def detect_format(path: str | os.PathLike) -> str:
    """Name the checkpoint format at ``path`` (see module docstring).

    Raises:
        CheckpointFormatError: path missing, or a directory that holds no checkpoint, an unfinished save, or
            mixes formats.
    """
    p = Path(path)
    recover_publish(p)  # a replacement of this checkpoint interrupted by a crash is completed first
    if not p.exists():
        raise CheckpointFormatError(f"{p}: no such file or directory")
    formats = load_formats()
    names = None if p.is_file() else set(os.listdir(p))
    if names is not None and INCOMPLETE_MARKER in names:
        raise CheckpointFormatError(f"{p}: incomplete checkpoint (a save into this directory did not finish; "
                                    "it holds no usable data)")
    claims = {name: cls.claim(p, names) for name, cls in formats.items()}
    sure = [name for name, c in claims.items() if c >= 2]
    if len(sure) > 1:
        raise CheckpointFormatError(f"{p}: directory mixes checkpoint formats ({' and '.join(sure)}); "
                                    "keep one checkpoint per directory")
    if sure:
        return sure[0]
    guess = [name for name, c in claims.items() if c == 1]
    if guess:
        return guess[0]
    if names is None:
        raise CheckpointFormatError(f"{p}: not a checkpoint file (expected a .safetensors file or a directory)")
    hints = ", ".join(cls.hint for cls in formats.values() if cls.hint and cls.format != "safetensors")
    shown = sorted(names)[:12]
    found = ", ".join(shown) + (f" and {len(names) - len(shown)} more" if len(names) > len(shown) else "")
    raise CheckpointFormatError(f"{p}: no checkpoint found (looked for {hints}; found "
                                f"{found or 'an empty directory'})")


@dataclass
class View:
    """What every rank of a load sees of the checkpoint: its directory listing (``visible[rank]``), the format
    of the first rank that recognised one, and, for a rank that lacks the format's metadata files, their bytes
    as received from the lowest rank that has them (``shipped``)."""

    visible: dict[int, set[str]]
    format: str | None = None
    shipped: dict[str, bytes] | None = None
    same: bool = False  # every rank lists the same names (a shared filesystem): visible holds one set for all


def gather_view(path: str | os.PathLike, dist: DistWrapper) -> View:
    """Collective: all-gather each rank's listing of ``path`` and detected format; ship the format's metadata
    files to ranks lacking them. Never raises (problems surface when the checkpoint is opened, on every rank
    alike)."""
    p = Path(path)
    try:
        names = sorted(os.listdir(p)) if p.is_dir() else ([p.name] if p.exists() else [])
    except OSError:
        names = []
    try:
        fmt: str | None = detect_format(p)
    except CheckpointFormatError:
        fmt = None
    # a shared filesystem gives every rank the same listing: exchange a fingerprint of it first (fixed size per
    # rank), and the listings themselves only when they differ (node-local disks)
    digest = hashlib.sha256("\0".join(names).encode()).hexdigest()
    prints = dist.all_gather_object((digest, fmt))
    if len({d for d, _ in prints}) == 1:
        shared = set(names)
        return _view({r: shared for r in range(len(prints))}, prints, p, dist, same=True)
    gathered = dist.all_gather_object((names, fmt))
    visible = {r: set(n) for r, (n, _) in enumerate(gathered)}
    return _view(visible, gathered, p, dist)


def _view(visible: dict[int, set[str]], gathered: list[tuple], p: Path, dist: DistWrapper, same: bool = False
          ) -> View:
    formats = load_formats()
    view_fmt = next((f for _, f in gathered if f in formats and formats[f].metadata_files), None)
    if view_fmt is None:
        return View(visible, next((f for _, f in gathered if f is not None), None), same=same)
    files = formats[view_fmt].metadata_files
    if same:
        return View(visible, view_fmt, same=True)
    holders = [r for r in sorted(visible) if all(m in visible[r] for m in files)]
    if not holders or len(holders) == len(visible):
        return View(visible, view_fmt)
    payload = None
    if dist.rank == holders[0]:
        try:
            payload = {m: checkpoint_file(p, m, str(p)).read_bytes() for m in files}
        except (OSError, CheckpointFormatError):
            payload = None
    payload = dist.broadcast_object(payload, holders[0])
    return View(visible, view_fmt, payload if dist.rank not in holders else None)


def open_checkpoint(path: str | os.PathLike, *, view: View | None = None, rank: int = 0) -> CheckpointReader:
    """Open any supported checkpoint at ``path`` for reading (see the module docstring for formats).

    With a ``view`` (from :func:`gather_view`), this rank's directory may hold only some data files (node-local
    disks) and may lack the metadata files, which then come from ``view.shipped``.

    Raises:
        CheckpointFormatError: naming the file and problem (missing shard file, truncated header, a tensor
            listed twice, unsafe pickle, mixed formats, data files visible to no rank, ...). Nothing is written.
    """
    p = Path(path)
    formats = load_formats()
    if view is not None and view.shipped is not None and view.format in formats:
        if INCOMPLETE_MARKER in view.visible.get(rank, set()):
            detect_format(p)  # raises the incomplete-checkpoint error
        cls = formats[view.format]
        partial = True
        reader = cls.open(p, shipped=view.shipped, partial=True)
    else:
        cls = formats[detect_format(p)]
        partial = view is not None and bool(cls.metadata_files) and p.is_dir()
        reader = cls.open(p, partial=partial)
    if partial:
        seen_sets = [view.visible[rank]] if view.same and rank in view.visible else list(view.visible.values())
        unseen = [f for f in reader.metadata.files if not any(f in v for v in seen_sets)]
        if unseen:
            reader.close()
            raise CheckpointFormatError(f"{p}: checkpoint files are not complete: {', '.join(unseen[:5])}"
                                        f"{' ...' if len(unseen) > 5 else ''} visible to no rank")
    return reader


def read_metadata(path: str | os.PathLike, *, view: View | None = None, rank: int = 0) -> CheckpointMetadata:
    """Detect the format at ``path`` and return its validated :class:`CheckpointMetadata` (through this rank's
    ``view`` of a checkpoint spread over node-local disks when given: see :func:`open_checkpoint`)."""
    with open_checkpoint(path, view=view, rank=rank) as r:
        return r.metadata


# ---------------------------------------------------------------- the commit protocol of every writer

def staging_path(final: Path) -> Path:
    """A fresh hidden temporary sibling of ``final`` (``.NAME.tmp-XXXXXXXXXXXX``)."""
    return final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:12]}"


@contextlib.contextmanager
def staged_directory(final: str | os.PathLike, *, incomplete_marker: bool = False,
                     tmp: Path | None = None) -> Iterator[Path]:
    """Create the temporary directory ``tmp`` (default: :func:`staging_path`) for a write to ``final`` (its parent
    is created if needed); yield it; remove it if the block raises. ``incomplete_marker`` puts the marker file in
    first, so a directory left by a crash never loads. Publish with :func:`publish_directory` inside the block."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp or staging_path(final)
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        if incomplete_marker:
            (tmp / INCOMPLETE_MARKER).touch()
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def fsync_dir(path: str | Path) -> None:
    """fsync a directory so that entries created or renamed in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


FORMAT_ALIASES = {"hf": "huggingface"}  # writer-side names of formats (``convert --to hf``)


def check_destination(final: str | os.PathLike, fmt: str, sources: Iterable[str | os.PathLike] = ()) -> None:
    """The destination rule of every writer (save, convert, HF export): refuse ``final`` when it is, contains or
    is inside one of ``sources`` (the checkpoints being read), or when it exists and is neither an empty
    directory nor a checkpoint of format ``fmt`` (``"oarlock"``, ``"huggingface"``/``"hf"``; recognised by the
    format's own metadata file, see :func:`detect_format`). Nothing is written or removed.

    Raises:
        CheckpointError: naming the destination and the reason.
    """
    from oarlock.checkpoint.errors import CheckpointError

    final = Path(final)
    fmt = FORMAT_ALIASES.get(fmt, fmt)
    dst = os.path.realpath(final)
    for src in sources:
        s = os.path.realpath(src)
        if dst == s:
            raise CheckpointError(f"{final}: the destination is the source checkpoint {src}; write to another path")
        if s.startswith(dst.rstrip(os.sep) + os.sep):
            raise CheckpointError(f"{final}: the destination contains the source checkpoint {src}; replacing it "
                                  "would delete the source")
        if dst.startswith(s.rstrip(os.sep) + os.sep):
            raise CheckpointError(f"{final}: the destination is inside the source checkpoint {src}; write "
                                  "outside it")
    recover_publish(final)
    if not os.path.lexists(final):
        return
    if not final.is_dir() or final.is_symlink():
        raise CheckpointError(f"{final}: exists and is not a directory; refusing to replace it")
    names = set(os.listdir(final))
    if not names:
        return
    cls = load_formats().get(fmt)
    if cls is None or cls.claim(final, names) < 2 or INCOMPLETE_MARKER in names:
        raise CheckpointError(f"{final}: exists and is not {'an' if fmt[0] in 'aeiou' else 'a'} {fmt} checkpoint; "
                              f"refusing to replace it (it holds {len(names)} entr{'y' if len(names) == 1 else 'ies'}"
                              f", e.g. {sorted(names)[0]!r})")


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap directories ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system or filesystem does not offer it (the caller then renames in two steps)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    import errno

    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _intent_path(final: Path) -> Path:
    return final.parent / f".{final.name}.publish"


def recover_publish(final: str | os.PathLike) -> None:
    """Finish or undo a replacement of ``final`` that a writer started and did not finish (it died): afterwards
    ``final`` is the old or the new complete checkpoint and no hidden leftover of that replacement remains.
    Waits while a live writer holds the replacement (a lock on its intent file). Called by every open and every
    writer; a no-op when there is nothing to recover or the directory is not writable."""
    import fcntl
    import json

    final = Path(final)
    intent = _intent_path(final)
    if not os.path.lexists(intent):
        return
    try:
        fd = os.open(intent, os.O_RDWR)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a live writer holds it until its replacement is complete
        try:
            if os.fstat(fd).st_ino != os.stat(intent).st_ino:
                return  # the writer finished and a new replacement began meanwhile
            rec = json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
            new, old = final.parent / rec["new"], final.parent / rec["old"]
        except (OSError, ValueError, KeyError, TypeError):
            rec = None
        if rec is not None:
            if not os.path.lexists(final):  # died between "old aside" and "new in": finish the replacement
                os.replace(new if new.is_dir() else old, final)
            # whatever of the two names remains is a leftover: the old checkpoint once the new one is in
            # place, or the unpublished new one when the writer died before the swap
            for leftover in (new, old):
                shutil.rmtree(leftover, ignore_errors=True)
        os.unlink(intent)
        fsync_dir(final.parent)
    except OSError:
        pass
    finally:
        os.close(fd)


def publish_directory(tmp: Path, final: Path, metadata: CheckpointMetadata | None = None, *,
                      fsync_files: bool = True) -> None:
    """The commit step of every writer (save, convert, HF export): make the fully written directory ``tmp``
    appear as ``final``. With ``fsync_files`` the files in ``tmp`` are fsynced first (a save passes False: each
    rank fsynced its own data file, and rank 0 need not touch the others').

    With ``metadata``, first write ``metadata.json`` (via a ``.part`` file, fsync, rename) and remove the
    incomplete-marker. An existing ``final`` is replaced only now that the new directory is complete, and only
    when it is a checkpoint of the same format as ``tmp`` or an empty directory (:func:`check_destination`).
    The replacement is recorded first in an intent file ``.NAME.publish`` next to ``final`` (locked while this
    process works on it); then the two directories are swapped in one atomic exchange where the filesystem
    offers it (else the old one is renamed to ``.NAME.old-XXXXXXXXXXXX`` and the new one renamed in), the old
    one removed, and the intent file deleted. If the writer dies part way, the next open or write of ``final``
    (:func:`recover_publish`) completes or undoes the replacement, so ``final`` is always the old or the new
    complete checkpoint, never a partial one (``docs/checkpoint-format.md``, commit protocol).

    Raises:
        CheckpointError: ``final`` exists and is not a checkpoint of the format written (nothing is replaced).
    """
    import fcntl
    import json

    for f in tmp.iterdir() if fsync_files else ():
        if f.is_file():
            with open(f, "rb") as fh:  # files written without fsync (side files, an index)
                os.fsync(fh.fileno())
    if metadata is not None:
        part = tmp / (METADATA_FILE + ".part")
        try:
            with open(part, "w") as f:
                f.write(metadata.dumps())
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            from oarlock.checkpoint.errors import CheckpointError

            raise CheckpointError(f"{final / METADATA_FILE}: cannot write: {e.strerror or e} (nothing was "
                                  "published)") from None
        os.replace(part, tmp / METADATA_FILE)
        marker = tmp / INCOMPLETE_MARKER
        if marker.exists():
            os.unlink(marker)
    fsync_dir(tmp)
    recover_publish(final)
    if not os.path.lexists(final):
        os.replace(tmp, final)
        fsync_dir(final.parent)
        return
    try:
        fmt = detect_format(tmp)
    except CheckpointFormatError:
        fmt = "empty"
    check_destination(final, fmt)
    old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:12]}"
    intent = _intent_path(final)
    fd = os.open(intent, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps({"new": tmp.name, "old": old.name}).encode())
        os.fsync(fd)
        fsync_dir(final.parent)
        if _exchange(tmp, final):
            fsync_dir(final.parent)
            shutil.rmtree(tmp, ignore_errors=True)  # now the old checkpoint
        else:
            os.replace(final, old)
            os.replace(tmp, final)
            fsync_dir(final.parent)
            shutil.rmtree(old, ignore_errors=True)
        os.unlink(intent)
    finally:
        os.close(fd)
    fsync_dir(final.parent)
