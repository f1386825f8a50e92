"""FlexCheckpoint for PyTorch: sharded save/load with automatic resharding, AOA, HF/Paddle interop.

Public surface (grows as the pieces land): metadata model, readers for every source format, errors.
"""

from oarlock.checkpoint.errors import (CheckpointError, CheckpointFormatError, CheckpointMismatchError,
                                       UnsafePickleError)
from oarlock.checkpoint.metadata import CheckpointMetadata, ShardMeta, TensorMeta
from oarlock.checkpoint.storage import CheckpointReader, detect_format, open_checkpoint, read_metadata

__all__ = [
    "CheckpointError", "CheckpointFormatError", "CheckpointMismatchError", "UnsafePickleError",
    "CheckpointMetadata", "ShardMeta", "TensorMeta",
    "CheckpointReader", "detect_format", "open_checkpoint", "read_metadata",
]
