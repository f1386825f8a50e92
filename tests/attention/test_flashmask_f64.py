"""flashmask_attention's output, log-sum-exp and dq/dk/dv on the CPU paths against an independent float64
reference (tests/attention/f64_reference.py: the dense mask decoded from docs/flashmask.md's index table, softmax
attention by plain torch autograd), for every mask constructor, random indices in each of the four index forms,
GQA/MQA with every mask-head count, and Sq != Sk. The constructors are also checked against what each mask
means in words (docs/flashmask.md section 2 and their docstrings), written here position by position."""

from __future__ import annotations

import pytest
import torch

from f64_reference import keep_for_heads, keep_from_indices, reference_with_grads
from oarlock.attention import flashmask_attention
from oarlock.attention import masks as M


def _segments(lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: the index of its segment and the segment's first position."""
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    first = torch.tensor([0] + lens[:-1]).cumsum(0)[seg]
    return seg, first


def _docs(s: int) -> list[int]:
    """Three or four documents covering ``s`` tokens (fewer when ``s`` is small)."""
    cuts = sorted({c for c in (s * 3 // 10, s * 5 // 10, s * 6 // 10) if 0 < c < s})
    return [b - a for a, b in zip([0] + cuts, cuts + [s])]


def _case(kind: str, s: int, batch: int):
    """``(indices or None, causal, window_size or None, meaning)`` for a square ``s x s`` problem; ``meaning``
    is the boolean ``[B or 1, 1, s, s]`` mask written from the words of the mask's definition (None where it has
    none besides its indices: random eviction, the random index forms)."""
    i = torch.arange(s).view(s, 1)
    j = torch.arange(s).view(1, s)
    below = j <= i
    w, left, right, g = max(1, s // 8), max(1, s // 6), max(1, s // 10), max(1, s // 16)
    docs = _docs(s)
    seg, first = _segments(docs)
    same = seg.view(s, 1) == seg.view(1, s)
    gen = torch.Generator().manual_seed(s)
    idx, causal, window = None, kind.startswith("causal") or kind in ("sliding_window", "window_causal",
                                                                     "shared_question", "qk_sparse",
                                                                     "random_eviction", "random_c1",
                                                                     "random_c2"), None
    if kind == "full":
        mean = torch.ones(s, s, dtype=torch.bool)
    elif kind == "causal_none":
        mean = below
    elif kind == "causal":
        idx, mean = M.causal_mask(s, batch_size=batch), below
    elif kind == "sliding_window":  # query i sees keys [i - w, i]
        idx, mean = M.sliding_window_mask(s, w, batch_size=batch), below & (j >= i - w)
    elif kind == "window_causal":
        window, mean = w, below & (j >= i - w)
    elif kind == "window_both":  # query i sees keys [i - left, i + right]
        window, mean = (left, right), (j >= i - left) & (j <= i + right)
    elif kind == "bidirectional_window":
        idx = M.bidirectional_sliding_window_mask(s, left, right, batch_size=batch)
        mean = (j >= i - left) & (j <= i + right)
    elif kind == "causal_document":  # the second batch row packs other documents
        rows = [docs] + [[s - s // 3, s // 3] if s > 2 else [s]] * (batch - 1)
        idx = M.causal_document_mask(rows, batch_size=batch)
        mean = torch.stack([below & (lambda sg: sg.view(s, 1) == sg.view(1, s))(_segments(r)[0]) for r in rows])
    elif kind == "document":
        idx, mean = M.document_mask(docs, batch_size=batch), same
    elif kind == "shared_question":  # one question, answers after it: an answer sees the question and itself
        qlen, answers = docs[0], docs[1:]
        idx = M.shared_question_mask([(qlen, answers)], batch_size=batch)
        mean = below & ((j < qlen) | same)
    elif kind == "global_sliding_window":  # the first g tokens see and are seen by all
        idx = M.global_sliding_window_mask(s, g, left, right, batch_size=batch)
        mean = (j < g) | (i < g) | ((j >= i - left) & (j <= i + right))
    elif kind == "prefix_lm_causal":  # the first s // 4 tokens bidirectional, the rest causal
        idx, mean = M.prefix_lm_causal_mask(s, s // 4, batch_size=batch), (j < s // 4) | below
    elif kind == "prefix_lm_document":  # per document: a third of it is a bidirectional prefix
        pre = [max(1, d // 3) for d in docs]
        idx = M.prefix_lm_document_mask(list(zip(pre, docs)), batch_size=batch)
        pre_end = first + torch.tensor(pre)[seg]
        mean = same & ((j < pre_end.view(1, s)) | below)
    elif kind == "qk_sparse":  # queries inside a key block [o, o + n) see only keys before it
        blocks = [(s // 8, s // 16 + 1), (s // 2, s // 5)]
        idx = M.qk_sparse_mask(s, blocks, batch_size=batch)
        mean = below.clone()
        for o, n in blocks:
            mean &= ~((i >= o) & (i < o + n) & (j >= o) & (j < o + n))
    elif kind == "causal_blockwise":  # each document causal alone; the last one sees everything before it
        idx = M.causal_blockwise_mask(docs, batch_size=batch)
        mean = below & (same | (i >= s - docs[-1]))
    elif kind == "random_eviction":
        idx, mean = M.random_eviction_mask(s, batch_size=batch, generator=gen), None
    else:  # random indices in one of the four forms of the table: rows drawn in [0, s]
        n = {"random_c1": 1, "random_c2": 2, "random_n2": 2, "random_n4": 4}[kind]
        idx = torch.randint(0, s + 1, (batch, 1, s, n), generator=gen)
        if kind == "random_c2":
            idx = idx.sort(-1).values
        elif kind == "random_n4":
            idx = torch.cat([idx[..., :2].sort(-1).values, idx[..., 2:].sort(-1).values], -1)
        idx, mean = idx.to(torch.int32), None
    return idx, causal, window, (None if mean is None else mean.view(-1, 1, s, s))


CONSTRUCTED = ["full", "causal_none", "causal", "sliding_window", "window_causal", "window_both",
               "bidirectional_window", "causal_document", "document", "shared_question", "global_sliding_window",
               "prefix_lm_causal", "prefix_lm_document", "qk_sparse", "causal_blockwise"]
KINDS = CONSTRUCTED + ["random_eviction", "random_c1", "random_c2", "random_n2", "random_n4"]
WINDOWS = ("window_causal", "window_both")  # window_size is documented for square problems only


@pytest.mark.parametrize("s", [1, 2, 7, 37, 160])
@pytest.mark.parametrize("kind", [k for k in CONSTRUCTED if k not in ("full", "causal_none") + WINDOWS])
def test_constructors_mean_what_the_doc_says(kind, s):
    """Each constructor's indices, decoded by the doc's table, give the mask its definition describes."""
    idx, causal, _, mean = _case(kind, s, batch=2)
    got = keep_from_indices(idx, causal=causal, sq=s, sk=s)
    assert got.shape == (2, 1, s, s)
    bad = (got != mean).nonzero()
    assert bad.numel() == 0, f"{kind}: (batch, head, row, key) differing from the definition: {bad[:5].tolist()}"


def _inputs(b, sq, sk, h, hk, d, seed):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g).requires_grad_(True)  # noqa: E731
    return (make(b, sq, h, d), make(b, sk, hk, d), make(b, sk, hk, d), torch.randn(b, sq, h, d, generator=g),
            torch.randn(b, h, sq, generator=g))


# (batch, Sq, Sk, heads, kv heads, mask heads, softmax_scale)
SHAPES = [(2, 37, 37, 4, 2, 2, None), (2, 160, 160, 4, 2, 1, None), (1, 150, 150, 3, 1, 3, 0.3),
          (1, 7, 7, 2, 2, 1, None), (1, 48, 130, 4, 2, 1, None), (2, 130, 48, 2, 2, 2, None)]


@pytest.mark.parametrize("path", ["lse", "plain"])
@pytest.mark.parametrize("kind,shape", [(k, s) for k in KINDS for s in SHAPES if k not in WINDOWS or s[1] == s[2]],
                         ids=lambda v: v if isinstance(v, str) else "b{}-q{}-k{}-h{}-kv{}-m{}-sc{}".format(*v))
def test_against_float64_reference(kind, shape, path):
    """``path="lse"``: ``return_softmax_lse=True`` (the tiled kernel), out, lse and the gradients of
    ``sum(out * dout) + sum(lse * dlse)``; ``"plain"``: the default call (dense SDPA at these sizes), out and the
    gradients of ``sum(out * dout)``."""
    b, sq, sk, h, hk, hm, scale = shape
    q, k, v, dout, dlse = _inputs(b, sq, sk, h, hk, 32, seed=sq * 1000 + sk)
    if sq == sk:
        idx, causal, window, mean = _case(kind, sk, b)
    else:  # indices of the key length; rows past Sq never occur, the causal diagonal is bottom-right aligned
        idx, causal, window, _ = _case(kind, sk, b)
        mean = None
    if idx is not None and idx.shape[1] != hm:
        idx = idx.expand(-1, hm, -1, -1).contiguous()
    keep = mean if window is not None else keep_from_indices(idx, causal=causal, sq=sq, sk=sk)
    keep = keep_for_heads(keep, h, hk)
    ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, keep, dout, dlse if path == "lse" else None,
                                                       scale=scale)
    res = flashmask_attention(q, k, v, idx, causal=causal, window_size=window, softmax_scale=scale,
                              return_softmax_lse=path == "lse")
    if path == "lse":
        out, lse = res
        grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
        assert lse.shape == (b, h, sq)
        torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-5)
    else:
        out = res
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert out.shape == (b, sq, h, 32) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-5)
    for name, got, want in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4, msg=lambda m: f"d{name}: {m}")
