"""Moved: the save pipeline is :mod:`oarlock.checkpoint.runtime.save` now (its planning half in
:mod:`oarlock.checkpoint.planning.save`). The old path is the same module (names, private helpers and
monkeypatching included) for one release."""

import sys

from oarlock.checkpoint.runtime import save as _moved

sys.modules[__name__] = _moved
