"""Moved: the HuggingFace writer is :mod:`oarlock.checkpoint.formats.huggingface_writer` now (beside its reader).
The old path is the same module (names, private helpers and monkeypatching included) for one release."""

import sys

from oarlock.checkpoint.formats import huggingface_writer as _moved

sys.modules[__name__] = _moved
