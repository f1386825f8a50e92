"""Moved: this module is :mod:`oarlock.checkpoint.runtime.dist` now. The old path is the same module (names, private
helpers and monkeypatching included) for one release."""

import sys

from oarlock.checkpoint.runtime import dist as _moved

sys.modules[__name__] = _moved
