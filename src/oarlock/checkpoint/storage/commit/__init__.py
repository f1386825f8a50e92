"""The commit protocol of every writer (save, convert, HF and DCP export, the manager), one implementation per
kind of store (``docs/checkpoint-format.md``, commit protocol and "Object stores"):

* :mod:`~oarlock.checkpoint.storage.commit.local`: a filesystem. A write is staged in a hidden sibling
  directory and published with one atomic rename (an exchange when replacing a checkpoint), recovered after a
  crash from an intent file.
* :mod:`~oarlock.checkpoint.storage.commit.objects`: a store without rename (S3, the in-memory store). Data
  objects go under the final prefix after a marker object; the commit record ``metadata.json`` is written last.

Callers ask :func:`commit_for` for the protocol of a location and call its methods; nothing outside the storage
package needs to know which kind of store a checkpoint lives in. Both implementations share the destination rule
(never replace or delete what oarlock did not write) and the markers (:mod:`.markers`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable

from oarlock.checkpoint.storage.commit import local as _local
from oarlock.checkpoint.storage.commit import objects as _objects
from oarlock.checkpoint.storage.commit.markers import (FORMAT_ALIASES, INCOMPLETE_MARKER, WRITTEN_MANIFEST,
                                                       describe)
from oarlock.checkpoint.storage.location import ObjectPath, location

__all__ = ["CommitProtocol", "FORMAT_ALIASES", "INCOMPLETE_MARKER", "WRITTEN_MANIFEST", "commit_for", "describe"]


class CommitProtocol:
    """How checkpoints are staged, published, recovered and protected in one kind of store. Every method takes
    locations (``pathlib.Path`` or :class:`~oarlock.checkpoint.storage.location.ObjectPath`) of that store.

    Attributes:
        writes_in_place: a save writes its data under the final location (after :meth:`prepare_save` made it
            safe to); False: it writes into a staging directory that :meth:`publish_save` renames into place.
    """

    writes_in_place = False

    def detect(self, p: Any) -> str:
        """The format of the committed checkpoint at ``p`` (after completing an interrupted replacement).

        Raises:
            CheckpointFormatError: nothing there, an unfinished save, no checkpoint, or mixed formats.
        """
        raise NotImplementedError

    def is_committed(self, p: Any) -> bool:
        """Whether ``p`` holds a committed oarlock checkpoint (the manager's step listing asks this)."""
        raise NotImplementedError

    def recover(self, p: Any) -> None:
        """Complete or undo a replacement of ``p`` whose writer died (no-op where nothing is renamed)."""

    def check_destination(self, final: Any, fmt: str, sources: Iterable[Any] = (), *, overwrite: bool = False
                          ) -> set[str]:
        """The destination rule (nothing written): returns the entries to keep (not oarlock's).

        Raises:
            CheckpointDestinationError: naming the destination and the entries oarlock did not write.
        """
        raise NotImplementedError

    def check_save_destination(self, final: Any, sources: Iterable[Any] = (), *, overwrite: bool = False) -> None:
        """The destination rule of a save of an oarlock checkpoint to ``final`` (and, on a filesystem, the removal
        of temporary directories that crashed saves to it left; a live save's is never touched).

        Raises:
            CheckpointDestinationError: see :meth:`check_destination`.
        """
        raise NotImplementedError

    def staging_path(self, final: Any, token: str | None = None) -> Any:
        """Where a save to ``final`` writes its data files (``token``: an id the ranks agreed on)."""
        raise NotImplementedError

    def staged_directory(self, final: Any, *, incomplete_marker: bool = True, tmp: Path | None = None
                         ) -> "contextlib.AbstractContextManager[Path]":
        """A local directory for a writer that is not a save (convert, export); removed if the block raises.
        Publish it with :meth:`publish_directory` inside the block."""
        raise NotImplementedError

    def publish_directory(self, tmp: Path, final: Any, metadata: Any = None, *, fsync_files: bool = True,
                          overwrite: bool = False) -> None:
        """Make the complete directory ``tmp`` appear as ``final`` (``metadata.json`` written first when given)."""
        raise NotImplementedError

    def prepare_save(self, final: Any, world: int, save_id: str, *, overwrite: bool = False) -> None:
        """Run by the coordinator before any rank writes data for a save (the destination rule, and in a store
        without rename the marker and the removal of an earlier save's objects)."""
        raise NotImplementedError

    def begin_write(self, tmp: Any) -> int | None:
        """Run by every rank before it writes data files into ``tmp``; returns a handle for :meth:`end_write`."""
        return None

    def end_write(self, handle: int | None) -> None:
        """Release what :meth:`begin_write` held."""

    def publish_save(self, tmp: Any, final: Any, metadata: Any, files: Iterable[str], *, overwrite: bool = False
                     ) -> None:
        """The coordinator's commit of a save whose ``files`` are all durable."""
        raise NotImplementedError

    def abort_save(self, tmp: Any) -> None:
        """Remove what a failed save wrote (never a committed checkpoint; never raises)."""
        raise NotImplementedError

    # the operations of a root of step checkpoints (the manager's)

    def make_root(self, root: Any) -> None:
        """Create the directory ``root`` where the store has directories."""

    def replace_small(self, p: Any, data: bytes, hook: Callable[[str], None] = lambda point: None) -> None:
        """Replace the small object ``p`` (a pointer) whole and durably: readers see the old or the new bytes.
        ``hook("pointer_written")`` runs before the new bytes become visible where that is a separate step."""
        raise NotImplementedError

    def delete_checkpoint(self, p: Any, hook: Callable[[str], None] = lambda point: None) -> None:
        """Delete the checkpoint at ``p`` so that it stops loading first; entries oarlock did not write stay."""
        raise NotImplementedError

    def clean_stale(self, root: Any, step: "re.Pattern[str]", leftover: "re.Pattern[str]") -> list[str]:
        """Remove what killed writes left under ``root`` (step checkpoints named by ``step``; hidden leftover
        entries named by ``leftover``). Returns the removed names."""
        raise NotImplementedError


class LocalCommit(CommitProtocol):
    """The commit protocol on a filesystem (:mod:`.local`)."""

    def detect(self, p: Any) -> str:
        return _local.detect(p)

    def is_committed(self, p: Any) -> bool:
        return _local.is_committed(p)

    def recover(self, p: Any) -> None:
        _local.recover_publish(p)

    def check_destination(self, final: Any, fmt: str, sources: Iterable[Any] = (), *, overwrite: bool = False
                          ) -> set[str]:
        return _local.check_destination(final, fmt, sources, overwrite=overwrite)

    def check_save_destination(self, final: Any, sources: Iterable[Any] = (), *, overwrite: bool = False) -> None:
        _local.check_destination(final, "oarlock", sources, overwrite=overwrite)
        _local.remove_stale_staging(final)

    def staging_path(self, final: Any, token: str | None = None) -> Any:
        return _local.staging_path(Path(final), token)

    def staged_directory(self, final: Any, *, incomplete_marker: bool = True, tmp: Path | None = None
                         ) -> "contextlib.AbstractContextManager[Path]":
        return _local.staged_directory(final, incomplete_marker=incomplete_marker, tmp=tmp)

    def publish_directory(self, tmp: Path, final: Any, metadata: Any = None, *, fsync_files: bool = True,
                          overwrite: bool = False) -> None:
        _local.publish_directory(tmp, Path(final), metadata, fsync_files=fsync_files, overwrite=overwrite)

    def prepare_save(self, final: Any, world: int, save_id: str, *, overwrite: bool = False) -> None:
        self.check_save_destination(final, overwrite=overwrite)

    def begin_write(self, tmp: Any) -> int | None:
        fd = _local.hold_staging(tmp)  # locked until committed: a cleanup of stale directories skips it
        (tmp / INCOMPLETE_MARKER).touch()  # before any data file: a partial directory must never load
        return fd

    def end_write(self, handle: int | None) -> None:
        _local.release_staging(handle)

    def publish_save(self, tmp: Any, final: Any, metadata: Any, files: Iterable[str], *, overwrite: bool = False
                     ) -> None:
        # each rank fsynced its own data file: rank 0 need not touch the others'
        _local.publish_directory(tmp, final, metadata, fsync_files=False, overwrite=overwrite)

    def abort_save(self, tmp: Any) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def make_root(self, root: Any) -> None:
        Path(root).mkdir(parents=True, exist_ok=True)

    def replace_small(self, p: Any, data: bytes, hook: Callable[[str], None] = lambda point: None) -> None:
        _local.replace_file(Path(p), data, hook)

    def delete_checkpoint(self, p: Any, hook: Callable[[str], None] = lambda point: None) -> None:
        _local.delete_checkpoint(Path(p), hook)

    def clean_stale(self, root: Any, step: "re.Pattern[str]", leftover: "re.Pattern[str]") -> list[str]:
        return _local.clean_stale(Path(root), step, leftover)


class ObjectCommit(CommitProtocol):
    """The commit protocol in a store without rename (:mod:`.objects`)."""

    writes_in_place = True

    def detect(self, p: Any) -> str:
        return _objects.detect(p)

    def is_committed(self, p: Any) -> bool:
        return _objects.is_committed(p)

    def check_destination(self, final: Any, fmt: str, sources: Iterable[Any] = (), *, overwrite: bool = False
                          ) -> set[str]:
        _objects.check_object_destination(final, (), sources, overwrite=overwrite)
        return set()

    def check_save_destination(self, final: Any, sources: Iterable[Any] = (), *, overwrite: bool = False) -> None:
        _objects.check_object_destination(final, (), sources, overwrite=overwrite)

    def staging_path(self, final: Any, token: str | None = None) -> Any:
        return final  # no rename: data objects go under the final prefix, after the marker

    def staged_directory(self, final: Any, *, incomplete_marker: bool = True, tmp: Path | None = None
                         ) -> "contextlib.AbstractContextManager[Path]":
        return _objects.staged_directory(final)

    def publish_directory(self, tmp: Path, final: Any, metadata: Any = None, *, fsync_files: bool = True,
                          overwrite: bool = False) -> None:
        _objects.publish_directory(tmp, final, metadata, overwrite=overwrite)

    def prepare_save(self, final: Any, world: int, save_id: str, *, overwrite: bool = False) -> None:
        _objects.prepare_object_destination(final, world, save_id, overwrite=overwrite)

    def publish_save(self, tmp: Any, final: Any, metadata: Any, files: Iterable[str], *, overwrite: bool = False
                     ) -> None:
        _objects.publish_objects(final, metadata, files)

    def abort_save(self, tmp: Any) -> None:
        _objects.remove_uncommitted_objects(tmp)

    def replace_small(self, p: Any, data: bytes, hook: Callable[[str], None] = lambda point: None) -> None:
        p.storage.put_bytes(p.key, data)  # one PUT replaces an object whole

    def delete_checkpoint(self, p: Any, hook: Callable[[str], None] = lambda point: None) -> None:
        _objects.delete_checkpoint(p)

    def clean_stale(self, root: Any, step: "re.Pattern[str]", leftover: "re.Pattern[str]") -> list[str]:
        return _objects.clean_stale(root, step)


_LOCAL, _OBJECTS = LocalCommit(), ObjectCommit()


def commit_for(p: "str | os.PathLike | ObjectPath") -> CommitProtocol:
    """The commit protocol of the store holding location ``p``.

    Raises:
        UnsupportedLocationError: ``p`` is a URL of no registered store.
    """
    return _OBJECTS if isinstance(location(p), ObjectPath) else _LOCAL

