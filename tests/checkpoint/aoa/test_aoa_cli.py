"""``oarlock aoa explain`` on the real all-MiniLM-L6-v2 checkpoint with a fused-QKV config."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from oarlock.checkpoint.aoa import compile_aoa, shard_counts, source_specs
from oarlock.checkpoint.model.mapping import execute_on_full_tensors
from oarlock.checkpoint.storage import read_metadata
from oarlock.cli import main

P = "encoder.layer.$LAYER_ID.attention.self"
QKV = f"{P}.query.weight, {P}.key.weight, {P}.value.weight -> {P}.qkv.weight, axis=0"


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    return load_file(str(minilm_dir / "model.safetensors"))


def test_explain_fused_qkv_text_config(minilm_dir, tmp_path, capsys):
    cfg = tmp_path / "qkv.aoa"
    cfg.write_text(f"# fuse q, k, v per layer\n{QKV}\n\n")
    assert main(["aoa", "explain", str(cfg), "--source", str(minilm_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# 6 primitive statement(s)")
    for layer in range(6):
        q = f"encoder.layer.{layer}.attention.self"
        assert f"  {q}.query.weight, {q}.key.weight, {q}.value.weight -> {q}.qkv.weight, axis=0" in out
        block = out.split(f"\n{q}.qkv.weight  [1152, 384] float32\n")[1].splitlines()[:3]
        assert block == [f"  [0:384, 0:384] <- {q}.query.weight[0:384, 0:384]",
                         f"  [384:768, 0:384] <- {q}.key.weight[0:384, 0:384]",
                         f"  [768:1152, 0:384] <- {q}.value.weight[0:384, 0:384]"]
        assert f"\n{q}.query.weight  " not in out  # consumed by the fusion
    # untouched keys pass through by identity
    assert "\nembeddings.position_ids  [1, 512] int64\n  [0:1, 0:512] <- embeddings.position_ids[0:1, 0:512]" in out


def test_fused_qkv_config_numerically_on_minilm(minilm_dir, minilm):
    meta = read_metadata(minilm_dir)
    assert shard_counts(meta) == {k: 1 for k in meta.tensors}  # an HF directory: every tensor is one shard
    prog = compile_aoa({"aoa_statements": [QKV]}, source_specs(meta), source_shards=shard_counts(meta))
    out = execute_on_full_tensors(prog, minilm)
    assert len(out) == 104 - 6 * 3 + 6
    for layer in range(6):
        q = f"encoder.layer.{layer}.attention.self"
        ref = torch.cat([minilm[f"{q}.query.weight"], minilm[f"{q}.key.weight"], minilm[f"{q}.value.weight"]], 0)
        assert torch.equal(out[f"{q}.qkv.weight"], ref)
    assert torch.equal(out["embeddings.word_embeddings.weight"], minilm["embeddings.word_embeddings.weight"])


def test_explain_with_target_json_reverse_and_errors(minilm_dir, tmp_path, capsys):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"aoa_statements": [QKV]}))
    target = tmp_path / "keys.json"
    keys = {"encoder.layer.0.attention.self.qkv.weight": {"shape": [1152, 384], "dtype": "float32"},
            "classifier.weight": {"shape": [2, 384], "dtype": "float32"}}
    target.write_text(json.dumps(keys))
    assert main(["aoa", "explain", str(cfg), "--source", str(minilm_dir), "--target", str(target)]) == 0
    out = capsys.readouterr().out
    assert "# 1 destination key(s)" in out and "classifier.weight  MISSING" in out
    # a wrong destination shape: exit 2, the message shows both slice ranges and the statement
    keys["encoder.layer.0.attention.self.qkv.weight"]["shape"] = [384, 1152]
    target.write_text(json.dumps(keys))
    assert main(["aoa", "explain", str(cfg), "--source", str(minilm_dir), "--target", str(target)]) == 2
    err = capsys.readouterr().err
    assert "current model param slice range: (slice(0, 384), slice(0, 1152))" in err
    assert "preloaded weights param slice range: (slice(0, 1152), slice(0, 384))" in err
    assert "[statement] encoder.layer.$LAYER_ID.attention.self.query.weight" in err
    # a dtype mismatch is reported unless --allow-cast
    keys["encoder.layer.0.attention.self.qkv.weight"] = {"shape": [1152, 384], "dtype": "bfloat16"}
    target.write_text(json.dumps(keys))
    assert main(["aoa", "explain", str(cfg), "--source", str(minilm_dir), "--target", str(target)]) == 2
    assert "direct assignment of tensors of different types is prohibited" in capsys.readouterr().err
    assert main(["aoa", "explain", str(cfg), "--source", str(minilm_dir), "--target", str(target),
                 "--allow-cast"]) == 0
    assert "<- encoder.layer.0.attention.self.key.weight[0:384, 0:384]  cast=bfloat16" in capsys.readouterr().out
    # a typo in the pattern: exit 2 naming the closest key
    cfg.write_text(json.dumps([QKV.replace("query", "qurey")]))
    assert main(["aoa", "explain", str(cfg), "--source", str(minilm_dir)]) == 2
    err = capsys.readouterr().err
    assert "matches no source key" in err and "encoder.layer.0.attention.self.query.weight" in err
    # syntax errors through the generic CLI path: one line, exit 2
    cfg.write_text("a -> b; c\n")
    assert main(["aoa", "explain", str(cfg), "--source", str(minilm_dir)]) == 2
    assert re.search(r"unexpected character ';'", capsys.readouterr().err)


def test_explain_reverse_flag(minilm_dir, tmp_path, capsys):
    cfg = tmp_path / "rev.aoa"
    # reverse mode: right-side names are the source keys; the output is the left-side name
    cfg.write_text("wte^T -> embeddings.word_embeddings.weight\n")
    assert main(["aoa", "explain", str(cfg), "--source", str(minilm_dir), "--reverse", "--only", "wte"]) == 0
    out = capsys.readouterr().out
    assert "reverse mode" in out and "embeddings.word_embeddings.weight -> wte_transpose_tmp" in out
    assert "\nwte  [384, 30522] float32\n  [0:384, 0:30522] <- embeddings.word_embeddings.weight[0:30522, 0:384]  " \
           "permute=[1, 0]\n" in out
