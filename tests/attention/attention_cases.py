"""Mask cases shared by the attention tests: every mask type, scaled to any sequence length."""

from __future__ import annotations

import torch

from oarlock.attention import masks as M


def split(s: int, fracs: list[float]) -> list[int]:
    """Positive lengths summing to ``s``, roughly in the given proportions (fewer pieces when ``s`` is small)."""
    out, used = [], 0
    for f in fracs:
        n = max(1, int(round(s * f)))
        if used + n >= s:
            break
        out.append(n)
        used += n
    out.append(s - used)
    return out


MASK_TYPES = ["full", "causal", "causal_none", "sliding_window", "window_size", "causal_document", "document",
              "shared_question", "global_sliding_window", "prefix_lm_causal", "prefix_lm_document", "qk_sparse",
              "random_eviction", "causal_blockwise", "bidirectional_window"]


def make_mask(kind: str, sk: int, *, batch: int = 1, kv_heads: int = 1, mask_heads: int = 1, seed: int = 0):
    """``(startend_row_indices or None, causal, window_size)`` for a mask type at key length ``sk``."""
    g = torch.Generator().manual_seed(seed)
    w = max(1, sk // 8)
    docs = split(sk, [0.31, 0.21, 0.1])
    if kind == "full":
        idx, causal = None, False
    elif kind == "causal_none":
        idx, causal = None, True
    elif kind == "window_size":
        return None, True, w
    elif kind == "causal":
        idx, causal = M.causal_mask(sk, batch_size=batch), True
    elif kind == "sliding_window":
        idx, causal = M.sliding_window_mask(sk, w, batch_size=batch), True
    elif kind == "bidirectional_window":
        idx, causal = M.bidirectional_sliding_window_mask(sk, w, w // 2 + 1, batch_size=batch), False
    elif kind == "causal_document":
        # different documents per batch row
        rows = [docs] + [split(sk, [0.5, 0.2])] * (batch - 1)
        idx, causal = M.causal_document_mask(rows, batch_size=batch), True
    elif kind == "document":
        idx, causal = M.document_mask(docs, batch_size=batch), False
    elif kind == "shared_question":
        parts = split(sk, [0.3, 0.2, 0.2, 0.1])
        idx, causal = M.shared_question_mask([(parts[0], parts[1:])], batch_size=batch), True
    elif kind == "global_sliding_window":
        idx, causal = M.global_sliding_window_mask(sk, max(1, sk // 16), w, w, batch_size=batch), False
    elif kind == "prefix_lm_causal":
        idx, causal = M.prefix_lm_causal_mask(sk, sk // 4, batch_size=batch), False
    elif kind == "prefix_lm_document":
        idx, causal = M.prefix_lm_document_mask([(max(1, d // 3), d) for d in docs], batch_size=batch), False
    elif kind == "qk_sparse":
        idx, causal = M.qk_sparse_mask(sk, [(sk // 8, sk // 16 + 1), (sk // 2, sk // 5)], batch_size=batch), True
    elif kind == "random_eviction":
        idx, causal = M.random_eviction_mask(sk, batch_size=batch, num_heads=mask_heads, generator=g), True
    elif kind == "causal_blockwise":
        idx, causal = M.causal_blockwise_mask(docs, batch_size=batch), True
    else:
        raise KeyError(kind)
    if idx is not None and idx.shape[1] != mask_heads:
        idx = idx.expand(-1, mask_heads, -1, -1).contiguous()
    return idx, causal, None
