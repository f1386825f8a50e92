"""FlashMask as a HuggingFace ``transformers`` attention implementation.

One line makes a transformers model run its attention through :func:`~oarlock.attention.flashmask_attention`::

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=register_transformers_attention())
    # or, on a model already built:  model.set_attn_implementation(register_transformers_attention())

(``from oarlock.attention import register_transformers_attention``; it is :func:`register`.)

:func:`register` adds the implementation to ``transformers.AttentionInterface`` under the name
:data:`IMPLEMENTATION` (``"oarlock_mask"``: transformers reserves names containing "flash" for its own
FlashAttention checks) and returns that name. The mask comes from what packed batches already carry: the
``position_ids`` (restarting at 0 at every document, as ``DataCollatorWithFlattening`` writes them) or the
``cu_seq_lens_q`` cumulative lengths; every document then attends only to itself, causally for decoders
(``module.is_causal``), bidirectionally otherwise. No ``[S, S]`` mask is ever built. Without either, attention is
plain causal (or full). Right padding is harmless for a causal model (no real token sees a later pad); left
padding needs ``position_ids``. During generation with a cache (fewer queries than keys) the mask is the
bottom-right aligned causal one. Semantics of the masks: ``docs/flashmask.md``.
"""

from __future__ import annotations

from typing import Any

import torch

from oarlock.attention.errors import AttentionInputError
from oarlock.attention.flashmask import flashmask_attention
from oarlock.attention.masks import causal_document_mask_from_ids

__all__ = ["IMPLEMENTATION", "register", "transformers_attention", "document_ids_from_position_ids",
           "document_ids_from_cu_seqlens"]

#: The name :func:`register` gives the implementation (``attn_implementation=...``).
IMPLEMENTATION = "oarlock_mask"


def document_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """int64 ``[B, S]`` document index of every token of a packed batch, from ``position_ids`` ``[B, S]`` (a new
    document starts wherever the position does not follow the previous one by 1)."""
    if position_ids.dim() != 2:
        raise AttentionInputError(f"position_ids must be [batch, seqlen], got shape {tuple(position_ids.shape)}")
    new = torch.ones_like(position_ids, dtype=torch.bool)
    new[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return torch.cumsum(new.to(torch.int64), 1)


def document_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, seqlen: int) -> torch.Tensor:
    """int64 ``[1, seqlen]`` document index from FlashAttention-style cumulative lengths ``[0, l0, l0 + l1, ...]``
    of one packed row (tokens after the last boundary form one more document)."""
    cu = cu_seqlens.to(torch.int64).flatten()
    if cu.numel() < 1 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) > seqlen:
        raise AttentionInputError(f"cu_seq_lens must start at 0, not decrease and end at most at {seqlen}, got "
                                  f"{cu.tolist()}")
    pos = torch.arange(seqlen, device=cu.device)
    return torch.searchsorted(cu[1:], pos, right=True).view(1, seqlen)


def _document_mask(doc: torch.Tensor, causal: bool) -> torch.Tensor:
    """int32 FlashMask indices keeping every token inside its document: ``[LTS]`` (causal) or ``[LTS, UTE]``."""
    ends = causal_document_mask_from_ids(doc)  # [B, 1, S, 1]: end of each key's document
    if causal:
        return ends
    b, s = doc.shape
    pos = torch.arange(s, device=doc.device).expand(b, s)
    first = torch.ones_like(doc, dtype=torch.bool)
    first[:, 1:] = doc[:, 1:] != doc[:, :-1]
    starts = torch.cummax(torch.where(first, pos, torch.zeros_like(pos)), dim=1).values
    return torch.stack([ends.view(b, s), starts.to(torch.int32)], -1).view(b, 1, s, 2)


def transformers_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                           position_ids: torch.Tensor | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function: transformers' layout in, FlashMask inside.

    Args:
        module: the calling attention module (``is_causal`` decides causal vs bidirectional; default causal).
        query: ``[B, H, Sq, D]``; key/value ``[B, Hk, Sk, D]`` (transformers' SDPA layout).
        attention_mask: ignored (transformers builds none for implementations without a mask function).
        position_ids: ``[B, S]`` (or ``[1, S]``) positions restarting per packed document.
        cu_seq_lens_q: cumulative document lengths of a packed ``B == 1`` batch (used when given).

    Returns:
        ``(out [B, Sq, H, D], None)``.
    """
    causal = bool(getattr(module, "is_causal", True))
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    b, sq = q.shape[:2]
    sk = k.shape[1]
    idx = None
    if sq == sk:
        doc = None
        if cu_seq_lens_q is not None and b == 1:
            doc = document_ids_from_cu_seqlens(cu_seq_lens_q, sq)
        elif position_ids is not None and position_ids.shape[-1] == sq:
            doc = document_ids_from_position_ids(position_ids.reshape(-1, sq).expand(b, sq))
        if doc is not None and bool((doc[:, -1] != doc[:, 0]).any()):  # more than one document somewhere
            idx = _document_mask(doc.to(q.device), causal)
    out = flashmask_attention(q, k, v, idx, causal=causal, softmax_scale=scaling,
                              dropout=float(dropout or 0.0))
    return out, None


def register(name: str = IMPLEMENTATION) -> str:
    """Register :func:`transformers_attention` with ``transformers.AttentionInterface`` under ``name`` and return
    ``name`` (pass it as ``attn_implementation``). Idempotent.

    Raises:
        ImportError: transformers is not installed (``pip install oarlock[demo]``).
        AttentionInputError: ``name`` contains "flash" (transformers treats those as its FlashAttention kernels).
    """
    if "flash" in name.lower():
        raise AttentionInputError(f"attention implementation name {name!r} contains 'flash', which transformers "
                                  "reserves for its FlashAttention kernels; use e.g. 'oarlock_mask'")
    from transformers import AttentionInterface

    AttentionInterface.register(name, transformers_attention)
    return name
