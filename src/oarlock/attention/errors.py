"""Errors of :mod:`oarlock.attention`. Every message names the argument, the expected and the actual value."""

from oarlock.errors import OarlockError


class AttentionError(OarlockError):
    """Base of every attention error."""


class AttentionInputError(AttentionError, ValueError):
    """A tensor or argument passed to :func:`flashmask_attention` has the wrong shape, dtype, device or value."""


class MaskNotRepresentableError(AttentionError, ValueError):
    """A dense mask cannot be written as FlashMask start/end row indices (too many masked runs in a column)."""
