"""oarlock.models.llama against HF transformers (the independent reference) on tiny random configs."""

import re

import pytest
import torch

from oarlock.errors import OarlockError
from oarlock.models.llama import (Llama, LlamaConfig, causal_document_mask,  # deprecated alias, checked below
                                  convert_hf_state_dict, document_position_ids, ffn_fused_permutation, fuse_qkv,
                                  hf_aoa_config, hf_export_aoa_config, qkv_fused_order, split_qkv,
                                  to_hf_state_dict)

from oarlock.attention import masks as attention_masks

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
    mask = attention_masks.causal_document_mask_from_ids(doc)
    assert mask.dtype == torch.int32 and mask.shape == (1, 1, 10, 1)
    with pytest.warns(DeprecationWarning, match="causal_document_mask_from_ids"):
        assert torch.equal(causal_document_mask(doc), mask)
    assert mask.flatten().tolist() == [4, 4, 4, 4, 7, 7, 7, 10, 10, 10]
    assert torch.equal(mask, attention_masks.causal_document_mask([4, 3, 3]))  # the attention package's builder
    assert document_position_ids(doc).tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]]


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


@pytest.mark.parametrize("kind", ["llama", "llama-tied-bias", "qwen2_moe"])
def test_aoa_import_and_export_equal_the_plain_converter(kind, tmp_path):
    """hf_aoa_config through FlexCheckpoint's AOA engine loads an HF directory exactly like
    convert_hf_state_dict; the export config and the reverse-mode import config both give to_hf_state_dict."""
    from oarlock.checkpoint import load_state_dict
    from oarlock.checkpoint.convert.full import full_state_dict

    if kind == "qwen2_moe":
        hc = transformers.Qwen2MoeConfig(vocab_size=101, hidden_size=48, intermediate_size=64,
                                         moe_intermediate_size=24, shared_expert_intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                                         num_experts=4, num_experts_per_tok=2)
        hf = _randomize(transformers.Qwen2MoeForCausalLM(hc))
    else:
        hf = _hf_llama(tied=kind != "llama", bias=kind != "llama")
    hf.save_pretrained(tmp_path)  # per-expert keys on disk
    cfg = LlamaConfig.from_hf(hf.config)
    model = Llama(cfg)
    report = load_state_dict(model.state_dict(), tmp_path, aoa_config=hf_aoa_config(cfg))
    assert not report.missing_keys and not report.unexpected_keys
    want = convert_hf_state_dict(hf.state_dict(), cfg)
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
    hf_keys = to_hf_state_dict(model.state_dict(), cfg)
    for config in (hf_export_aoa_config(cfg), {"aoa_statements": hf_aoa_config(cfg), "aoa_config_reverse": True}):
        out = dict(full_state_dict(model.state_dict(), config))
        assert set(out) == set(hf_keys)
        for k, v in hf_keys.items():
            assert torch.equal(out[k], v), k
