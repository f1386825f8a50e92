"""Moved: the header-first safetensors reader and writer over the storage layer is
:mod:`oarlock.checkpoint.storage.safetensors` now. This old path is the same module (names, private helpers and
monkeypatching included) for one release."""

import sys

from oarlock.checkpoint.storage import safetensors as _moved

sys.modules[__name__] = _moved
