"""FlexCheckpoint for PyTorch: sharded save/load with automatic resharding, AOA, HF/Paddle interop.

Public surface: :func:`save_state_dict` / :func:`load_state_dict` (any layout to any layout, byte-range reads),
:class:`ShardedWeight` and its hashable :class:`ShardDesc`, :func:`sharded_state_dict` for modules,
:func:`sharded_optimizer_state_dict` / :func:`load_sharded_optimizer_state_dict` for optimizers (exact resume), :func:`async_save`, the pure
load planner (:func:`plan_load`), the metadata model, readers for every source format, HF/Paddle interop
(:func:`export_hf`, :func:`export_hf_sharded`, :func:`convert_checkpoint`, :func:`full_state_dict`),
:class:`CheckpointManager` (save every N steps, keep the last K, resume; :class:`RNGState`, :class:`RankLocal`, :class:`OptimizerState`), and errors.
"""

from oarlock.checkpoint.api import LoadReport, load_state_dict, save_state_dict
from oarlock.checkpoint.async_save import AsyncSaveHandle, async_save
from oarlock.checkpoint.comm import COMM_METHODS
from oarlock.checkpoint.convert import (ConversionLayout, ConversionPlan, ParallelLayout, convert_checkpoint,
                                        export_hf, export_hf_sharded, iter_full_tensors, plan_conversion)
from oarlock.checkpoint.errors import (CheckpointDestinationError, CheckpointError, CheckpointFormatError,
                                       CheckpointMismatchError, CheckpointTilingError, UnsafePickleError)
from oarlock.checkpoint.full import full_state_dict
from oarlock.checkpoint.hf import save_hf_checkpoint
from oarlock.checkpoint.manager import CheckpointManager, OptimizerState, RankLocal, RNGState
from oarlock.checkpoint.mapping import IdentityProgram, MappingProgram, SliceMapping, TensorSpec
from oarlock.checkpoint.metadata import CheckpointMetadata, ShardMeta, TensorMeta
from oarlock.checkpoint.objectstore import ObjectPath, ObjectStoreError, UnsupportedLocationError, location
from oarlock.checkpoint.optim import (OptimizerHyperparameterWarning, OptimizerStateError,
                                      load_sharded_optimizer_state_dict, sharded_optimizer_state_dict)
from oarlock.checkpoint.plan import LoadPlan, ReadItem, plan_load
from oarlock.checkpoint.sharded import ShardDesc, ShardedWeight, sharded_state_dict
from oarlock.checkpoint.storage import CheckpointReader, detect_format, open_checkpoint, read_metadata

__all__ = [
    "save_state_dict", "load_state_dict", "LoadReport", "async_save", "AsyncSaveHandle", "COMM_METHODS",
    "ShardedWeight", "ShardDesc", "sharded_state_dict",
    "sharded_optimizer_state_dict", "load_sharded_optimizer_state_dict", "OptimizerStateError",
    "OptimizerHyperparameterWarning",
    "plan_load", "LoadPlan", "ReadItem",
    "full_state_dict", "save_hf_checkpoint", "export_hf", "export_hf_sharded", "iter_full_tensors",
    "convert_checkpoint", "plan_conversion", "ConversionPlan", "ConversionLayout", "ParallelLayout",
    "MappingProgram", "IdentityProgram", "SliceMapping", "TensorSpec",
    "CheckpointError", "CheckpointFormatError", "CheckpointMismatchError", "CheckpointTilingError",
    "UnsafePickleError", "CheckpointDestinationError", "ObjectStoreError", "UnsupportedLocationError",
    "ObjectPath", "location",
    "CheckpointMetadata", "ShardMeta", "TensorMeta",
    "CheckpointReader", "detect_format", "open_checkpoint", "read_metadata",
    "CheckpointManager", "OptimizerState", "RankLocal", "RNGState",
]
