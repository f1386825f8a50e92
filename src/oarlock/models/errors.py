"""Errors of :mod:`oarlock.models`. Every message names the argument, key or degree at fault."""

from oarlock.errors import OarlockError


class ModelError(OarlockError):
    """Base of every models error (bad config, impossible parallel layout, missing weights)."""


class ParallelLayoutError(ModelError):
    """A parallel layout that cannot be built: a degree that does not divide heads, experts or layers, or a
    mesh that does not match the requested degrees. The message lists the degrees that work."""
