"""Open any supported checkpoint for reading: detect its format (:func:`oarlock.checkpoint.storage.detect_format`)
and hand it to that format's reader (one module per format in :mod:`oarlock.checkpoint.formats`).

Formats recognised (see ``docs/checkpoint-format.md``):

* ``safetensors``: one ``.safetensors`` file; every tensor is one whole shard.
* ``huggingface``: a directory with ``model.safetensors``, or sharded files listed by
  ``model.safetensors.index.json`` (``{"metadata": {...}, "weight_map": {key: file}}``).
* ``oarlock``: a directory with ``metadata.json`` and per-rank safetensors data files.
* ``paddle``, ``dcp``, ``deepspeed``, ``megatron``, ``accelerate``, ``gguf``: see the format modules.

Reading never writes into the source directory. Headers are validated by the safetensors library before any
byte is trusted; its errors are re-raised as :class:`CheckpointFormatError` naming the file.
"""

from __future__ import annotations

import os

from oarlock.checkpoint.errors import CheckpointFormatError
from oarlock.checkpoint.formats import load_formats
from oarlock.checkpoint.model.metadata import CheckpointMetadata
from oarlock.checkpoint.formats.reader import CheckpointReader
from oarlock.checkpoint.runtime.view import View
from oarlock.checkpoint.storage import INCOMPLETE_MARKER, detect_format, location

__all__ = ["open_checkpoint", "read_metadata"]


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
    from oarlock.checkpoint.model.metadata import mark_training_layout

    mark_training_layout(reader.metadata)  # torch's {"model", "optim"} / torchtitan's entries: what is not weights
    return reader


def read_metadata(path: str | os.PathLike, *, view: View | None = None, rank: int = 0) -> CheckpointMetadata:
    """Detect the format at ``path`` and return its validated :class:`CheckpointMetadata` (through this rank's
    ``view`` of a checkpoint spread over node-local disks when given: see :func:`open_checkpoint`)."""
    with open_checkpoint(path, view=view, rank=rank) as r:
        return r.metadata
