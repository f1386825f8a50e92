"""Moved: this module is :mod:`oarlock.checkpoint.runtime.comm` now. The old path is the same module (names, private
helpers and monkeypatching included) for one release."""

import sys

from oarlock.checkpoint.runtime import comm as _moved

sys.modules[__name__] = _moved
