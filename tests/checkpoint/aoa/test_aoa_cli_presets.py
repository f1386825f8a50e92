"""CLI: ``oarlock convert --preset`` (real MiniLM and a transformers-built Llama), ``oarlock aoa explain --preset
--tp --only``, and bad AOA config files (binary, empty, deeply nested, huge ranges): exit 2, one line."""

import json

import pytest
import torch
from safetensors import safe_open

from oarlock.cli import main
from testkit import st_tensors


def test_convert_preset_minilm_tp2_and_back(minilm_dir, tmp_path, capsys):
    """The real all-MiniLM-L6-v2 (BERT) through the bert preset: fused QKV at TP=2, then back, bit-identical."""
    assert main(["convert", str(minilm_dir), str(tmp_path / "tp2"), "--preset", "minilm", "--tp", "2"]) == 0
    ref = st_tensors(minilm_dir)
    # rank 0 holds the first 6 heads' [q_i; k_i; v_i] row blocks of layer 3 (plain torch reference)
    p = "encoder.layer.3.attention.self."
    q, k, v = (ref[p + n + ".weight"].chunk(12) for n in ("query", "key", "value"))
    want = torch.cat([x for i in range(6) for x in (q[i], k[i], v[i])])
    with safe_open(str(tmp_path / "tp2" / "rank-00000.safetensors"), "pt") as fh:
        assert torch.equal(fh.get_tensor(p + "qkv_proj.weight"), want)
    assert main(["convert", str(tmp_path / "tp2"), str(tmp_path / "back"), "--preset", "bert", "--to", "hf"]) == 0
    got = st_tensors(tmp_path / "back")
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    capsys.readouterr()
    # the wrong preset: one line naming both model types, exit 2
    assert main(["convert", str(minilm_dir), str(tmp_path / "x"), "--preset", "gpt2", "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "preset 'gpt2' is for model_type gpt2, but the config says model_type='bert'" in err
    assert not (tmp_path / "x").exists()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=True)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("llama") / "hf"
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def test_explain_preset_tp_and_only(tiny_llama, capsys):
    assert main(["aoa", "explain", "--preset", "smollm2", "--source", str(tiny_llama), "--tp", "3",
                 "--only", "layers.1.mlp.*"]) == 0
    out = capsys.readouterr().out
    # only layer 1's MLP: its statements, its two keys, nothing else
    assert "layers.0." not in out and "self_attn" not in out
    assert "# 2 destination key(s)" in out
    assert "model.layers.1.mlp.gate_proj.weight, model.layers.1.mlp.up_proj.weight -> " in out or \
        "model.layers.1.mlp.gate_proj.weight -> fused_ffn_tmp.GATE_0" in out
    # the TP=3 blocked gate/up: [gate_0, up_0, gate_1, up_1, gate_2, up_2], 16 rows each, rank r rows 32r:32r+32
    block = out.split("\nlayers.1.mlp.gate_up_proj.weight  [96, 48] float32\n")[1].splitlines()
    assert block[0] == "  TP 3 on axis 0, fused_ffn blocks for tp=3: rank 0: 0:32; rank 1: 32:64; rank 2: 64:96"
    g, u = "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"
    assert block[1:7] == [f"  [0:16, 0:48] <- {g}[0:16, 0:48]", f"  [16:32, 0:48] <- {u}[0:16, 0:48]",
                          f"  [32:48, 0:48] <- {g}[16:32, 0:48]", f"  [48:64, 0:48] <- {u}[16:32, 0:48]",
                          f"  [64:80, 0:48] <- {g}[32:48, 0:48]", f"  [80:96, 0:48] <- {u}[32:48, 0:48]"]
    # without --tp: the degree-1 layout [gate | up]
    assert main(["aoa", "explain", "--preset", "llama", "--source", str(tiny_llama), "--only",
                 "layers.1.mlp.gate_up_proj.weight"]) == 0
    out = capsys.readouterr().out
    assert f"  [0:48, 0:48] <- {g}[0:48, 0:48]\n  [48:96, 0:48] <- {u}[0:48, 0:48]" in out
    # --only filters the unused / missing sections too
    assert main(["aoa", "explain", "--preset", "llama", "--source", str(tiny_llama), "--only", "nothing*"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == ["# 0 primitive statement(s) for keys matching 'nothing*'", "# 0 destination key(s)"]


@pytest.mark.parametrize("content,needle", [
    (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", "not a text AOA config"),
    (b"", "holds no statements"),
    (b"# only a comment\n\n", "holds no statements"),
    (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
    (b'{"aoa_statements": [1, 2]}', "expected {\"aoa_statements\""),
    (b"w[0:1000000000] -> v[0:1000000000], axis=0", "expands to 1000000000 names, more than the limit"),
    (b"q, k, v -> x, fused_qkv, num_heads=1000000000, num_key_value_groups=1, axis=0", "more than the limit"),
])
def test_explain_bad_config_files(minilm_dir, tmp_path, capsys, content, needle):
    cfg = tmp_path / "bad.aoa"
    cfg.write_bytes(content)
    assert main(["aoa", "explain", str(cfg), "--source", str(minilm_dir)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    if "limit" not in needle:
        assert str(cfg) in err and len(err.strip().splitlines()) == 1
