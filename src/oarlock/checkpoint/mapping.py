"""Moved to :mod:`oarlock.checkpoint.model.mapping` (issue 42: the checkpoint package laid out by role).

This old path is an alias for one release and goes in the next: importing it gives
``oarlock.checkpoint.model.mapping`` itself, so its private names and monkeypatching reach the one real module.
New code imports ``oarlock.checkpoint.model.mapping``.
"""

import sys

from oarlock.checkpoint.model import mapping as _moved

sys.modules[__name__] = _moved
