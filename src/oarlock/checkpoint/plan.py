"""Moved to :mod:`oarlock.checkpoint.planning.load` (issue 42: the checkpoint package laid out by role).

This old path is an alias for one release and goes in the next: importing it gives
``oarlock.checkpoint.planning.load`` itself, so its private names and monkeypatching reach the one real module.
New code imports ``oarlock.checkpoint.planning.load``.
"""

import sys

from oarlock.checkpoint.planning import load as _moved

sys.modules[__name__] = _moved
