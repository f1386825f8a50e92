"""The commit protocol in object stores, which have no rename (``docs/checkpoint-format.md``, "Object stores").

A save writes a marker object ``.oarlock-incomplete`` (``{"save_id", "world"}``) first, then its data objects
under the final prefix, then the manifest and the commit record ``metadata.json`` last: a prefix without the
commit record holds no checkpoint, whatever else is there. Writers that are not sequential (convert, HF export,
DCP export) write a local directory and :func:`upload_directory` it. Everything here goes through the storage
protocol, so it serves every registered store (S3, the in-memory store of the tests).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterable, Iterator

from oarlock.checkpoint.errors import CheckpointError, CheckpointFormatError
from oarlock.checkpoint.model.metadata import METADATA_FILE, CheckpointMetadata
from oarlock.checkpoint.storage.commit.local import write_metadata_file
from oarlock.checkpoint.storage.commit.markers import INCOMPLETE_MARKER, WRITTEN_MANIFEST, describe
from oarlock.checkpoint.storage.location import ObjectPath, location

__all__ = ["check_object_destination", "detect", "is_committed", "object_entries", "prepare_object_destination",
           "publish_objects", "remove_uncommitted_objects", "staged_directory", "publish_directory",
           "upload_directory"]


def is_committed(p: ObjectPath) -> bool:
    """Whether prefix ``p`` holds a committed checkpoint: its commit record ``metadata.json`` exists (the commit
    record alone decides in an object store)."""
    return (p / METADATA_FILE).is_file()


@contextlib.contextmanager
def staged_directory(final: ObjectPath) -> Iterator[Path]:
    """A local temporary directory for a writer that is not sequential; :func:`publish_directory` uploads it
    (stores have no rename). Removed when the block ends."""
    tmp = Path(tempfile.mkdtemp(prefix=".oarlock-upload-"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def publish_directory(tmp: Path, final: ObjectPath, metadata: CheckpointMetadata | None = None, *,
                      overwrite: bool = False) -> None:
    """Upload the local directory ``tmp`` (with ``metadata.json`` written into it first when given) under prefix
    ``final``: :func:`upload_directory`."""
    if metadata is not None:
        write_metadata_file(tmp, final, metadata)
    upload_directory(tmp, final, overwrite=overwrite)


def detect(p: ObjectPath) -> str:
    """The format of the checkpoint under prefix ``p`` in an object store: ``metadata.json`` is the commit record (a prefix
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

    from oarlock.checkpoint.model.grid import data_file_name

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
        if isinstance(s, ObjectPath) and (s.scheme, s.bucket) == (final.scheme, final.bucket) and (
                s.key == final.key or s.key.startswith(final.key + "/") or final.key.startswith(s.key + "/")):
            raise CheckpointDestinationError(f"{final}: the destination overlaps the source checkpoint {s}; write "
                                             "to another prefix")
    names = final.storage.list(final.key)
    ours = object_entries(final, names)
    foreign = set(names) - ours
    hint = ("; pass --overwrite (overwrite=True) to write the checkpoint there anyway: only objects oarlock wrote "
            "are replaced, the others stay")
    if foreign and not overwrite:
        raise CheckpointDestinationError(f"{final}: holds objects oarlock did not write: {describe(foreign)}; "
                                         f"refusing to write a checkpoint there{hint}")
    clash = foreign & set(writes)
    if clash:
        raise CheckpointDestinationError(f"{final}: holds {describe(clash)}, which oarlock did not write, under "
                                         "a name the new checkpoint writes; refusing to replace it")
    return ours




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
    from oarlock.checkpoint.formats.huggingface import HF_INDEX

    commit_files = {METADATA_FILE, HF_INDEX, ".metadata"}  # each format's commit record, uploaded last
    st.delete(f"{final.key}/{n}" for n in sorted(ours & commit_files))
    st.delete(f"{final.key}/{n}" for n in ours - commit_files - {INCOMPLETE_MARKER})
    commit = [n for n in names if n in commit_files]
    for n in [n for n in names if n not in commit_files and n != WRITTEN_MANIFEST]:
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



def delete_checkpoint(p: ObjectPath) -> None:
    """Delete the checkpoint under prefix ``p``: the commit record first (a half-deleted checkpoint never loads),
    then the other objects oarlock wrote; others' objects stay."""
    st = p.storage
    own = object_entries(p, st.list(p.key))
    st.delete([(p / METADATA_FILE).key])
    st.delete((p / n).key for n in own - {METADATA_FILE})


def clean_stale(root: ObjectPath, step: "re.Pattern[str]") -> list[str]:
    """Remove the objects oarlock wrote under the step prefixes of ``root`` (named by ``step``) that killed saves
    left without a commit record. Returns the cleaned prefixes' names."""
    st = root.storage
    removed = []
    for name, size in st.list(root.key).items():
        p = root / name
        if size < 0 and step.fullmatch(name) and not is_committed(p):
            own = object_entries(p, st.list(p.key))
            if own:
                st.delete((p / n).key for n in own)
                removed.append(name)
    return sorted(removed)
