"""Moved to :mod:`oarlock.checkpoint.lifecycle.optim` (issue 42: the checkpoint package laid out by role).

This old path is an alias for one release and goes in the next: importing it gives
``oarlock.checkpoint.lifecycle.optim`` itself, so its private names and monkeypatching reach the one real module.
New code imports ``oarlock.checkpoint.lifecycle.optim``.
"""

import sys

from oarlock.checkpoint.lifecycle import optim as _moved

sys.modules[__name__] = _moved
