"""Moved to :mod:`oarlock.checkpoint.formats.paddle_pickle` (issue 42: the checkpoint package laid out by role).

This old path is an alias for one release and goes in the next: importing it gives
``oarlock.checkpoint.formats.paddle_pickle`` itself, so its private names and monkeypatching reach the one real module.
New code imports ``oarlock.checkpoint.formats.paddle_pickle``.
"""

import sys

from oarlock.checkpoint.formats import paddle_pickle as _moved

sys.modules[__name__] = _moved
