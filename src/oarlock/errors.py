"""The root of oarlock's exception tree.

Each capability package derives its own errors from :class:`OarlockError` (for example
``oarlock.checkpoint.CheckpointMismatchError``), so callers can catch everything oarlock raises on bad input
with one ``except OarlockError`` and the CLI can turn it into a one-line message with exit code 2.
"""


class OarlockError(Exception):
    """Base class of every error oarlock raises for bad input or an impossible request.

    The message always names the culprit: the file, key, shape, statement or argument at fault.
    """
