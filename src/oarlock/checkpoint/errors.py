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


class PlanError(CheckpointError):
    """A live reshard (``WeightSync.run``, ``reshard_state_dict``) failed while it was being planned, before any
    byte moved: no target was written, so they all hold their values of before the call (``WeightSync.torn`` is
    not set by it). An inference engine may keep serving them. Errors that fail a transfer once bytes move are not
    ``PlanError`` s (they leave ``torn`` set where targets may mix old and new values).

    What is raised is also an instance of the original error's class (``CheckpointMismatchError`` for a shape or
    dtype mismatch, ``AOAError`` for a bad AOA config, ...), so code catching those keeps working.

    Attributes:
        phase: ``"plan"`` (errors raised once bytes move carry ``phase = "transfer"``).
    """

    phase = "plan"


class RendezvousError(CheckpointError):
    """The rendezvous of :func:`~oarlock.checkpoint.join_group` failed: this process refused (no or another
    secret), a peer that does not prove the secret or speak the protocol, a rank claimed by two members, a
    timeout. The message names the address at fault."""
