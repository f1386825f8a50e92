"""Moved: the reader base class and the format registry are :mod:`oarlock.checkpoint.formats.reader` now. The old
path is the same module (names, private helpers and monkeypatching included) for one release."""

import sys

from oarlock.checkpoint.formats import reader as _moved

sys.modules[__name__] = _moved
