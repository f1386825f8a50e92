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
and :func:`publish_directory` makes it appear under its final name in one rename. :func:`check_destination` is
the destination rule: nothing oarlock did not write (:func:`written_entries`, :data:`WRITTEN_MANIFEST`) is ever
deleted; :func:`remove_stale_staging` removes the temporary directories of crashed writes, never a live one's
(:func:`hold_staging`).

Every path here may also be ``s3://bucket/prefix`` (:func:`oarlock.checkpoint.objectstore.location`; other URL
schemes are refused). Object stores have no rename: their commit protocol (:func:`prepare_object_destination`,
:func:`publish_objects`, :func:`upload_directory`, ``docs/checkpoint-format.md`` "Object stores") writes the
data objects under the final prefix and ``metadata.json`` last as the commit record.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from oarlock.checkpoint.dist import DistWrapper, fingerprint_words
from oarlock.checkpoint.errors import CheckpointError, CheckpointFormatError
from oarlock.checkpoint.formats import load_formats
from oarlock.checkpoint.formats.huggingface import HF_INDEX, HF_SINGLE, PADDLE_HF_CACHE
from oarlock.checkpoint.metadata import METADATA_FILE, CheckpointMetadata
from oarlock.checkpoint.objectstore import ObjectPath, is_object_path, location
from oarlock.checkpoint.reader import CheckpointReader, checkpoint_file
from oarlock.checkpoint.safetensors_io import (SafetensorsFile, contiguous_run, np_prod, safetensors_header,
                                               write_safetensors)

__all__ = ["CheckpointReader", "SafetensorsFile", "View", "contiguous_run", "detect_format", "fsync_dir",
           "gather_view", "np_prod", "open_checkpoint", "publish_directory", "check_destination", "recover_publish", "read_metadata", "safetensors_header",
           "staged_directory", "staging_path", "hold_staging", "release_staging", "remove_stale_staging",
           "written_entries", "WRITTEN_MANIFEST", "write_safetensors", "HF_INDEX", "HF_SINGLE", "INCOMPLETE_MARKER",
           "PADDLE_HF_CACHE", "check_object_destination", "object_entries", "prepare_object_destination",
           "publish_objects", "remove_uncommitted_objects", "upload_directory"]

INCOMPLETE_MARKER = ".oarlock-incomplete"  # present in a save's temporary directory until it is committed


# ---------------------------------------------------------------- detection and opening

def detect_format(path: str | os.PathLike) -> str:
    """Name the checkpoint format at ``path`` (see module docstring).

    Raises:
        CheckpointFormatError: path missing, or a directory that holds no checkpoint, an unfinished save, or
            mixes formats.
    """
    p = location(path)
    if is_object_path(p):
        return _detect_object_format(p)
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
    # one object store for every rank: every object its commit record names is visible to all (visible is empty:
    # nothing was listed)
    store: bool = False


def gather_view(path: str | os.PathLike, dist: DistWrapper) -> View:
    """Collective: each rank's listing of ``path`` and detected format (on a shared filesystem one fixed-size
    agreement that they are equal; on node-local disks an all-gather of the listings); ship the format's metadata
    files to ranks lacking them. Never raises (problems surface when the checkpoint is opened, on every rank
    alike)."""
    p = location(path)
    try:
        fmt: str | None = detect_format(p)
    except (CheckpointError, OSError):  # also a store refusing this rank alone (its credentials): the open
        fmt = None                      # below fails inside the agreed step, so every rank hears of it
    # every rank reads the same store: no listing (O(objects) requests per rank at scale), only one fixed-size
    # agreement on the format found (a commit landing between ranks' looks would split them)
    if is_object_path(p) and None not in dist.agree(fingerprint_words(f"\2{fmt}")):
        return View({}, fmt, same=True, store=True)
    try:
        if is_object_path(p):
            names = sorted(p.storage.list(p.key))
        else:
            names = sorted(os.listdir(p)) if p.is_dir() else ([p.name] if p.exists() else [])
    except (OSError, CheckpointError):
        names = []
    # a shared filesystem gives every rank the same listing: exchange a fingerprint of it first (fixed size per
    # rank), and the listings themselves only when they differ (node-local disks)
    # (one all-reduce of four ints whatever the world size: see DistWrapper.agree)
    digest = "\0".join(names) + f"\1{fmt}"
    if None not in dist.agree(fingerprint_words(digest)):
        shared = set(names)
        return _view({r: shared for r in range(dist.size)}, [(None, fmt)] * dist.size, p, dist, same=True)
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
    p = location(path)
    formats = load_formats()
    if view is not None and view.shipped is not None and view.format in formats:
        if INCOMPLETE_MARKER in view.visible.get(rank, set()):
            detect_format(p)  # raises the incomplete-checkpoint error
        cls = formats[view.format]
        partial = True
        reader = cls.open(p, shipped=view.shipped, partial=True)
    elif view is not None and view.store and view.format in formats:
        # a store: the data objects are those the commit record names (written before it); one missing fails its
        # read, naming the key. Checking each here would cost a request per object on every rank.
        reader = formats[view.format].open(p, partial=True)
        partial = False
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
    from oarlock.checkpoint.metadata import mark_training_layout

    mark_training_layout(reader.metadata)  # torch's {"model", "optim"} / torchtitan's entries: what is not weights
    return reader


def read_metadata(path: str | os.PathLike, *, view: View | None = None, rank: int = 0) -> CheckpointMetadata:
    """Detect the format at ``path`` and return its validated :class:`CheckpointMetadata` (through this rank's
    ``view`` of a checkpoint spread over node-local disks when given: see :func:`open_checkpoint`)."""
    with open_checkpoint(path, view=view, rank=rank) as r:
        return r.metadata


# ---------------------------------------------------------------- the commit protocol of every writer

def staging_path(final: Path, token: str | None = None) -> Path:
    """A fresh hidden temporary sibling of ``final`` (``.NAME.tmp-XXXXXXXXXXXX``; the X from ``token``, a random
    hex string the ranks of a save agreed on, else fresh); in an object store, ``final`` itself (no rename there:
    see :func:`prepare_object_destination`)."""
    if is_object_path(final):
        return final
    return final.parent / f".{final.name}.tmp-{(token or uuid.uuid4().hex)[:12]}"


def hold_staging(tmp: Path) -> int:
    """Create the temporary directory ``tmp`` of a write (``exist_ok``: every rank of a save calls this) and hold
    a shared ``flock`` on it while the write is alive: :func:`remove_stale_staging` never removes a locked
    directory. Returns the descriptor holding the lock; close it (:func:`release_staging`) once the directory is
    published or removed. A directory removed between its creation and the lock (a stale-directory cleanup that
    ran at that moment) is created again.

    Raises:
        CheckpointError: ``tmp`` cannot be created or keeps disappearing (naming it).
    """
    import fcntl

    from oarlock.checkpoint.errors import CheckpointError

    for _ in range(100):
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise CheckpointError(f"{tmp}: cannot create the temporary directory: {e.strerror or e}") from None
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if os.fstat(fd).st_ino == os.lstat(tmp).st_ino:
                return fd
        except OSError:
            pass
        os.close(fd)
    raise CheckpointError(f"{tmp}: the temporary directory was removed repeatedly while being created")


def release_staging(fd: int | None) -> None:
    """Drop the lock :func:`hold_staging` took (None: nothing held)."""
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def remove_stale_staging(final: str | os.PathLike) -> list[str]:
    """Remove the temporary directories (``.NAME.tmp-*``, see :func:`staging_path`) that writes to ``final`` left
    behind when their process died, so a later plain save cleans up after a crashed one. A directory whose writer
    is alive holds a lock (:func:`hold_staging`) and is never touched; an interrupted replacement of ``final`` is
    completed first (:func:`recover_publish`). Returns the removed names; never raises (an entry that cannot be
    inspected or removed is left)."""
    import fcntl

    final = Path(final)
    recover_publish(final)
    prefix = f".{final.name}.tmp-"
    removed: list[str] = []
    try:
        entries = [n for n in os.listdir(final.parent) if n.startswith(prefix)]
    except OSError:
        return removed
    for name in sorted(entries):
        d = final.parent / name
        try:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue  # not a directory (or already gone): not ours to remove
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live writer holds it
            if os.fstat(fd).st_ino != os.lstat(d).st_ino:
                continue
            shutil.rmtree(d, ignore_errors=True)
            if not os.path.lexists(d):
                removed.append(name)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def staged_directory(final: str | os.PathLike, *, incomplete_marker: bool = True,
                     tmp: Path | None = None) -> Iterator[Path]:
    """Create the temporary directory ``tmp`` (default: :func:`staging_path`) for a write to ``final`` (its parent
    is created if needed), locked for the block (:func:`hold_staging`) so no cleanup removes it; yield it; remove
    it if the block raises. Leftovers of crashed writes to ``final`` are removed first
    (:func:`remove_stale_staging`). ``incomplete_marker`` puts the marker file in first, so a directory left by a
    crash never loads (:func:`publish_directory` removes it). Publish with :func:`publish_directory` inside the
    block."""
    final = location(final)
    if is_object_path(final):  # written locally, uploaded by publish_directory (stores have no rename)
        import tempfile

        tmp = Path(tempfile.mkdtemp(prefix=".oarlock-upload-"))
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(final)
    tmp = tmp or staging_path(final)
    fd = hold_staging(tmp)
    try:
        if incomplete_marker:
            (tmp / INCOMPLETE_MARKER).touch()
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        release_staging(fd)


def fsync_dir(path: str | Path) -> None:
    """fsync a directory so that entries created or renamed in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


FORMAT_ALIASES = {"hf": "huggingface"}  # writer-side names of formats (``convert --to hf``)

#: The list of entries a writer put into a directory it published (JSON ``{"written_by": "oarlock", "files":
#: [...]}``), written by :func:`publish_directory`. It tells the files oarlock wrote from the ones a user added
#: later: only the former are ever replaced or removed.
WRITTEN_MANIFEST = ".oarlock-files"

# Checkpoint files of a format by name: what counts as written by oarlock in a directory published before the
# manifest existed (or whose manifest is unreadable).
_FORMAT_FILES = {
    "oarlock": re.compile(r"metadata\.json|rank-\d{5}\.safetensors"),
    "huggingface": re.compile(r"model\.safetensors|model\.safetensors\.index\.json|model-\d{5}-of-\d{5}\.safetensors"),
    "dcp": re.compile(r"\.metadata|__\d+\.metadata|__\d+_\d+\.distcp"),
}


def _read_manifest(directory: Path) -> set[str] | None:
    """The entry names :data:`WRITTEN_MANIFEST` in ``directory`` lists; None when it is absent or unreadable."""
    import json

    p = directory / WRITTEN_MANIFEST
    try:
        if p.is_symlink() or not p.is_file() or p.stat().st_size > 1 << 24:
            return None
        data = json.loads(p.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, list):
        return None
    return {f for f in files if isinstance(f, str) and f and "/" not in f and f not in (".", "..")}


def written_entries(directory: str | os.PathLike, names: Iterable[str] | None = None) -> set[str]:
    """The entries of ``directory`` (or of its listing ``names``) that oarlock wrote: those its
    :data:`WRITTEN_MANIFEST` lists (and the manifest itself), or, in a directory without one (written by an older
    oarlock), the checkpoint files of the oarlock, HuggingFace and DCP formats by name (``metadata.json``,
    ``rank-XXXXX.safetensors``, ``model*.safetensors``, the index, ``.metadata``, ``__R_0.distcp``). The
    incomplete-marker and a half-written ``metadata.json.part`` always count as oarlock's."""
    d = Path(directory)
    names = set(os.listdir(d)) if names is None else set(names)
    listed = _read_manifest(d)
    own = {INCOMPLETE_MARKER, WRITTEN_MANIFEST, METADATA_FILE + ".part"}
    if listed is not None:
        return names & (listed | own)
    return {n for n in names if n in own or any(p.fullmatch(n) for p in _FORMAT_FILES.values())}


def _describe(names: Iterable[str], limit: int = 8) -> str:
    shown = sorted(names)
    text = ", ".join(repr(n) for n in shown[:limit])
    return text + (f" and {len(shown) - limit} more" if len(shown) > limit else "")


def check_destination(final: str | os.PathLike, fmt: str, sources: Iterable[str | os.PathLike] = (), *,
                      overwrite: bool = False) -> set[str]:
    """The destination rule of every writer (save, convert, HF export, the manager; ``docs/checkpoint-format.md``,
    destination rule). ``final`` is refused when it is, contains or is inside one of ``sources`` (the checkpoints
    being read), when it exists and is not a directory, and when it holds anything oarlock did not write
    (:func:`written_entries`) or is not a checkpoint of format ``fmt`` (``"oarlock"``, ``"huggingface"``/``"hf"``,
    ``"dcp"``), unless ``overwrite``. A missing path, an empty directory and a checkpoint of format ``fmt``
    holding only files oarlock wrote are accepted. With ``overwrite`` the entries oarlock did not write are kept
    (:func:`publish_directory` moves them into the new directory) and only oarlock's are replaced; a foreign
    checkpoint of another format among them is still refused (the result would mix formats). Nothing is written
    or removed here, except that an interrupted replacement of ``final`` is completed first
    (:func:`recover_publish`).

    Returns the names of the entries to keep (empty unless ``overwrite``).

    Raises:
        CheckpointDestinationError: naming the destination, the reason, and the entries oarlock did not write.
    """
    from oarlock.checkpoint.errors import CheckpointDestinationError

    final = location(final)
    if is_object_path(final):
        check_object_destination(final, (), sources, overwrite=overwrite)
        return set()
    sources = [s for s in sources if not is_object_path(location(s))]
    fmt = FORMAT_ALIASES.get(fmt, fmt)
    dst = os.path.realpath(final)
    for src in sources:
        s = os.path.realpath(src)
        if dst == s:
            raise CheckpointDestinationError(f"{final}: the destination is the source checkpoint {src}; write to "
                                             "another path")
        if s.startswith(dst.rstrip(os.sep) + os.sep):
            raise CheckpointDestinationError(f"{final}: the destination contains the source checkpoint {src}; "
                                             "replacing it would delete the source")
        if dst.startswith(s.rstrip(os.sep) + os.sep):
            raise CheckpointDestinationError(f"{final}: the destination is inside the source checkpoint {src}; "
                                             "write outside it")
    recover_publish(final)
    if not os.path.lexists(final):
        return set()
    if not final.is_dir() or final.is_symlink():
        raise CheckpointDestinationError(f"{final}: exists and is not a directory; refusing to replace it")
    names = set(os.listdir(final))
    if not names:
        return set()
    formats = load_formats()
    cls = formats.get(fmt)
    foreign = names - written_entries(final, names)
    same = cls is not None and INCOMPLETE_MARKER not in names and cls.claim(final, names) >= 2
    if same and not foreign:
        return set()
    hint = ("; pass --overwrite (overwrite=True) to write the checkpoint there anyway: only files oarlock wrote "
            "are replaced, the others stay")
    if not overwrite:
        if not same:
            what = (f"entries oarlock did not write: {_describe(foreign)}" if foreign
                    else f"{len(names)} entr{'y' if len(names) == 1 else 'ies'} oarlock wrote: {_describe(names)}")
            raise CheckpointDestinationError(
                f"{final}: exists and is not {'an' if fmt[0] in 'aeiou' else 'a'} {fmt} checkpoint; refusing to "
                f"replace it (it holds {what}){hint}")
        raise CheckpointDestinationError(f"{final}: holds entries oarlock did not write: {_describe(foreign)}; "
                                         f"refusing to replace the {fmt} checkpoint there{hint}")
    for name, other in formats.items():
        if foreign and other.claim(final, foreign) >= 2:
            raise CheckpointDestinationError(
                f"{final}: holds a {name} checkpoint oarlock did not write ({_describe(foreign)}); writing next to "
                "it would mix formats: remove it or choose another destination")
    return foreign


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

    final = location(final)
    if is_object_path(final):
        return  # nothing is renamed in an object store
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
            # entries oarlock did not write (kept by an overwrite) go back into the checkpoint first, wherever
            # the writer had got to moving them
            keep = [k for k in rec.get("keep", []) if isinstance(k, str) and k and "/" not in k]
            for leftover in (new, old):
                for k in keep:
                    if os.path.lexists(leftover / k) and not os.path.lexists(final / k):
                        os.rename(leftover / k, final / k)
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


def _write_manifest(tmp: Path) -> None:
    """Record in ``tmp`` every entry it holds (:data:`WRITTEN_MANIFEST`): the files this writer wrote."""
    import json

    names = sorted(set(os.listdir(tmp)) - {INCOMPLETE_MARKER} | {WRITTEN_MANIFEST})
    with open(tmp / WRITTEN_MANIFEST, "w") as f:
        f.write(json.dumps({"written_by": "oarlock", "files": names}, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())


def publish_directory(tmp: Path, final: Path, metadata: CheckpointMetadata | None = None, *,
                      fsync_files: bool = True, overwrite: bool = False) -> None:
    """The commit step of every writer (save, convert, HF export): make the fully written directory ``tmp``
    appear as ``final``. With ``fsync_files`` the files in ``tmp`` are fsynced first (a save passes False: each
    rank fsynced its own data file, and rank 0 need not touch the others').

    With ``metadata``, first write ``metadata.json`` (via a ``.part`` file, fsync, rename). Then the list of the
    entries written (:data:`WRITTEN_MANIFEST`) is added and the incomplete-marker removed. An existing ``final`` is
    replaced only now that the new directory is complete, and only as :func:`check_destination` allows: a
    checkpoint of the same format holding only files oarlock wrote, or an empty directory; with ``overwrite``
    also anything else, and then the entries oarlock did not write are moved into the new directory (never
    removed). The replacement is recorded first in an intent file ``.NAME.publish`` next to ``final`` (locked
    while this process works on it, listing the kept entries); then the two directories are swapped in one
    atomic exchange where the filesystem offers it (else the old one is renamed to ``.NAME.old-XXXXXXXXXXXX`` and
    the new one renamed in), the old one removed, and the intent file deleted. If the writer dies part way, the
    next open or write of ``final`` (:func:`recover_publish`) completes or undoes the replacement and puts kept
    entries back, so ``final`` is always the old or the new complete checkpoint, never a partial one
    (``docs/checkpoint-format.md``, commit protocol).

    Raises:
        CheckpointDestinationError: ``final`` is refused by :func:`check_destination`, or (``overwrite``) holds an
            entry oarlock did not write under a name the new checkpoint uses (nothing is replaced).
        CheckpointError: ``metadata.json`` cannot be written.
    """
    import fcntl
    import json

    from oarlock.checkpoint.errors import CheckpointDestinationError

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
    if is_object_path(final):
        upload_directory(tmp, final, overwrite=overwrite)
        return
    _write_manifest(tmp)
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
    keep = sorted(check_destination(final, fmt, overwrite=overwrite))
    clash = set(keep) & set(os.listdir(tmp))
    if clash:
        raise CheckpointDestinationError(f"{final}: holds {_describe(clash)}, which oarlock did not write, under "
                                         "a name the new checkpoint writes; refusing to replace it (move it "
                                         "away or choose another destination)")
    old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:12]}"
    intent = _intent_path(final)
    fd = os.open(intent, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps({"new": tmp.name, "old": old.name, "keep": keep}).encode())
        os.fsync(fd)
        fsync_dir(final.parent)
        swapped = False
        try:
            for name in keep:  # entries oarlock did not write move into the new checkpoint, never removed
                os.rename(final / name, tmp / name)
            if keep:
                fsync_dir(tmp)
                fsync_dir(final)
            if _exchange(tmp, final):
                swapped = True
                fsync_dir(final.parent)
                shutil.rmtree(tmp, ignore_errors=True)  # now the old checkpoint
            else:
                os.replace(final, old)
                os.replace(tmp, final)
                swapped = True
                fsync_dir(final.parent)
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            if not swapped:  # undo: the old checkpoint and the kept entries back under ``final``
                if not os.path.lexists(final) and old.is_dir():
                    os.replace(old, final)
                for name in keep:
                    if os.path.lexists(tmp / name) and not os.path.lexists(final / name):
                        os.rename(tmp / name, final / name)
                fsync_dir(final.parent)
            os.unlink(intent)
            raise
        os.unlink(intent)
    finally:
        os.close(fd)
    fsync_dir(final.parent)


# ---------------------------------------------------------------- a CheckpointManager root given as a checkpoint

_STEP_DIR = re.compile(r"(.*?)(\d+)")


def is_committed(p: Any) -> bool:
    """Whether ``p`` (a local path or an :class:`~oarlock.checkpoint.objectstore.ObjectPath`) is a committed
    oarlock checkpoint: in an object store, its commit record ``metadata.json`` exists; on a filesystem, it is a
    directory (not a symbolic link) holding ``metadata.json`` and no incomplete-save marker. The one test the
    manager's step listing and the commands' manager-root resolution share."""
    if is_object_path(p):  # the commit record alone decides in an object store
        return (p / METADATA_FILE).is_file()
    p = Path(p)
    return p.is_dir() and not p.is_symlink() and (p / METADATA_FILE).is_file() and not (p / INCOMPLETE_MARKER).exists()


def resolve_manager_root(path: str | os.PathLike) -> tuple[Path, str | None]:
    """``(checkpoint path, step directory name)`` for a path the commands read: a directory that is no checkpoint
    itself but a :class:`~oarlock.checkpoint.manager.CheckpointManager` root resolves to its latest committed step
    (the one its ``latest`` pointer names when that is a committed checkpoint, else the committed step directory
    with the highest number); any other path is returned as it is, with None. Never raises (opening the returned
    path reports what is wrong)."""
    p = location(path)
    try:
        detect_format(p)
        return p, None
    except CheckpointError:
        pass
    if is_object_path(p):
        try:
            names = p.storage.list(p.key)
            pointer = (p / "latest").read_text().strip() if "latest" in names else ""
            steps = sorted((int(m.group(2)), n) for n, size in names.items() if size < 0
                           and (m := _STEP_DIR.fullmatch(n)) and is_committed(p / n))
        except CheckpointError:
            return p, None
        if pointer and "/" not in pointer and any(n == pointer for _, n in steps):
            return p / pointer, pointer
        return (p / steps[-1][1], steps[-1][1]) if steps else (p, None)
    if not p.is_dir():
        return p, None

    try:
        pointer = (p / "latest").read_text().strip() if (p / "latest").is_file() else ""
        names = os.listdir(p)
    except OSError:
        return p, None
    if pointer and "/" not in pointer and _STEP_DIR.fullmatch(pointer) and is_committed(p / pointer):
        return p / pointer, pointer
    steps = [(int(m.group(2)), n) for n in names if not n.startswith(".") and (m := _STEP_DIR.fullmatch(n))
             and is_committed(p / n)]
    if not steps:
        return p, None
    name = max(steps)[1]
    return p / name, name


# ---------------------------------------------------------------- the commit protocol in object stores

def _detect_object_format(p: ObjectPath) -> str:
    """:func:`detect_format` of a prefix in an object store: ``metadata.json`` is the commit record (a prefix
    without it holds no checkpoint, whatever else is there). Object stores hold oarlock checkpoints only."""
    # one HEAD of the commit record (read once, by the reader: another tool's metadata.json fails its parse
    # there); a listing, which costs a request per 1,000 objects, only to say what a prefix without it holds
    if p.storage.exists(f"{p.key}/{METADATA_FILE}" if p.key else METADATA_FILE):
        return "oarlock"
    names = p.storage.list(p.key)
    if METADATA_FILE in names:
        return "oarlock"
    if INCOMPLETE_MARKER in names or any(_DATA_OBJECT.fullmatch(n) for n in names):
        raise CheckpointFormatError(f"{p}: incomplete checkpoint (a save to this prefix did not finish: no "
                                    f"{METADATA_FILE} commit record; it holds no usable data)")
    shown = sorted(names)[:12]
    raise CheckpointFormatError(f"{p}: no oarlock checkpoint found (looked for {METADATA_FILE}; found "
                                f"{', '.join(shown) or 'no objects'}); object stores hold oarlock checkpoints "
                                "only: convert other formats on a local disk first")


_DATA_OBJECT = re.compile(r"rank-(\d{5,})\.safetensors(?:\.xxh3)?")  # a data object or its block digests


def _object_record(p: ObjectPath, name: str) -> dict:
    import json

    try:
        rec = json.loads((p / name).read_bytes())
    except (ValueError, CheckpointFormatError):
        return {}
    return rec if isinstance(rec, dict) else {}


def object_entries(p: ObjectPath, names: Iterable[str]) -> set[str]:
    """The objects directly under prefix ``p`` (of its listing ``names``) that this protocol wrote: the commit
    record, the manifest and the marker, the files a committed save's manifest lists, and the data objects
    ``rank-XXXXX.safetensors`` (and their digests ``rank-XXXXX.safetensors.xxh3``) of ranks below the world size
    an unfinished save's marker records."""
    names = set(names)
    own = {METADATA_FILE, WRITTEN_MANIFEST, INCOMPLETE_MARKER}
    if WRITTEN_MANIFEST in names:
        files = _object_record(p, WRITTEN_MANIFEST).get("files")
        own |= {f for f in files if isinstance(f, str)} if isinstance(files, list) else set()
    if INCOMPLETE_MARKER in names:
        world = _object_record(p, INCOMPLETE_MARKER).get("world")
        if type(world) is int and world > 0:
            own |= {n for n in names if (m := _DATA_OBJECT.fullmatch(n)) and int(m.group(1)) < world}
    return names & own


def prepare_object_destination(final: ObjectPath, world: int, save_id: str, *, overwrite: bool = False,
                               sources: Iterable[Any] = ()) -> None:
    """The destination rule and the first step of a save into an object store (``docs/checkpoint-format.md``,
    "Object stores"), run by the coordinator before any data object is written:

    1. the prefix is refused when it is a source being read, or holds objects this protocol did not write
       (:func:`object_entries`: another tool's files, a sub-prefix) unless ``overwrite`` (they are kept, and a
       kept object under a name this save writes is still refused);
    2. the marker object ``.oarlock-incomplete`` (``{"save_id", "world"}``) is written;
    3. the previous commit record ``metadata.json`` is deleted (from here the old checkpoint at this prefix
       no longer loads: stores without rename cannot replace a checkpoint atomically; the manager writes each
       step to its own prefix), then every other object an earlier save wrote, a killed save's included.

    Raises:
        CheckpointDestinationError: naming the prefix and the objects oarlock did not write.
    """
    import json

    from oarlock.checkpoint.errors import CheckpointDestinationError
    from oarlock.checkpoint.grid import data_file_name

    ours = check_object_destination(final, {data_file_name(r) for r in range(world)} | {METADATA_FILE},
                                    sources, overwrite=overwrite)
    st = final.storage
    st.put_bytes(f"{final.key}/{INCOMPLETE_MARKER}", json.dumps({"save_id": save_id, "world": world}).encode())
    if METADATA_FILE in ours:
        st.delete([f"{final.key}/{METADATA_FILE}"])  # uncommit first: never old metadata over new data
    st.delete(f"{final.key}/{n}" for n in ours - {METADATA_FILE, INCOMPLETE_MARKER})


def check_object_destination(final: ObjectPath, writes: Iterable[str] = (), sources: Iterable[Any] = (), *,
                             overwrite: bool = False) -> set[str]:
    """The destination rule in an object store (see :func:`prepare_object_destination`; nothing is written):
    returns the objects under ``final`` that oarlock wrote. ``writes``: names the new checkpoint writes (a kept
    foreign object under one of them is refused even with ``overwrite``).

    Raises:
        CheckpointDestinationError: naming the prefix and the objects oarlock did not write.
    """
    from oarlock.checkpoint.errors import CheckpointDestinationError

    for src in sources:
        s = location(src)
        if is_object_path(s) and s.bucket == final.bucket and (
                s.key == final.key or s.key.startswith(final.key + "/") or final.key.startswith(s.key + "/")):
            raise CheckpointDestinationError(f"{final}: the destination overlaps the source checkpoint {s}; write "
                                             "to another prefix")
    names = final.storage.list(final.key)
    ours = object_entries(final, names)
    foreign = set(names) - ours
    hint = ("; pass --overwrite (overwrite=True) to write the checkpoint there anyway: only objects oarlock wrote "
            "are replaced, the others stay")
    if foreign and not overwrite:
        raise CheckpointDestinationError(f"{final}: holds objects oarlock did not write: {_describe(foreign)}; "
                                         f"refusing to write a checkpoint there{hint}")
    clash = foreign & set(writes)
    if clash:
        raise CheckpointDestinationError(f"{final}: holds {_describe(clash)}, which oarlock did not write, under "
                                         "a name the new checkpoint writes; refusing to replace it")
    return ours


#: The commit record of a directory uploaded by :func:`upload_directory`, by format: written last.
_COMMIT_FILES = (METADATA_FILE, HF_INDEX, ".metadata")


def upload_directory(tmp: Path, final: ObjectPath, *, overwrite: bool = False) -> None:
    """Publish a checkpoint directory written locally (``convert``, ``export_hf``, ``convert --to dcp`` into an
    object store: their writers are not sequential) under prefix ``final``: the destination rule and the marker
    as for a save (:func:`prepare_object_destination`), every file streamed up (bounded memory, multipart), the
    manifest, then the format's commit record (``metadata.json``, the HF index, DCP's ``.metadata``) last, then
    the marker deleted.

    Raises:
        CheckpointDestinationError: see :func:`check_object_destination`. ObjectStoreError: a failed request.
    """
    import json

    names = sorted(n for n in os.listdir(tmp) if n != INCOMPLETE_MARKER and (tmp / n).is_file())
    world = sum(1 for n in names if _DATA_OBJECT.fullmatch(n) and n.endswith(".safetensors"))
    ours = check_object_destination(final, names, overwrite=overwrite)
    st = final.storage
    st.put_bytes(f"{final.key}/{INCOMPLETE_MARKER}",
                 json.dumps({"save_id": uuid.uuid4().hex, "world": max(world, 1)}).encode())
    st.delete(f"{final.key}/{n}" for n in sorted(ours & set(_COMMIT_FILES)))
    st.delete(f"{final.key}/{n}" for n in ours - set(_COMMIT_FILES) - {INCOMPLETE_MARKER})
    commit = [n for n in names if n in _COMMIT_FILES]
    for n in [n for n in names if n not in _COMMIT_FILES and n != WRITTEN_MANIFEST]:
        with open(tmp / n, "rb") as f, st.open_writer(f"{final.key}/{n}") as w:
            while chunk := f.read(st.part_bytes):
                w.write(chunk)
    listed = sorted(set(names) | {WRITTEN_MANIFEST})
    st.put_bytes(f"{final.key}/{WRITTEN_MANIFEST}",
                 (json.dumps({"written_by": "oarlock", "files": listed}, indent=1) + "\n").encode())
    for n in commit:
        st.put_bytes(f"{final.key}/{n}", (tmp / n).read_bytes())
    st.delete([f"{final.key}/{INCOMPLETE_MARKER}"])


def publish_objects(final: ObjectPath, metadata: CheckpointMetadata, files: Iterable[str]) -> None:
    """The commit of a save into an object store, once every data object is complete (their uploads finished):
    the manifest ``.oarlock-files`` (the objects written), then ``metadata.json``, the commit record (from this
    request on the checkpoint loads), then the marker is deleted.

    Raises:
        ObjectStoreError: a request failed (naming the object); the checkpoint is then not committed.
    """
    import json

    st = final.storage
    listed = sorted(set(files) | {METADATA_FILE, WRITTEN_MANIFEST})
    st.put_bytes(f"{final.key}/{WRITTEN_MANIFEST}",
                 (json.dumps({"written_by": "oarlock", "files": listed}, indent=1) + "\n").encode())
    st.put_bytes(f"{final.key}/{METADATA_FILE}", metadata.dumps().encode())
    st.delete([f"{final.key}/{INCOMPLETE_MARKER}"])


def remove_uncommitted_objects(final: ObjectPath) -> None:
    """Delete what an unfinished save wrote under ``final`` (after a failed save; never raises). A committed
    checkpoint there (``metadata.json``) is left alone."""
    try:
        names = final.storage.list(final.key)
        if METADATA_FILE in names:
            return
        final.storage.delete(f"{final.key}/{n}" for n in object_entries(final, names))
    except CheckpointError:
        pass
