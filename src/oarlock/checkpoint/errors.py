"""Errors of :mod:`oarlock.checkpoint`. Every message names the file, key, shape or statement at fault."""

from oarlock.errors import OarlockError


class CheckpointError(OarlockError):
    """Base of every checkpoint error."""


class CheckpointFormatError(CheckpointError):
    """A file or directory is not a readable checkpoint: missing, truncated, corrupt, mixed formats."""


class CheckpointMismatchError(CheckpointError):
    """What the caller asks for does not match what was saved (shape, dtype, missing or unexpected keys)."""


class UnsafePickleError(CheckpointFormatError):
    """A foreign pickle references a class outside the admitted set (it could run code if unpickled)."""


class CheckpointTilingError(CheckpointError):
    """The shards of a key do not tile its global box exactly: a gap, an overlap, or a box out of bounds."""


class CheckpointDestinationError(CheckpointError):
    """A writer's destination is refused: it is (inside) the source, not a directory, or holds entries oarlock did
    not write (named in the message; ``overwrite=True`` / ``--overwrite`` writes next to them instead)."""
