"""The commit protocol on a filesystem, where a directory renames atomically (``docs/checkpoint-format.md``,
commit protocol).

A write goes into a hidden temporary sibling of its destination (:func:`staging_path`), created and locked by
:func:`staged_directory` / :func:`hold_staging` with an incomplete-marker in it first, and appears under its final
name in one rename (:func:`publish_directory`): an atomic exchange with an existing checkpoint where the
filesystem offers it, recorded in an intent file so that :func:`recover_publish` completes or undoes a replacement
its writer did not finish. :func:`check_destination` is the destination rule: nothing oarlock did not write
(:func:`written_entries`, the manifest) is ever deleted; :func:`remove_stale_staging` removes the temporary
directories of crashed writes, never a live one's.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from oarlock.checkpoint.errors import CheckpointError, CheckpointFormatError
from oarlock.checkpoint.model.metadata import METADATA_FILE, CheckpointMetadata
from oarlock.checkpoint.storage.commit.markers import FORMAT_ALIASES, INCOMPLETE_MARKER, WRITTEN_MANIFEST, describe
from oarlock.checkpoint.storage.location import location

__all__ = ["check_destination", "detect", "fsync_dir", "hold_staging", "is_committed", "publish_directory",
           "recover_publish", "release_staging", "remove_stale_staging", "staged_directory", "staging_path",
           "written_entries"]


def detect(path: str | os.PathLike) -> str:
    """Name the checkpoint format at ``path`` (see module docstring).

    Raises:
        CheckpointFormatError: path missing, or a directory that holds no checkpoint, an unfinished save, or
            mixes formats.
    """
    p = Path(path)
    recover_publish(p)  # a replacement of this checkpoint interrupted by a crash is completed first
    if not p.exists():
        raise CheckpointFormatError(f"{p}: no such file or directory")
    from oarlock.checkpoint.formats import load_formats

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




def staging_path(final: Path, token: str | None = None) -> Path:
    """A fresh hidden temporary sibling of ``final`` (``.NAME.tmp-XXXXXXXXXXXX``; the X from ``token``, a random
    hex string the ranks of a save agreed on, else fresh)."""
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
    final = Path(final)
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

    final = Path(final)
    sources = [s for s in sources if isinstance(location(s), Path)]  # a store is never inside a directory
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
    from oarlock.checkpoint.formats import load_formats

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
            what = (f"entries oarlock did not write: {describe(foreign)}" if foreign
                    else f"{len(names)} entr{'y' if len(names) == 1 else 'ies'} oarlock wrote: {describe(names)}")
            raise CheckpointDestinationError(
                f"{final}: exists and is not {'an' if fmt[0] in 'aeiou' else 'a'} {fmt} checkpoint; refusing to "
                f"replace it (it holds {what}){hint}")
        raise CheckpointDestinationError(f"{final}: holds entries oarlock did not write: {describe(foreign)}; "
                                         f"refusing to replace the {fmt} checkpoint there{hint}")
    for name, other in formats.items():
        if foreign and other.claim(final, foreign) >= 2:
            raise CheckpointDestinationError(
                f"{final}: holds a {name} checkpoint oarlock did not write ({describe(foreign)}); writing next to "
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


def write_metadata_file(tmp: Path, final: Any, metadata: CheckpointMetadata) -> None:
    """Write ``metadata.json`` into the staging directory ``tmp`` durably (a ``.part`` file, fsync, rename).

    Raises:
        CheckpointError: it cannot be written (naming ``final``'s metadata file).
    """
    part = tmp / (METADATA_FILE + ".part")
    try:
        with open(part, "w") as f:
            f.write(metadata.dumps())
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise CheckpointError(f"{final / METADATA_FILE}: cannot write: {e.strerror or e} (nothing was "
                              "published)") from None
    os.replace(part, tmp / METADATA_FILE)


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
    from oarlock.checkpoint.errors import CheckpointDestinationError

    for f in tmp.iterdir() if fsync_files else ():
        if f.is_file():
            with open(f, "rb") as fh:  # files written without fsync (side files, an index)
                os.fsync(fh.fileno())
    if metadata is not None:
        write_metadata_file(tmp, final, metadata)
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
        fmt = detect(tmp)
    except CheckpointFormatError:
        fmt = "empty"
    keep = sorted(check_destination(final, fmt, overwrite=overwrite))
    clash = set(keep) & set(os.listdir(tmp))
    if clash:
        raise CheckpointDestinationError(f"{final}: holds {describe(clash)}, which oarlock did not write, under "
                                         "a name the new checkpoint writes; refusing to replace it (move it "
                                         "away or choose another destination)")
    _replace(tmp, final, keep)

def _replace(tmp: Path, final: Path, keep: list[str]) -> None:
    """Swap the complete directory ``tmp`` in for the existing ``final`` (see :func:`publish_directory`), moving
    the ``keep`` entries (not oarlock's) into the new directory first; undone on any error before the swap."""
    import fcntl
    import json

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


def is_committed(p: Any) -> bool:
    """Whether ``p`` is a committed checkpoint directory: a directory (not a symbolic link) holding
    ``metadata.json`` and no incomplete-save marker."""
    p = Path(p)
    return p.is_dir() and not p.is_symlink() and (p / METADATA_FILE).is_file() and not (p / INCOMPLETE_MARKER).exists()


def replace_file(p: Path, data: bytes, hook: Callable[[str], None] = lambda point: None) -> None:
    """Replace the small file ``p`` with ``data`` atomically and durably (a hidden ``.NAME.tmp-*`` sibling,
    fsync, rename, fsync of the directory): readers see the old or the new content. ``hook("pointer_written")``
    runs between the write and the rename (fault injection)."""
    tmp = p.parent / f".{p.name}.tmp-{uuid.uuid4().hex[:12]}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    hook("pointer_written")
    os.replace(tmp, p)
    fsync_dir(p.parent)


def delete_checkpoint(p: Path, hook: Callable[[str], None] = lambda point: None) -> None:
    """Delete the checkpoint directory ``p``: only the entries oarlock wrote (``metadata.json`` first, so a half
    deleted checkpoint never loads) when the user added others, else the whole directory, renamed out of the
    listing in one step first. ``hook("during_delete")`` runs after that rename (fault injection)."""
    names = set(os.listdir(p))
    own = written_entries(p, names)
    if names - own:  # the user's entries stay: remove only what oarlock wrote, metadata.json first
        for name in sorted(own, key=lambda n: n != METADATA_FILE):
            q = p / name
            if q.is_dir() and not q.is_symlink():
                shutil.rmtree(q, ignore_errors=True)
            else:
                q.unlink(missing_ok=True)
        fsync_dir(p)
        return
    trash = p.parent / f".{p.name}.deleting-{uuid.uuid4().hex[:12]}"
    os.replace(p, trash)  # gone from the listing in one step; the data is removed after
    hook("during_delete")
    shutil.rmtree(trash, ignore_errors=True)


def clean_stale(root: Path, step: "re.Pattern[str]", leftover: "re.Pattern[str]") -> list[str]:
    """Remove what killed writes left under ``root``, a directory of step checkpoints named by ``step``:
    interrupted replacements of a step are completed first (``.STEP.publish``), the temporary directories of dead
    saves removed (``.STEP.tmp-*``; a live save's is locked and skipped), then every hidden entry ``leftover``
    names. Returns the removed names."""
    removed: list[str] = []
    if not root.is_dir():
        return removed
    for p in list(root.iterdir()):
        m = re.fullmatch(r"\.(.+)\.publish", p.name)
        if m and step.fullmatch(m.group(1)):
            recover_publish(root / m.group(1))
    for p in list(root.iterdir()):
        m = re.fullmatch(r"\.(.+?)\.tmp-.+", p.name)
        if m and step.fullmatch(m.group(1)):
            removed += remove_stale_staging(root / m.group(1))
    for p in root.iterdir():
        m = re.fullmatch(r"\.(.+?)\.tmp-.+", p.name)
        if m and step.fullmatch(m.group(1)):
            continue  # left by remove_stale_staging: a live save's
        if leftover.fullmatch(p.name):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p.name)
    return sorted(removed)
