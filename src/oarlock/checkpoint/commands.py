"""Moved to :mod:`oarlock.checkpoint.cli` (issue 42: the checkpoint package laid out by role).

This old path is an alias for one release and goes in the next: importing it gives
``oarlock.checkpoint.cli`` itself, so its private names and monkeypatching reach the one real module.
New code imports ``oarlock.checkpoint.cli``.
"""

import sys

from oarlock.checkpoint import cli as _moved

sys.modules[__name__] = _moved
