"""Moved: the load pipeline is :mod:`oarlock.checkpoint.runtime.load` now. The old path is the same module (names,
private helpers and monkeypatching included) for one release."""

import sys

from oarlock.checkpoint.runtime import load as _moved

sys.modules[__name__] = _moved
