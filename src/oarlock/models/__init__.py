"""oarlock.models: a plain Llama/GQA (dense and MoE) model, its parallel layouts, ZeRO-1, and real weights.

Public names:

* :class:`Llama`, :class:`LlamaConfig` (``oarlock.models.llama``): single-device model with fused ``qkv_proj`` /
  ``gate_up_proj`` in the FlexCheckpoint ``fused_qkv`` / ``fused_ffn`` layouts; ``hf_aoa_config`` /
  ``hf_export_aoa_config`` (AOA statements) and ``convert_hf_state_dict`` / ``to_hf_state_dict`` (plain torch).
* ``parallelize_llama`` and :class:`ParallelLayout` (``oarlock.models.parallel``): tensor, pipeline, expert and
  data parallel layouts applied from outside; ``forward_backward`` runs one micro-batch in any layout.
* :class:`ZeroRedundancyAdamW` (``oarlock.models.zero``): ZeRO-1 AdamW with flattened optimizer-state shards.
* ``pack_documents`` (``oarlock.models.data``): documents -> fixed-length rows, labels, document ids.
* ``ensure_hf_checkpoint`` (``oarlock.models.smollm2``): SmolLM2-135M-Instruct as an HF fp32 directory.
"""

from oarlock.models.data import pack_documents
from oarlock.models.errors import ModelError, ParallelLayoutError
from oarlock.models.llama import (Llama, LlamaConfig, causal_document_mask, causal_lm_loss, convert_hf_state_dict,
                                  document_position_ids, hf_aoa_config, hf_export_aoa_config, to_hf_state_dict,
                                  tp_relayout_aoa_config)
from oarlock.models.parallel import (ParallelLayout, ParallelState, build_mesh, check_layout, expert_range,
                                     forward_backward, load_single_device_state_dict, parallelize_llama,
                                     single_device_grads, single_device_state_dict, stage_layer_range,
                                     valid_tp_degrees)
from oarlock.models.smollm2 import MissingModelPackageError, ensure_hf_checkpoint
from oarlock.models.zero import FlatShard, ZeroRedundancyAdamW

__all__ = [
    "Llama", "LlamaConfig", "ModelError", "ParallelLayoutError", "MissingModelPackageError", "causal_document_mask",
    "causal_lm_loss", "convert_hf_state_dict", "document_position_ids", "ensure_hf_checkpoint", "hf_aoa_config",
    "hf_export_aoa_config", "to_hf_state_dict", "tp_relayout_aoa_config",
    "ParallelLayout", "ParallelState", "build_mesh", "check_layout", "expert_range", "forward_backward",
    "single_device_grads", "single_device_state_dict", "load_single_device_state_dict", "parallelize_llama",
    "stage_layer_range", "valid_tp_degrees",
    "FlatShard", "ZeroRedundancyAdamW", "pack_documents",
]
