"""oarlock: PaddlePaddle 3.3's large-model training system for PyTorch users.

Capabilities live in one subpackage each: :mod:`oarlock.checkpoint` (FlexCheckpoint + AOA),
:mod:`oarlock.attention` (FlashMask), :mod:`oarlock.memory` (VMM allocator, simulator, observer),
:mod:`oarlock.debug` (graph capture, checksums, run diff) and :mod:`oarlock.models` (reference models with
parallel layouts). Subpackages are imported on demand so ``import oarlock`` stays cheap.
"""

from oarlock.errors import OarlockError

__version__ = "0.1.0"
__all__ = ["OarlockError", "__version__"]
