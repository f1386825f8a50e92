"""Triton FlashMask kernels: forward and backward against the dense reference.

On a CPU-only machine the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set before the
kernels module is imported), which is slow: small sizes (S <= 256) and few cases. With CUDA the same cases
run on the GPU through the public ``flashmask_attention`` (which dispatches to Triton there).
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
_saved = os.environ.get("TRITON_INTERPRET")
if not CUDA:  # read when triton is imported and when the kernels are decorated; restored right after
    os.environ["TRITON_INTERPRET"] = "1"
try:
    pytest.importorskip("triton")
    from oarlock.attention import triton_kernels as T  # noqa: E402
finally:
    if _saved is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _saved

from attention_cases import make_mask  # noqa: E402
from oarlock.attention import flashmask_attention  # noqa: E402
from oarlock.attention.masks import canonicalize  # noqa: E402
from oarlock.attention.reference import attention_reference  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.cuda  # every case runs on the GPU when there is one (scripts/gpu_check.sh: -m cuda)


@pytest.fixture(autouse=True, scope="module")
def _interpreter_env():
    """Triton also reads TRITON_INTERPRET lazily at the first launch: keep it set while this module runs only."""
    if CUDA:
        yield
        return
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if _saved is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _saved

# (mask type, B, Sq, Sk, H, Hk, mask heads, D, dtype)
CASES = [
    ("causal_document", 1, 200, 200, 4, 2, 1, 32, torch.float32),
    ("global_sliding_window", 1, 130, 97, 2, 1, 1, 16, torch.float32),  # n=4, Sq > Sk, ragged tails
    ("random_eviction", 2, 96, 96, 2, 2, 2, 16, torch.float32),  # mask heads = KV heads
    ("shared_question", 1, 128, 128, 2, 2, 1, 64, torch.bfloat16),  # bf16 upcast in the interpreter
    ("prefix_lm_document", 1, 100, 140, 2, 1, 1, 24, torch.float16),  # D not a power of two, Sq < Sk
]


@pytest.mark.parametrize("kind,b,sq,sk,h,hk,hm,d,dtype", CASES)
def test_triton_forward_backward_match_reference(kind, b, sq, sk, h, hk, hm, d, dtype):
    g = torch.Generator().manual_seed(sq)
    q, k, v = (torch.randn(b, s, n, d, generator=g).to(dtype) for s, n in ((sq, h), (sk, hk), (sk, hk)))
    dout = torch.randn(b, sq, h, d, generator=g).to(dtype)
    idx, causal, _ = make_mask(kind, sk, batch=b, mask_heads=hm)
    canon = canonicalize(idx, causal=causal, seqlen_q=sq)
    if kind == "causal_document":  # plus a block of fully masked rows
        canon[:, :, 62:104, 0] = 0  # document 1 (keys 62..103) hidden: its rows see nothing
    q32, k32, v32 = (x.float().requires_grad_(True) for x in (q, k, v))
    ref, ref_lse = attention_reference(q32, k32, v32, canon, causal=causal)
    rgrads = torch.autograd.grad(ref, (q32, k32, v32), dout.float())
    scale = d ** -0.5
    dev = [x.to(DEVICE) for x in (q, k, v, dout)]
    out, lse = T.forward(*dev[:3], canon.to(DEVICE), causal=causal, scale=scale)
    grads = T.backward(dev[3], *dev[:3], out, lse, canon.to(DEVICE), causal=causal, scale=scale)
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.cpu().float(), ref, **tol)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-4, rtol=1e-4)
    for got, want in zip(grads, rgrads):
        assert got.dtype == dtype and torch.isfinite(got).all()
        torch.testing.assert_close(got.cpu().float(), want, **tol)
    if kind == "causal_document":
        assert torch.all(out[:, 62:104].cpu() == 0) and torch.all(grads[0][:, 62:104].cpu() == 0)


def test_triton_block_lists_skip_dead_tiles():
    # the compacted lists hold exactly the live tiles, partial ones encoded >= 0, unmasked ones < 0
    idx, causal, _ = make_mask("causal_document", 256)
    canon = canonicalize(idx, causal=causal, seqlen_q=256)
    vec, tr, tc, kv_list, kv_cnt, q_list, q_cnt = T._prepare(canon, 1, 256, 256, causal, None, torch.device("cpu"))
    from oarlock.attention.masks import classify_tiles

    cls = classify_tiles(canon, causal=True, seqlen_q=256, block_m=T.BLOCK_M, block_n=T.BLOCK_N)
    for i in range(tr):
        n = int(kv_cnt[0, 0, i])
        enc = kv_list[0, 0, i, :n].tolist()
        blocks = [e if e >= 0 else -e - 1 for e in enc]
        assert blocks == [j for j in range(tc) if cls[0, 0, i, j] != 0]
        assert all((e >= 0) == (cls[0, 0, i, j] == 1) for e, j in zip(enc, blocks))
    assert int(q_cnt.sum()) == int(kv_cnt.sum()) == int((cls != 0).sum())


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the interpreter cases above cover the kernels on CPU)")
def test_public_function_dispatches_to_triton_on_cuda():
    q, k, v = (torch.randn(2, 1000, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    idx, causal, _ = make_mask("causal_document", 1000, batch=2)
    out = flashmask_attention(q, k, v, idx.cuda(), causal=causal)
    ref, _ = attention_reference(q, k, v, canonicalize(idx.cuda(), causal=causal, seqlen_q=1000), causal=causal)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
    out.float().sum().backward()
    assert torch.isfinite(q.grad).all()
