"""Paddle's ``test/legacy_test/test_flashmask.py`` grid (spec section 5.1), sizes reduced to fit CPU CI.

Inputs U[0, 1) for q, k, v, dO (no GQA), reference = fp32 math attention with the additive mask, tolerances
as upstream: bf16 rtol = atol = 1e-2; fp16 atol = 1e-3, rtol = 5e-3. Mask generators follow the upstream ones.
"""

from __future__ import annotations

import pytest
import torch

from oarlock.attention import causal_document_mask, flashmask_attention
from oarlock.attention.masks import canonicalize
from oarlock.attention.reference import attention_reference


def random_causal(b, hm, s, g):
    j = torch.arange(s)
    lts = torch.maximum(j + 1, torch.randint(0, s, (b, hm, s), generator=g))
    return lts.unsqueeze(-1).to(torch.int32)


def random_noncausal(b, hm, s, g):
    j = torch.arange(s)
    lts = torch.maximum(j + 1, torch.randint(0, s, (b, hm, s), generator=g))
    ute = torch.minimum(j, torch.randint(0, s, (b, hm, s), generator=g))
    return torch.stack([lts, ute], -1).to(torch.int32)


def random_document(b, hm, s, g):
    cuts = sorted(set(torch.randint(1, s, (s // 10,), generator=g).tolist()))
    lens = [e - a for a, e in zip([0] + cuts, cuts + [s])]
    return causal_document_mask(lens, batch_size=b).expand(b, hm, s, 1).contiguous()


def random_sliding(b, hm, s, g):
    w = int(torch.randint(1, 50, (1,), generator=g))
    j = torch.arange(s)
    return torch.clamp(j + w, max=s).view(1, 1, s, 1).expand(b, hm, s, 1).to(torch.int32).contiguous()


def global_sliding(b, hm, s, g):
    """Upstream generator: w global tokens and a window of w (w ~ U[1, 50), <= S/4)."""
    w = min(int(torch.randint(1, 50, (1,), generator=g)), s // 4)
    j = torch.arange(s)
    lts = torch.full((s,), s)
    lte = torch.full((s,), s)
    uts = torch.zeros(s, dtype=torch.long)
    ute = torch.zeros(s, dtype=torch.long)
    mid = (j >= w) & (j < s - w)
    lts = torch.where(mid, j + w, lts)
    body = j >= 2 * w
    uts = torch.where(body, torch.full_like(j, w), uts)
    ute = torch.where(body, j - w + 1, ute)
    lts = torch.maximum(lts, j + 1)
    return torch.stack([lts, lte, uts, ute], -1).view(1, 1, s, 4).expand(b, hm, s, 4).to(torch.int32).contiguous()


# name, (B, S, H, D) reduced from upstream, dtypes, causal, mask heads = H?, generator
GRID = [
    ("API1", (2, 128, 8, 128), [torch.float16, torch.bfloat16], True, False, random_causal),
    ("API2", (2, 256, 4, 128), [torch.float16, torch.bfloat16], False, False, random_noncausal),
    ("API3", (1, 512, 4, 96), [torch.float16, torch.bfloat16], True, True, random_causal),
    ("API4", (1, 1024, 2, 96), [torch.float16], True, True, random_document),
    ("API5", (1, 1024, 2, 96), [torch.float16], True, True, random_sliding),
    ("API6", (1, 512, 4, 96), [torch.float16], False, True, global_sliding),
]


@pytest.mark.parametrize("name,shape,dtype,causal,per_head,gen",
                         [(n, s, dt, c, p, gen) for n, s, dts, c, p, gen in GRID for dt in dts],
                         ids=lambda x: x if isinstance(x, str) else None)
def test_paddle_legacy_grid(name, shape, dtype, causal, per_head, gen):
    b, s, h, d = shape
    g = torch.Generator().manual_seed(2024)
    q, k, v, dout = (torch.rand(b, s, h, d, generator=g).to(dtype) for _ in range(4))
    idx = gen(b, h if per_head else 1, s, g)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    out = flashmask_attention(q, k, v, idx, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q32, k32, v32 = (x.detach().float().requires_grad_(True) for x in (q, k, v))
    ref, _ = attention_reference(q32, k32, v32, canonicalize(idx, causal=causal, seqlen_q=s), causal=causal)
    rgrads = torch.autograd.grad(ref, (q32, k32, v32), dout.float())
    tol = dict(atol=1e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-3, rtol=5e-3)
    for got, want in zip([out, *grads], [ref, *rgrads]):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, **tol)
