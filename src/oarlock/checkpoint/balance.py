"""Moved to :mod:`oarlock.checkpoint.planning.assign` (issue 42: the checkpoint package laid out by role).

This old path is an alias for one release and goes in the next: importing it gives
``oarlock.checkpoint.planning.assign`` itself, so its private names and monkeypatching reach the one real module.
New code imports ``oarlock.checkpoint.planning.assign``.
"""

import sys

from oarlock.checkpoint.planning import assign as _moved

sys.modules[__name__] = _moved
