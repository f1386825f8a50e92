"""FlexCheckpoint for PyTorch: sharded save/load with automatic resharding, AOA, HF/Paddle interop.

Public surface: :func:`save_state_dict` / :func:`load_state_dict` (any layout to any layout, byte-range reads),
:class:`ShardedWeight` and its hashable :class:`ShardDesc`, :func:`sharded_state_dict` for modules,
:func:`sharded_optimizer_state_dict` / :func:`load_sharded_optimizer_state_dict` for optimizers (exact resume), :func:`async_save`, the pure
load planner (:func:`plan_load`), the metadata model, readers for every source format, HF/Paddle interop
(:func:`export_hf`, :func:`export_hf_sharded`, :func:`convert_checkpoint`, :func:`full_state_dict`),
:class:`CheckpointManager` (save every N steps, keep the last K, resume; :class:`RNGState`, :class:`RankLocal`, :class:`OptimizerState`),
live resharding between running process groups (:func:`reshard_state_dict`, :class:`WeightSync`, :func:`join_group`), and errors.
"""

# The names import their submodule on first use (PEP 562; see oarlock.lazy): the CLI's checkpoint commands
# import oarlock.checkpoint.cli, and through it this package, so an eager import of torch here would make
# `oarlock convert --help` wait seconds for it. The errors are light and stay eager.
from oarlock.checkpoint.errors import (CheckpointDestinationError, CheckpointError, CheckpointFormatError,
                                       CheckpointMismatchError, CheckpointTilingError, PlanError, RendezvousError,
                                       UnsafePickleError)
from oarlock.lazy import lazy_exports

_LAZY = {
    **dict.fromkeys(("load_state_dict", "save_state_dict"), "api"),
    "LoadReport": "runtime.executor",
    **dict.fromkeys(("AsyncSaveHandle", "async_save"), "lifecycle.async_save"),
    "COMM_METHODS": "runtime.comm",
    **dict.fromkeys(("convert_checkpoint", "export_hf", "export_hf_sharded", "iter_full_tensors"), "convert.export"),
    **dict.fromkeys(("ConversionLayout", "ConversionPlan", "ParallelLayout", "plan_conversion"), "convert.plan"),
    "full_state_dict": "convert.full",
    "save_hf_checkpoint": "formats.huggingface_writer",
    **dict.fromkeys(("CheckpointManager", "OptimizerState", "RankLocal", "RNGState"), "lifecycle.manager"),
    **dict.fromkeys(("IdentityProgram", "MappingProgram", "SliceMapping", "TensorSpec"), "model.mapping"),
    **dict.fromkeys(("CheckpointMetadata", "ShardMeta", "TensorMeta"), "model.metadata"),
    **dict.fromkeys(("OptimizerHyperparameterWarning", "OptimizerStateError", "load_sharded_optimizer_state_dict",
                     "sharded_optimizer_state_dict"), "lifecycle.optim"),
    **dict.fromkeys(("LoadPlan", "ReadItem", "plan_load"), "planning.load"),
    **dict.fromkeys(("FlatPartition", "ShardDesc", "ShardedWeight", "sharded_state_dict"), "model.sharded"),
    "CheckpointReader": "formats.reader",
    **dict.fromkeys(("open_checkpoint", "read_metadata"), "formats.opening"),
    "detect_format": "storage",
    **dict.fromkeys(("ObjectStoreError", "UnsupportedLocationError"), "storage.backend"),
    **dict.fromkeys(("ObjectPath", "location"), "storage.location"),
    "ChecksumError": "integrity.hashing",
    **dict.fromkeys(("WeightSync", "reshard_state_dict"), "runtime.live"),
    "ReshardReport": "runtime.live_plan",
    **dict.fromkeys(("PeerGroup", "join_group"), "runtime.transfer"),
}

__all__ = [
    "save_state_dict", "load_state_dict", "LoadReport", "async_save", "AsyncSaveHandle", "COMM_METHODS",
    "FlatPartition", "ShardedWeight", "ShardDesc", "sharded_state_dict",
    "sharded_optimizer_state_dict", "load_sharded_optimizer_state_dict", "OptimizerStateError",
    "OptimizerHyperparameterWarning",
    "plan_load", "LoadPlan", "ReadItem",
    "full_state_dict", "save_hf_checkpoint", "export_hf", "export_hf_sharded", "iter_full_tensors",
    "convert_checkpoint", "plan_conversion", "ConversionPlan", "ConversionLayout", "ParallelLayout",
    "MappingProgram", "IdentityProgram", "SliceMapping", "TensorSpec",
    "CheckpointError", "CheckpointFormatError", "CheckpointMismatchError", "CheckpointTilingError",
    "UnsafePickleError", "CheckpointDestinationError", "ObjectStoreError", "UnsupportedLocationError", "ChecksumError",
    "ObjectPath", "location",
    "CheckpointMetadata", "ShardMeta", "TensorMeta",
    "CheckpointReader", "detect_format", "open_checkpoint", "read_metadata",
    "CheckpointManager", "OptimizerState", "RankLocal", "RNGState",
    "reshard_state_dict", "WeightSync", "ReshardReport", "join_group", "PeerGroup", "PlanError", "RendezvousError",
]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
