"""FlashMask as a transformers attention implementation: tiny Llama and Qwen2 models on packed batches give the
loss and gradients of transformers' own SDPA attention with the dense block-diagonal causal mask."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from oarlock.attention import AttentionInputError  # noqa: E402
from oarlock.attention import flashmask as flashmask_module  # noqa: E402
from oarlock.attention import hf as fm_hf  # noqa: E402

S = 48
DOCS = [[10, 20, 18], [30, 18]]  # packed documents per row


def _position_ids():
    return torch.tensor([sum([list(range(n)) for n in row], []) for row in DOCS])


def _dense_mask():
    """bool [B, 1, S, S]: causal inside each document, written out element by element."""
    m = torch.zeros(len(DOCS), 1, S, S, dtype=torch.bool)
    for b, row in enumerate(DOCS):
        start = 0
        for n in row:
            for i in range(start, start + n):
                m[b, 0, i, start:i + 1] = True
            start += n
    return m


def _model(kind, impl):
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    model.set_attn_implementation(impl)
    return model.float()


@pytest.mark.parametrize("kernel", [True, False], ids=["tiled-kernel", "small-S-dense-path"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_batch_matches_sdpa_with_the_dense_mask(kind, kernel, monkeypatch):
    if kernel:  # at S=48 flashmask_attention would take its SDPA path: force the tiled CPU kernel
        monkeypatch.setattr(flashmask_module, "DENSE_DISPATCH_MAX_SCORES", 0)
    name = fm_hf.register()
    assert name == "oarlock_mask"
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, S), generator=g)
    pos = _position_ids()
    ours, ref = _model(kind, name), _model(kind, "sdpa")
    ref.load_state_dict(ours.state_dict())
    out = ours(input_ids=ids, position_ids=pos, labels=ids)
    want = ref(input_ids=ids, position_ids=pos, labels=ids, attention_mask=_dense_mask())
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    want.loss.backward()
    for (n, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"grad of {n}: {m}")
    # documents really are separated: the same model without the packing positions differs
    plain = ours(input_ids=ids, labels=ids)
    assert not torch.allclose(plain.logits, out.logits, atol=1e-3)


def test_cu_seqlens_give_the_same_mask_as_position_ids():
    name = fm_hf.register()
    model = _model("llama", name)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (1, S), generator=g)
    pos = _position_ids()[:1]
    cu = torch.tensor([0, 10, 30, 48], dtype=torch.int32)
    by_pos = model(input_ids=ids, position_ids=pos).logits
    by_cu = model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=20,
                  max_length_k=20).logits
    torch.testing.assert_close(by_cu, by_pos, rtol=0, atol=0)
    assert fm_hf.document_ids_from_cu_seqlens(cu, S).tolist() == [[0] * 10 + [1] * 20 + [2] * 18]


def test_names_with_flash_are_refused():
    with pytest.raises(AttentionInputError, match="contains 'flash'"):
        fm_hf.register("my_flashmask")
