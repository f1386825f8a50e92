"""What every rank of a load sees of a checkpoint (:func:`gather_view`): on a shared filesystem or an object
store one fixed-size agreement, on node-local disks an all-gather of the listings and the metadata files shipped
to the ranks that lack them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from oarlock.checkpoint.runtime.dist import DistWrapper, fingerprint_words
from oarlock.checkpoint.errors import CheckpointError, CheckpointFormatError
from oarlock.checkpoint.formats import load_formats
from oarlock.checkpoint.formats.reader import checkpoint_file
from oarlock.checkpoint.storage import detect_format, location, storage_key

__all__ = ["View", "gather_view"]


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
    st, key = storage_key(p)
    if st.shared and None not in dist.agree(fingerprint_words(f"\2{fmt}")):
        return View({}, fmt, same=True, store=True)
    try:
        names = sorted(st.names(key)) if p.is_dir() else ([p.name] if p.exists() else [])
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
