"""Moved to :mod:`oarlock.checkpoint.model.sharded` (issue 42: the checkpoint package laid out by role).

This old path is an alias for one release and goes in the next: importing it gives
``oarlock.checkpoint.model.sharded`` itself, so its private names and monkeypatching reach the one real module.
New code imports ``oarlock.checkpoint.model.sharded``.
"""

import sys

from oarlock.checkpoint.model import sharded as _moved

sys.modules[__name__] = _moved
