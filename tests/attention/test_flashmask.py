"""flashmask_attention (CPU tiled back end) against the dense fp32 reference and against SDPA."""

from __future__ import annotations

import math

import pytest
import torch

from attention_cases import MASK_TYPES, make_mask
from oarlock.attention import AttentionInputError, causal_document_mask, flashmask_attention, to_dense_mask
from oarlock.attention import flashmask as flashmask_module
from oarlock.attention.masks import canonicalize, window_to_indices
from oarlock.attention.reference import attention_reference


@pytest.fixture(autouse=True)
def _tiled_kernel(monkeypatch):
    """These tests are about the tiled kernel: keep small sequences off the dense SDPA path (that path is
    checked against the kernel in test_cp_attention.py)."""
    monkeypatch.setattr(flashmask_module, "DENSE_DISPATCH_MAX_SCORES", 0)


def _inputs(b, sq, sk, h, hk, d, dtype=torch.float32, seed=0, dv=None):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype).requires_grad_(True)  # noqa: E731
    return mk(b, sq, h, d), mk(b, sk, hk, d), mk(b, sk, hk, dv or d), torch.randn(b, sq, h, dv or d, generator=g)


def _reference(q, k, v, idx, causal, window, sq, **kw):
    if window is not None:
        idx = window_to_indices(window, causal=causal, batch_size=q.shape[0], seqlen_q=sq, seqlen_k=k.shape[1])
    canon = None if idx is None else canonicalize(idx, causal=causal, seqlen_q=sq)
    return attention_reference(q, k, v, canon, causal=causal, **kw)


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout.to(out.dtype))


def _check_against_reference(kind, b, sq, sk, h, hk, hm, d=32, atol=2e-5):
    q, k, v, dout = _inputs(b, sq, sk, h, hk, d, seed=sq + sk)
    idx, causal, window = make_mask(kind, sk, batch=b, kv_heads=hk, mask_heads=hm)
    out, lse = flashmask_attention(q, k, v, idx, causal=causal, window_size=window, return_softmax_lse=True)
    ref, ref_lse = _reference(q, k, v, idx, causal, window, sq)
    assert out.shape == (b, sq, h, d) and out.dtype == q.dtype
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, ref, atol=atol, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=atol, rtol=1e-4)
    for got, want in zip(_grads(out, (q, k, v), dout), _grads(ref, (q, k, v), dout)):
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got, want, atol=5 * atol, rtol=1e-4)


@pytest.mark.parametrize("kind", MASK_TYPES)
@pytest.mark.parametrize("seqlen", [1, 7, 127, 129, 1000])
def test_every_mask_forward_and_grads(kind, seqlen):
    # GQA (4 query heads on 2 KV heads), two batch rows, mask heads alternate between 1 and Hk.
    hm = 2 if kind == "random_eviction" or seqlen % 2 else 1
    _check_against_reference(kind, 2, seqlen, seqlen, 4, 2, hm)


@pytest.mark.parametrize("kind", ["causal_document", "document", "global_sliding_window", "causal_none",
                                  "qk_sparse", "prefix_lm_document", "full"])
@pytest.mark.parametrize("sq,sk", [(128, 256), (256, 132), (61, 200), (300, 64)])
def test_seqlen_q_differs_from_seqlen_k(kind, sq, sk):
    # bottom-right causal alignment; indices clamp to [0, Sq]
    _check_against_reference(kind, 1, sq, sk, 2, 1, 1)


@pytest.mark.parametrize("h,hk,hm", [(6, 1, 1), (6, 3, 3), (16, 1, 1), (2, 2, 2)])
def test_gqa_ratios_and_mask_heads(h, hk, hm):
    _check_against_reference("random_eviction", 1, 200, 200, h, hk, hm, d=16)
    _check_against_reference("causal_document", 1, 200, 200, h, hk, hm, d=16)


def test_fully_masked_rows_give_zero_output_and_gradient():
    sq = sk = 300
    q, k, v, dout = _inputs(1, sq, sk, 2, 2, 16)
    idx = causal_document_mask([100, 150, 50])
    idx[..., 100:250, 0] = 0  # keys 100..249 hidden from every row: rows 100..249 see nothing
    out, lse = flashmask_attention(q, k, v, idx, causal=True, return_softmax_lse=True)
    dq, dk, dv = _grads(out, (q, k, v), dout)
    assert torch.all(out[:, 100:250] == 0) and torch.all(dq[:, 100:250] == 0)
    assert torch.all(dk[:, 100:250] == 0) and torch.all(dv[:, 100:250] == 0)
    assert torch.all(torch.isneginf(lse[:, :, 100:250])) and torch.isfinite(lse[:, :, :100]).all()
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t).all()
    ref, _ = _reference(q, k, v, idx, True, None, sq)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    # Sq > Sk with bottom-right causal: the first Sq - Sk rows see no key at all
    q, k, v, dout = _inputs(1, 50, 20, 1, 1, 8)
    out = flashmask_attention(q, k, v, causal=True)
    dq, _, _ = _grads(out, (q, k, v), dout)
    assert torch.all(out[:, :30] == 0) and torch.all(dq[:, :30] == 0) and torch.isfinite(out).all()


def _lowp_reference(q, k, v, keep, scale):
    """Attention computed in the low-precision dtype itself (the FA-repo tolerance rule's ``ref16``): K scaled
    instead of Q, so rounding differs from the fp32 reference."""
    h, hk = q.shape[2], k.shape[2]
    qt = q.transpose(1, 2)
    kt = (k * scale).transpose(1, 2).repeat_interleave(h // hk, 1)
    vt = v.transpose(1, 2).repeat_interleave(h // hk, 1)
    s = (qt @ kt.transpose(-1, -2)).masked_fill(~keep, float("-inf"))
    p = torch.softmax(s.float(), -1).nan_to_num(0.0).to(q.dtype)
    return (p @ vt).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["causal_document", "global_sliding_window", "shared_question"])
def test_low_precision_tolerance_rule(dtype, kind):
    """Spec 5.2: max|out - ref32| <= 2 max|ref16 - ref32| + 2 eps(ref32), same for dq, dk, dv."""
    b, s, h, hk, d = 1, 257, 4, 2, 64
    q, k, v, dout = _inputs(b, s, s, h, hk, d, dtype=dtype, seed=3)
    idx, causal, _ = make_mask(kind, s, batch=b)
    out = flashmask_attention(q, k, v, idx, causal=causal)
    assert out.dtype == dtype
    q32, k32, v32 = (x.detach().float().requires_grad_(True) for x in (q, k, v))
    ref32, _ = _reference(q32, k32, v32, idx, causal, None, s)
    keep = to_dense_mask(idx, causal=causal, seqlen_q=s)
    ref16 = _lowp_reference(q, k, v, keep, 1 / math.sqrt(d))
    got = [out] + list(_grads(out, (q, k, v), dout))
    want32 = [ref32] + list(_grads(ref32, (q32, k32, v32), dout))
    low = [ref16] + list(_grads(ref16, (q, k, v), dout))
    for name, g_, w_, l_ in zip(["out", "dq", "dk", "dv"], got, want32, low):
        eps = ((w_ + 0.3 - 0.3) - w_).abs().max()
        bound = 2 * (l_.float() - w_).abs().max() + 2 * eps
        err = (g_.float() - w_).abs().max()
        assert err <= bound, f"{name}: {err} > {bound}"


def test_matches_sdpa_with_dense_bool_mask():
    b, s, h, hk, d = 2, 333, 4, 4, 32
    q, k, v, _ = _inputs(b, s, s, h, hk, d, seed=5)
    for kind in ["causal_document", "document", "global_sliding_window", "prefix_lm_document", "qk_sparse"]:
        idx, causal, _ = make_mask(kind, s, batch=b)
        keep = to_dense_mask(idx, causal=causal)
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep).transpose(1, 2)
        out = flashmask_attention(q, k, v, idx, causal=causal)
        torch.testing.assert_close(out, sdpa, atol=2e-5, rtol=1e-4, msg=kind)


def test_softmax_scale_value_head_dim_and_block_mask():
    b, s, h, d = 1, 300, 2, 16
    q, k, v, dout = _inputs(b, s, s, h, h, d, dv=24, seed=7)
    idx, causal, _ = make_mask("document", s, batch=b)
    bm = torch.ones(b, 1, 3, 3, dtype=torch.int32)
    bm[0, 0, 2, 0] = 0
    bm[0, 0, 1, 1] = 0
    out = flashmask_attention(q, k, v, idx, causal=causal, softmax_scale=0.3, block_mask=bm)
    ref, _ = _reference(q, k, v, idx, causal, None, s, softmax_scale=0.3, block_mask=bm)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    for got, want in zip(_grads(out, (q, k, v), dout), _grads(ref, (q, k, v), dout)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_dropout_is_random_unbiased_and_differentiable():
    q, k, v, dout = _inputs(1, 64, 64, 2, 2, 16)
    torch.manual_seed(0)
    a = flashmask_attention(q, k, v, causal=True, dropout=0.5)
    b = flashmask_attention(q, k, v, causal=True, dropout=0.5)
    assert not torch.equal(a, b)
    mean = torch.stack([flashmask_attention(q, k, v, causal=True, dropout=0.3) for _ in range(80)]).mean(0)
    ref = flashmask_attention(q, k, v, causal=True)
    assert (mean - ref).abs().mean() < 0.05
    assert all(torch.isfinite(g).all() for g in _grads(a, (q, k, v), dout))


def test_zero_size_inputs_return_zeros():
    q = torch.randn(2, 16, 8, 96, requires_grad=True)
    k = torch.randn(2, 0, 8, 96, requires_grad=True)
    v = torch.randn(2, 0, 8, 96, requires_grad=True)
    out = flashmask_attention(q, k, v)
    assert out.shape == (2, 16, 8, 96) and torch.all(out == 0)
    out.sum().backward()
    assert torch.all(q.grad == 0)
    q0 = torch.randn(0, 16, 8, 96)
    assert flashmask_attention(q0, q0, q0).shape == (0, 16, 8, 96)


def test_validation_errors_name_argument_and_shapes():
    q, k, v, _ = _inputs(2, 10, 10, 4, 2, 8)
    idx = causal_document_mask([4, 6], batch_size=2)
    with pytest.raises(AttentionInputError, match=r"query must be 4-D .*got shape \(10, 4, 8\)"):
        flashmask_attention(q[0], k, v)
    with pytest.raises(AttentionInputError, match=r"key/value heads"):
        flashmask_attention(q, torch.randn(2, 10, 3, 8), torch.randn(2, 10, 3, 8))
    with pytest.raises(AttentionInputError, match=r"startend_row_indices dtype must be int32, got torch.int64"):
        flashmask_attention(q, k, v, idx.long(), causal=True)
    with pytest.raises(AttentionInputError, match=r"seqlen_k=10.*n in \(2, 4\).*got shape \(2, 1, 10, 1\)"):
        flashmask_attention(q, k, v, idx, causal=False)
    with pytest.raises(AttentionInputError, match=r"mask_heads in \(1, 2, 4\).*got shape \(2, 3, 10, 1\)"):
        flashmask_attention(q, k, v, idx.expand(2, 3, 10, 1), causal=True)
    with pytest.raises(AttentionInputError, match=r"share a dtype.*torch.float16"):
        flashmask_attention(q, k.half(), v)
    with pytest.raises(AttentionInputError, match="window_size cannot be combined"):
        flashmask_attention(q, k, v, idx, causal=True, window_size=3)
    with pytest.raises(AttentionInputError, match=r"block_mask must be int32 of shape \(2, 1, 1, 1\)"):
        flashmask_attention(q, k, v, idx, causal=True, block_mask=torch.ones(2, 1, 2, 2, dtype=torch.int32))
    with pytest.raises(AttentionInputError, match="dtype must be float32, float16 or bfloat16, got torch.float64"):
        flashmask_attention(q.double(), k.double(), v.double())


def test_torch_compile_fullgraph_forward_and_backward():
    s = 200
    q, k, v, dout = _inputs(1, s, s, 4, 2, 16, seed=11)
    idx = causal_document_mask([80, 120])

    def f(q, k, v, idx):
        return flashmask_attention(q, k, v, idx, causal=True) * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    out = compiled(q, k, v, idx)
    ref = f(q, k, v, idx)
    torch.testing.assert_close(out, ref)
    for got, want in zip(_grads(out, (q, k, v), dout), _grads(ref, (q, k, v), dout)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("max_run", [64, 192])
@pytest.mark.parametrize("kind", ["shared_question", "global_sliding_window", "qk_sparse", "full"])
def test_online_softmax_over_several_steps(monkeypatch, kind, max_run):
    # Long rows are split into softmax steps of at most MAX_RUN keys (online rescaling between steps); force
    # that path at small sizes.
    from oarlock.attention import cpu

    monkeypatch.setattr(cpu, "MAX_RUN", max_run)
    _check_against_reference(kind, 1, 257, 257, 4, 2, 1)


def test_non_contiguous_inputs_and_partial_requires_grad():
    # e.g. q/k/v produced as [B, H, S, D] and transposed, as a model might pass them
    g = torch.Generator().manual_seed(9)
    qh, kh, vh = (torch.randn(2, n, 150, 16, generator=g) for n in (4, 2, 2))
    q = qh.transpose(1, 2).requires_grad_(True)
    k, v = kh.transpose(1, 2), vh.transpose(1, 2)
    assert not q.is_contiguous()
    idx = causal_document_mask([[50, 100], [150]], batch_size=2)
    out = flashmask_attention(q, k, v, idx, causal=True)
    ref, _ = _reference(q, k, v, idx, True, None, 150)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    dout = torch.randn_like(out)
    (dq,) = torch.autograd.grad(out, q, dout)
    (rdq,) = torch.autograd.grad(ref, q, dout)
    torch.testing.assert_close(dq, rdq, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("max_run", [None, 64])
def test_cpu_dropout_masks_rate_and_gradients(monkeypatch, max_run):
    if max_run:  # several softmax steps per query block: one dropout mask per step
        from oarlock.attention import cpu

        monkeypatch.setattr(cpu, "MAX_RUN", max_run)
    p_drop = 0.3
    s, d = 64, 64
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, s, 2, d, generator=g, dtype=torch.float32)
    k = torch.randn(1, s, 2, d, generator=g)
    v = torch.eye(s).view(1, s, 1, s).expand(1, s, 2, s).contiguous()  # V = I: out row = dropped weights
    idx = causal_document_mask([20, 44])
    torch.manual_seed(123)
    out = flashmask_attention(q, k, v, idx, causal=True, dropout=p_drop)
    torch.manual_seed(123)
    assert torch.equal(out, flashmask_attention(q, k, v, idx, causal=True, dropout=p_drop))  # seeded
    weights, _ = _reference(q, k, v, idx, True, None, s)  # undropped normalised weights (V = I)
    live = weights > 0
    kept = out[live] != 0
    assert abs(1 - kept.float().mean().item() - p_drop) < 0.05  # ~30 % of the visible weights dropped
    torch.testing.assert_close(out[live][kept], weights[live][kept] / (1 - p_drop), atol=1e-6, rtol=1e-5)
    assert torch.all(out[~live] == 0)

    # gradients of the seeded (hence deterministic) function vs central finite differences
    q, k, v, dout = _inputs(1, 300, 300, 4, 2, 16, seed=12)
    idx, causal, _ = make_mask("shared_question", 300)

    def f(q_, k_, v_):
        torch.manual_seed(7)
        return (flashmask_attention(q_, k_, v_, idx, causal=causal, dropout=0.2) * dout).sum()

    grads = torch.autograd.grad(f(q, k, v), (q, k, v))
    eps = 1e-2
    for which in range(3):
        dirs = [torch.zeros_like(x) for x in (q, k, v)]
        dirs[which] = torch.randn_like(dirs[which])
        with torch.no_grad():
            plus = f(*(x + eps * dx for x, dx in zip((q, k, v), dirs)))
            minus = f(*(x - eps * dx for x, dx in zip((q, k, v), dirs)))
        numeric = (plus - minus) / (2 * eps)
        analytic = (grads[which] * dirs[which]).sum()
        assert abs(numeric - analytic) <= 2e-2 * abs(analytic) + 1e-2, (which, numeric, analytic)
