"""Checkpoint source formats: one module per format, each registering one
:class:`~oarlock.checkpoint.formats.reader.CheckpointReader` subclass (see :mod:`oarlock.checkpoint.formats.reader`
for the
protocol). :func:`load_formats` imports every module of this package, so a new format is a new module here.
"""

from __future__ import annotations

import importlib
import pkgutil

from oarlock.checkpoint.formats.reader import CheckpointReader, registered_formats

_loaded = False


def load_formats() -> dict[str, type[CheckpointReader]]:
    """Import every format module of this package (once) and return the registry, format name -> reader class,
    ordered by the classes' ``priority`` (the order formats are named in messages)."""
    global _loaded
    if not _loaded:
        for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
            if not m.name.startswith("_"):
                importlib.import_module(f"{__name__}.{m.name}")
        _loaded = True
    return dict(sorted(registered_formats().items(), key=lambda kv: (kv[1].priority, kv[0])))
