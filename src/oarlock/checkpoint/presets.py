"""Moved to :mod:`oarlock.checkpoint.aoa.presets` (issue 42: the checkpoint package laid out by role).

This old path is an alias for one release and goes in the next: importing it gives
``oarlock.checkpoint.aoa.presets`` itself, so its private names and monkeypatching reach the one real module.
New code imports ``oarlock.checkpoint.aoa.presets``.
"""

import sys

from oarlock.checkpoint.aoa import presets as _moved

sys.modules[__name__] = _moved
