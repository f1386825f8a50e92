"""FlexCheckpoint for PyTorch: sharded save/load with automatic resharding, AOA, HF/Paddle interop.

Public surface: :func:`save_state_dict` / :func:`load_state_dict` (any layout to any layout, byte-range reads),
:class:`ShardedWeight` and its hashable :class:`ShardDesc`, :func:`sharded_state_dict` for modules,
:func:`sharded_optimizer_state_dict` / :func:`load_sharded_optimizer_state_dict` for optimizers (exact resume), the pure
load planner (:func:`plan_load`), the metadata model, readers for every source format, and errors.
"""

from oarlock.checkpoint.api import LoadReport, load_state_dict, save_state_dict
from oarlock.checkpoint.errors import (CheckpointError, CheckpointFormatError, CheckpointMismatchError,
                                       CheckpointTilingError, UnsafePickleError)
from oarlock.checkpoint.mapping import IdentityProgram, MappingProgram, SliceMapping, TensorSpec
from oarlock.checkpoint.metadata import CheckpointMetadata, ShardMeta, TensorMeta
from oarlock.checkpoint.optim import (OptimizerHyperparameterWarning, OptimizerStateError,
                                      load_sharded_optimizer_state_dict, sharded_optimizer_state_dict)
from oarlock.checkpoint.plan import LoadPlan, ReadItem, plan_load
from oarlock.checkpoint.sharded import ShardDesc, ShardedWeight, sharded_state_dict
from oarlock.checkpoint.storage import CheckpointReader, detect_format, open_checkpoint, read_metadata

__all__ = [
    "save_state_dict", "load_state_dict", "LoadReport",
    "ShardedWeight", "ShardDesc", "sharded_state_dict",
    "sharded_optimizer_state_dict", "load_sharded_optimizer_state_dict", "OptimizerStateError",
    "OptimizerHyperparameterWarning",
    "plan_load", "LoadPlan", "ReadItem",
    "MappingProgram", "IdentityProgram", "SliceMapping", "TensorSpec",
    "CheckpointError", "CheckpointFormatError", "CheckpointMismatchError", "CheckpointTilingError",
    "UnsafePickleError",
    "CheckpointMetadata", "ShardMeta", "TensorMeta",
    "CheckpointReader", "detect_format", "open_checkpoint", "read_metadata",
]
