"""Equivalence with torch.nn.attention.flex_attention (compiled on CPU, forward only: no CPU backward there).

Both conversion directions: FlashMask indices -> (mask_mod, BlockMask) and a FlexAttention mask_mod -> indices.
Compiling costs 10-20 s per shape, so one shape is used.
"""

from __future__ import annotations

import pytest
import torch

from oarlock.attention import flashmask_attention, from_dense_mask, to_flex_block_mask
from oarlock.attention.masks import shared_question_mask

flex_mod = pytest.importorskip("torch.nn.attention.flex_attention")

B, S, H, HK, D = 1, 256, 4, 2, 32


@pytest.fixture(scope="module")
def flex():
    torch._dynamo.reset()
    return torch.compile(flex_mod.flex_attention, dynamic=False)


def _qkv(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, S, H, D, generator=g), torch.randn(B, S, HK, D, generator=g),
            torch.randn(B, S, HK, D, generator=g))


def _flex(flex, q, k, v, block_mask):
    # (compiled flex on CPU cannot return the LSE; the LSE is checked against the dense reference elsewhere)
    out = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask, enable_gqa=True)
    return out.transpose(1, 2)


def test_flashmask_indices_to_flex(flex):
    # shared question (causal, n=1) with a mask per KV head, converted without N^2 work
    q, k, v = _qkv(0)
    idx = torch.cat([shared_question_mask([(40, [50, 60, 30]), (20, [56])]),
                     shared_question_mask([(100, [100]), (30, [26])])], 1)
    out = flashmask_attention(q, k, v, idx, causal=True)
    bm = to_flex_block_mask(idx, causal=True, num_heads=H)
    want = _flex(flex, q, k, v, bm)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


def test_flex_mask_mod_to_flashmask_indices(flex):
    # a mask written for FlexAttention (global tokens + bidirectional window + document boundary)
    doc = torch.tensor([0] * 100 + [1] * 156)

    def mask_mod(b, h, q_idx, kv_idx):
        window = (kv_idx - q_idx).abs() <= 16
        glob = (kv_idx < 4) | (q_idx < 4)
        return (window | glob) & (doc[q_idx] == doc[kv_idx])

    q, k, v = _qkv(1)
    dense = flex_mod.create_mask(mask_mod, None, None, S, S, device="cpu")
    idx = from_dense_mask(dense, causal=False)
    assert idx.shape == (1, 1, S, 4)
    out = flashmask_attention(q, k, v, idx, causal=False)
    bm = flex_mod.create_block_mask(mask_mod, None, None, S, S, device="cpu")
    want = _flex(flex, q, k, v, bm)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
