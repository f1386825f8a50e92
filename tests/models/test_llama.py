"""oarlock.models.llama against HF transformers (the independent reference) on tiny random configs."""

import math
import re

import pytest
import torch

from oarlock.errors import OarlockError
from oarlock.models.llama import (Llama, LlamaConfig, _flashmask_attention_fallback, causal_document_mask,
                                  convert_hf_state_dict, document_position_ids, ffn_fused_permutation, fuse_qkv,
                                  hf_aoa_config, hf_export_aoa_config, qkv_fused_order, split_qkv,
                                  to_hf_state_dict)

transformers = pytest.importorskip("transformers")


def _randomize(model, std=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model.eval()


def _hf_llama(tied, bias, vocab=101):
    hc = transformers.LlamaConfig(vocab_size=vocab, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                  num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=tied,
                                  attention_bias=bias, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    return _randomize(transformers.LlamaForCausalLM(hc))


@pytest.mark.parametrize("tied,bias", [(False, False), (True, True)])
def test_logits_and_keys_match_hf_llama(tied, bias):
    hf = _hf_llama(tied, bias)
    cfg = LlamaConfig.from_hf(hf.config)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rope_theta, cfg.tie_word_embeddings) == \
        (6, 2, 5000.0, tied)
    model = Llama(cfg).eval()
    model.load_state_dict(convert_hf_state_dict(hf.state_dict(), cfg), strict=True)
    ids = torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-5, atol=2e-5)
    # Tied models have no lm_head key, like HF files; the export is the exact inverse.
    assert ("lm_head.weight" in model.state_dict()) is not tied
    back = to_hf_state_dict(model.state_dict(), cfg)
    ref = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert set(back) == set(ref)
    for k in ref:
        assert torch.equal(back[k], ref[k]), k


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_moe_logits_match_hf(kind):
    if kind == "mixtral":
        hc = transformers.MixtralConfig(vocab_size=101, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
                                        num_attention_heads=6, num_key_value_heads=2, num_local_experts=5,
                                        num_experts_per_tok=2, head_dim=8)
        hf = _randomize(transformers.MixtralForCausalLM(hc))
    else:  # shared expert with sigmoid gate, q/k/v bias, top-k weights not renormalised
        hc = transformers.Qwen2MoeConfig(vocab_size=101, hidden_size=48, intermediate_size=64,
                                         moe_intermediate_size=24, shared_expert_intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                                         num_experts=6, num_experts_per_tok=3, norm_topk_prob=False)
        hf = _randomize(transformers.Qwen2MoeForCausalLM(hc))
    cfg = LlamaConfig.from_hf(hf.config)
    assert cfg.is_moe and cfg.num_experts == (5 if kind == "mixtral" else 6)
    model = Llama(cfg).eval()
    model.load_state_dict(convert_hf_state_dict(hf.state_dict(), cfg), strict=True)
    assert "layers.1.mlp.experts.4.gate_up_proj.weight" in model.state_dict()
    ids = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-5, atol=2e-5)


def test_packed_documents_equal_separate_hf_runs():
    """A packed row with a causal document mask gives, per document, HF's logits for that document alone."""
    hf = _hf_llama(False, False)
    cfg = LlamaConfig.from_hf(hf.config)
    model = Llama(cfg).eval()
    model.load_state_dict(convert_hf_state_dict(hf.state_dict(), cfg))
    lengths = [5, 1, 7, 3]
    ids = torch.randint(0, 101, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).unsqueeze(0)
    with torch.no_grad():
        packed = model(ids, document_ids=doc)
        start = 0
        for n in lengths:
            alone = hf(ids[:, start:start + n]).logits
            torch.testing.assert_close(packed[:, start:start + n], alone, rtol=1e-5, atol=2e-5)
            start += n


def test_document_mask_and_positions_follow_the_spec_example():
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2, 2, 2]])  # spec: docs 4,3,3 -> [4,4,4,4,7,7,7,10,10,10]
    mask = causal_document_mask(doc)
    assert mask.dtype == torch.int32 and mask.shape == (1, 1, 10, 1)
    assert mask.flatten().tolist() == [4, 4, 4, 4, 7, 7, 7, 10, 10, 10]
    assert document_position_ids(doc).tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]]


def _dense_reference(q, k, v, idx, causal):
    """Per-element loop over the FlashMask table (flashmask.md 1.3), then softmax attention in float64."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    out = torch.zeros(b, sq, h, d, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            mh = 0 if idx is None or idx.shape[1] == 1 else hi // (h // idx.shape[1])
            for i in range(sq):
                scores = []
                for j in range(sk):
                    m = causal and j > i + (sk - sq)
                    if idx is not None:
                        e = idx[bi, mh, j].tolist()
                        if causal and len(e) == 1:
                            m = m or i >= e[0]
                        elif causal:
                            m = m or e[0] <= i < e[1]
                        elif len(e) == 2:
                            m = m or i >= e[0] or i < e[1]
                        else:
                            m = m or e[0] <= i < e[1] or e[2] <= i < e[3]
                    s = float(q[bi, i, hi].double() @ k[bi, j, hi // (h // hk)].double()) / math.sqrt(d)
                    scores.append(-math.inf if m else s)
                t = torch.tensor(scores, dtype=torch.float64)
                if torch.isinf(t).all():
                    continue  # fully masked row -> zeros
                out[bi, i, hi] = torch.softmax(t, 0) @ v[bi, :, hi // (h // hk)].double()
    return out


@pytest.mark.parametrize("causal,n", [(True, 1), (True, 2), (False, 2), (False, 4)])
def test_fallback_attention_matches_dense_table(causal, n):
    g = torch.Generator().manual_seed(n + 10 * causal)
    b, s, h, hk, d = 2, 7, 4, 2, 8
    q, k, v = (torch.randn(b, s, x, d, generator=g) for x in (h, hk, hk))
    idx = torch.randint(0, s + 1, (b, hk, s, n), generator=g, dtype=torch.int32)
    if n == 4:
        idx = torch.sort(idx, dim=-1).values
    out = _flashmask_attention_fallback(q, k, v, idx, causal=causal)
    torch.testing.assert_close(out.double(), _dense_reference(q, k, v, idx, causal), rtol=1e-5, atol=1e-5)


def test_fused_layouts_follow_the_spec_examples():
    # flexcheckpoint.md 2.5(g), H=8, G=2: Q0..Q3, K0, V0, Q4..Q7, K1, V1
    names = [f"{n.upper()}{i}" for n, i in qkv_fused_order(8, 2)]
    assert names == ["Q0", "Q1", "Q2", "Q3", "K0", "V0", "Q4", "Q5", "Q6", "Q7", "K1", "V1"]
    q, k, v = torch.randn(8 * 3, 5), torch.randn(2 * 3, 5), torch.randn(2 * 3, 5)
    fused = fuse_qkv(q, k, v, 8, 2)
    assert torch.equal(fused[4 * 3:5 * 3], k[:3]) and torch.equal(fused[6 * 3:7 * 3], q[4 * 3:5 * 3])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, 8, 2), (q, k, v)))
    # 2.5(i), n=4 pieces, T=4: GATE_0, UP_0, GATE_1, UP_1, ... ; I=8 so pieces are 2 rows each.
    perm = ffn_fused_permutation(8, 4)
    assert perm.tolist() == [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]
    with pytest.raises(OarlockError, match="not divisible by tp=3"):
        ffn_fused_permutation(8, 3)


def test_aoa_statements_name_every_key():
    """Every oarlock key appears on the right of the import config and on the left of the export config."""
    cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=4, num_experts=3, shared_expert_intermediate_size=8,
                      qkv_bias=True)
    imp, exp = " ".join(hf_aoa_config(cfg)), " ".join(hf_export_aoa_config(cfg))
    assert "fused_qkv, num_heads=9, num_key_value_groups=3, axis=0" in imp
    for key in Llama(cfg).state_dict():
        templ = re.sub(r"experts\.\d+\.", "experts.$EXPERT_ID.", re.sub(r"^layers\.\d+\.", "layers.$LAYER_ID.", key))
        assert f"-> {templ}" in imp or f", {templ}" in imp or templ == "lm_head.weight", key
        assert f"{templ} ->" in exp, key


def test_bad_config_errors_name_the_field():
    with pytest.raises(OarlockError, match="num_attention_heads=6 is not a multiple of num_key_value_heads=4"):
        LlamaConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(OarlockError, match="num_experts_per_tok=5"):
        LlamaConfig(num_experts=4, num_experts_per_tok=5)
    cfg = LlamaConfig(vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1)
    sd = to_hf_state_dict(Llama(cfg).state_dict(), cfg)
    del sd["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(OarlockError, match="layers.0.mlp.up_proj.weight"):
        convert_hf_state_dict(sd, cfg)
