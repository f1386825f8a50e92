"""Moved: this module is :mod:`oarlock.checkpoint.lifecycle.async_save` now. The old path is the same module (names,
private helpers and monkeypatching included) for one release."""

import sys

from oarlock.checkpoint.lifecycle import async_save as _moved

sys.modules[__name__] = _moved
