"""Errors raised by :mod:`oarlock.debug`."""

from oarlock.errors import OarlockError


class DebugError(OarlockError):
    """Bad argument to a debugging tool (checksum spec, module filter, log level, ...)."""


class DumpFormatError(DebugError):
    """A capture dump that cannot be read: the message names the file and line at fault."""
