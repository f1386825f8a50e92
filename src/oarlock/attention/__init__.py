"""FlashMask attention for PyTorch (PaddlePaddle's ``flashmask_attention``; FlashMask, arXiv 2410.01359).

The mask is a per-key-column list of masked query-row intervals (``startend_row_indices``, O(N) memory);
:func:`flashmask_attention` is the one entry point (CPU tiled kernel, Triton on CUDA, dense reference
elsewhere). :mod:`oarlock.attention.masks` has one constructor per mask type and the dense / FlexAttention
conversions; :mod:`oarlock.attention.context_parallel` plans mask-aware context-parallel load balancing and
runs attention across ranks (:func:`context_parallel_flashmask_attention`); :mod:`oarlock.attention.hf` plugs
FlashMask into transformers models (``attn_implementation=register_transformers_attention()``). Semantics:
``docs/flashmask.md``.
"""

from oarlock.attention.context_parallel import (CP_METHODS, DEFAULT_CP_METHOD, ContextParallelPlan,
                                               context_parallel_flashmask_attention, gather_sequence, local_positions,
                                               plan_context_parallel, shard_sequence)
from oarlock.attention.errors import AttentionError, AttentionInputError, MaskNotRepresentableError
from oarlock.attention.flashmask import flashmask_attention
from oarlock.attention.hf import register as register_transformers_attention
from oarlock.attention.masks import (bidirectional_sliding_window_mask, causal_blockwise_mask, causal_document_mask,
                                     causal_document_mask_from_ids,
                                     causal_mask, document_mask, from_dense_mask, global_sliding_window_mask,
                                     mask_picture, prefix_lm_causal_mask, prefix_lm_document_mask, qk_sparse_mask,
                                     random_eviction_mask, shared_question_mask, sliding_window_mask, to_dense_mask,
                                     to_flex_block_mask, to_mask_mod)

__all__ = [
    "flashmask_attention",
    "AttentionError", "AttentionInputError", "MaskNotRepresentableError",
    "causal_mask", "sliding_window_mask", "bidirectional_sliding_window_mask", "causal_document_mask",
    "causal_document_mask_from_ids",
    "document_mask", "shared_question_mask", "global_sliding_window_mask", "prefix_lm_causal_mask",
    "prefix_lm_document_mask", "qk_sparse_mask", "random_eviction_mask", "causal_blockwise_mask",
    "to_dense_mask", "from_dense_mask", "to_mask_mod", "to_flex_block_mask", "mask_picture",
    "plan_context_parallel", "ContextParallelPlan", "context_parallel_flashmask_attention", "shard_sequence",
    "gather_sequence", "local_positions", "register_transformers_attention", "CP_METHODS", "DEFAULT_CP_METHOD",
]
