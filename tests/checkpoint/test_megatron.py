"""Megatron-Core ``torch_dist`` checkpoints written by the real ``megatron.core.dist_checkpointing.save`` of a
``GPTModel`` with tensor parallelism 2 on 2 gloo ranks (CPU), in ``.foreign-venv`` (scripts/foreign_env.sh; the
tests skip without it). References are the writer's own per-rank parameters, placed by Megatron's documented
sharding: stacked layer axis, column-parallel rows (QKV per query group, fc1 as gate and up halves),
row-parallel columns, vocabulary rows.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oarlock.checkpoint import load_state_dict, open_checkpoint
from oarlock.checkpoint.errors import CheckpointFormatError, UnsafePickleError
from oarlock.cli import main
from testkit import st_tensors

REPO = Path(__file__).resolve().parents[2]
PY = REPO / ".foreign-venv" / "bin" / "python"
pytestmark = [pytest.mark.multiproc, pytest.mark.slow]
L, TP = 2, 2


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    if not PY.exists():
        pytest.skip("no .foreign-venv (run scripts/foreign_env.sh): Megatron-Core is not installed")
    out = tmp_path_factory.mktemp("megatron")
    # the writers run as multirank scenarios on 2 ranks: a failure names the scenario and the rank
    writers = Path(__file__).with_name("_foreign_writers.py")
    r = subprocess.run([str(PY), str(REPO / "tests" / "multirank.py"), str(writers), "2", str(out), "megatron_gpt_tp2"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    return out


def expected(out: Path) -> dict[str, torch.Tensor]:
    """Global tensors under Megatron's checkpoint keys, assembled from each TP rank's own parameters."""
    refs = [torch.load(out / f"ref_rank{r}.pt", weights_only=True) for r in range(TP)]
    cat0 = lambda name: torch.cat([refs[r][name] for r in range(TP)], 0)  # noqa: E731
    cat1 = lambda name: torch.cat([refs[r][name] for r in range(TP)], 1)  # noqa: E731
    layer = "decoder.layers.{}."
    exp = {"embedding.word_embeddings.weight": cat0("embedding.word_embeddings.weight"),
           "output_layer.weight": cat0("output_layer.weight"),
           "decoder.final_layernorm.weight": refs[0]["decoder.final_layernorm.weight"]}
    stack = lambda f: torch.stack([f(layer.format(i)) for i in range(L)])  # noqa: E731
    exp["decoder.layers.self_attention.linear_qkv.weight"] = stack(lambda p: cat0(p + "self_attention.linear_qkv.weight"))
    exp["decoder.layers.self_attention.linear_proj.weight"] = stack(lambda p: cat1(p + "self_attention.linear_proj.weight"))
    exp["decoder.layers.mlp.linear_fc2.weight"] = stack(lambda p: cat1(p + "mlp.linear_fc2.weight"))
    half = lambda p, r, j: refs[r][p + "mlp.linear_fc1.weight"].chunk(2)[j]  # noqa: E731  (gate, up) per rank
    exp["decoder.layers.mlp.linear_fc1.weight"] = stack(
        lambda p: torch.cat([half(p, r, 0) for r in range(TP)] + [half(p, r, 1) for r in range(TP)]))
    exp["decoder.layers.self_attention.linear_qkv.layer_norm_weight"] = stack(lambda p: refs[0][p + "input_layernorm.weight"])
    exp["decoder.layers.mlp.linear_fc1.layer_norm_weight"] = stack(lambda p: refs[0][p + "pre_mlp_layernorm.weight"])
    return exp


def test_megatron_tensors_and_common(written):
    exp = expected(written)
    with open_checkpoint(written / "ckpt") as r:
        meta = r.metadata
        assert meta.format == "megatron"
        assert set(meta.tensors) == set(exp)
        fc1 = meta.tensors["decoder.layers.mlp.linear_fc1.weight"]
        assert len(fc1.shards) == L * TP * 2  # gate and up chunks of one key per layer and TP rank
        assert meta.objects["common.iteration"] == 7
        assert meta.objects["common.args"]["tensor_model_parallel_size"] == 2
        assert meta.extra["megatron"]["backend"]["sharded_backend"] == "torch_dist"
    # 2 ranks saved; one process loads everything (2 -> 1), chunk by chunk through the planner
    got = {k: torch.zeros_like(v) for k, v in exp.items()}
    load_state_dict(got, written / "ckpt", strict=False)
    for k, v in exp.items():
        assert torch.equal(got[k], v), k
    # and a TP-4-like box of one stacked key: layer 1, rows 96..144 of fc1 (the first half of "up")
    box = {"decoder.layers.mlp.linear_fc1.weight": torch.zeros(2, 192, 64)}
    load_state_dict(box, written / "ckpt", strict=False)
    assert torch.equal(box["decoder.layers.mlp.linear_fc1.weight"][1, 96:144], exp[
        "decoder.layers.mlp.linear_fc1.weight"][1, 96:144])


def test_megatron_convert_and_inspect(written, tmp_path, capsys):
    exp = expected(written)
    out = tmp_path / "oar"
    assert main(["convert", str(written / "ckpt"), str(out), "--to", "oarlock", "--tp", "4"]) == 0
    got = {k: torch.zeros_like(v) for k, v in exp.items()}
    load_state_dict(got, out, strict=False)
    for k, v in exp.items():
        assert torch.equal(got[k], v), k
    capsys.readouterr()
    assert main(["inspect", str(written / "ckpt")]) == 0
    assert "megatron checkpoint, 9 tensors" in capsys.readouterr().out


def test_megatron_broken(written, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(written / "ckpt", d)
    (d / "metadata.json").write_text('{"sharded_backend": "zarr", "sharded_backend_version": 1}')
    with pytest.raises(CheckpointFormatError, match="sharded_backend 'zarr' is not supported"):
        open_checkpoint(d)
    shutil.copy(written / "ckpt" / "metadata.json", d / "metadata.json")
    import os
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    (d / "common.pt").write_bytes(b"")
    torch.save({"iteration": 1, "hook": Evil()}, d / "common.pt")  # a common.pt calling os.system
    with open_checkpoint(d) as r:
        assert "common_error" in r.metadata.extra["megatron"] and r.metadata.extra["megatron"]["common_error"]
        assert "common.iteration" not in r.metadata.objects
    assert not (tmp_path / "pwned").exists()
    (d / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(UnsafePickleError):
        open_checkpoint(d)
    assert not (tmp_path / "pwned").exists()
    (d / ".metadata").write_bytes((written / "ckpt" / ".metadata").read_bytes())
    f = d / "__1_1.distcp"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(CheckpointFormatError, match=r"__1_1\.distcp: truncated"):
        open_checkpoint(d)


# ---------------------------------------------------------------- the megatron_gpt preset (Megatron -> HF Llama)

HF_VOCAB = 128  # the writer's GPTModel has a vocabulary of 130 rows: 2 rows of padding to trim


def hf_config(tmp_path: Path) -> Path:
    """The HF LlamaConfig of the writer's TransformerConfig (RMSNorm eps 1e-5, RoPE base 10000, SwiGLU)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=L,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                      rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    d = tmp_path / "hf_config"
    cfg.save_pretrained(d)
    return d / "config.json"


def hf_reference(exp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF Llama tensors re-arranged from the Megatron tensors with plain torch, independently of AOA: layer axis
    indexed, linear_qkv regrouped from [q heads of group g, k_g, v_g] per group, fc1 halves, vocab trimmed."""
    h, g, d = 4, 2, 16
    out = {"model.embed_tokens.weight": exp["embedding.word_embeddings.weight"][:HF_VOCAB],
           "lm_head.weight": exp["output_layer.weight"][:HF_VOCAB],
           "model.norm.weight": exp["decoder.final_layernorm.weight"]}
    for i in range(L):
        p, m = f"model.layers.{i}.", "decoder.layers."
        groups = exp[m + "self_attention.linear_qkv.weight"][i].view(g, h // g + 2, d, 64)
        out[p + "self_attn.q_proj.weight"] = groups[:, : h // g].reshape(h * d, 64)
        out[p + "self_attn.k_proj.weight"] = groups[:, h // g].reshape(g * d, 64)
        out[p + "self_attn.v_proj.weight"] = groups[:, h // g + 1].reshape(g * d, 64)
        out[p + "self_attn.o_proj.weight"] = exp[m + "self_attention.linear_proj.weight"][i]
        gate, up = exp[m + "mlp.linear_fc1.weight"][i].chunk(2)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        out[p + "mlp.down_proj.weight"] = exp[m + "mlp.linear_fc2.weight"][i]
        out[p + "input_layernorm.weight"] = exp[m + "self_attention.linear_qkv.layer_norm_weight"][i]
        out[p + "post_attention_layernorm.weight"] = exp[m + "mlp.linear_fc1.layer_norm_weight"][i]
    return out


def test_megatron_gpt_preset_to_hf_logits(written, tmp_path, capsys):
    """``oarlock convert MEGATRON OUT --to hf --preset megatron_gpt``: every HF tensor equals the Megatron tensors
    re-arranged by plain torch (:func:`hf_reference`), and transformers' LlamaForCausalLM on the result gives
    the logits Megatron's own GPTModel forward computed in the writer process (TP=2, CPU, gloo) for the same
    tokens (first 128 logits: the rest are padding rows)."""
    from transformers import LlamaForCausalLM

    from oarlock.checkpoint.aoa.presets import preset

    cfg = hf_config(tmp_path)
    ref = hf_reference(expected(written))
    out = tmp_path / "hf"
    assert main(["convert", str(written / "ckpt"), str(out), "--to", "hf", "--preset", "megatron_gpt",
                 "--model-config", str(cfg)]) == 0
    got = st_tensors(out)
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert torch.equal(got[k], v), k
    model = LlamaForCausalLM.from_pretrained(out).eval()
    if not (written / "logits.pt").exists():
        pytest.fail("Megatron's forward did not run in the writer: "
                    + (written / "logits_error.txt").read_text()[-2000:])
    meg = torch.load(written / "logits.pt", weights_only=True)
    with torch.no_grad():
        logits = model(meg["ids"]).logits
    assert meg["logits"].shape[-1] == 130
    # logits have std ~8: fp32 summation order (TP all-reduce, RoPE tables) differs by ~1e-5 between the two
    torch.testing.assert_close(logits, meg["logits"][..., :HF_VOCAB], rtol=1e-4, atol=1e-4)
    # the same preset in Python, loading straight into the transformers model (strict: every weight consumed;
    # Megatron's non-tensor entries, common.pt values and the layers' _extra_state, are not this load's)
    model2 = LlamaForCausalLM(model.config)
    sd = model2.state_dict()
    rep = load_state_dict(sd, written / "ckpt", aoa_config=preset("megatron_gpt", cfg, source=written / "ckpt"),
                          strict=True, ignore_unexpected=["common.*", "*._extra_state*"])
    assert rep.missing_keys == []
    for k, v in ref.items():
        assert torch.equal(sd[k], v), k
    # explain shows the layer axis dropped by reshape= and the per-group split
    capsys.readouterr()
    assert main(["aoa", "explain", "--preset", "megatron_gpt", "--source", str(written / "ckpt"),
                 "--model-config", str(cfg), "--only", "model.layers.1.self_attn.k_proj.weight"]) == 0
    text = capsys.readouterr().out
    assert "reshape='[-1, 64]'" in text
    assert ("model.layers.1.self_attn.k_proj.weight  [32, 64] float32\n"
            "  [0:16, 0:64] <- decoder.layers.self_attention.linear_qkv.weight[1:2, 32:48, 0:64]\n"
            "  [16:32, 0:64] <- decoder.layers.self_attention.linear_qkv.weight[1:2, 96:112, 0:64]") in text


def test_megatron_gpt_preset_errors(written, tmp_path):
    from oarlock.checkpoint.aoa.presets import PresetError, preset

    cfg = json.loads(hf_config(tmp_path).read_text())
    with pytest.raises(PresetError, match="num_hidden_layers=3 but the checkpoint's stacked"):
        preset("megatron_gpt", {**cfg, "num_hidden_layers": 3}, source=written / "ckpt")
    with pytest.raises(PresetError, match="vocabulary has 130 rows, fewer than config.json's vocab_size=200"):
        preset("megatron_gpt", {**cfg, "vocab_size": 200}, source=written / "ckpt")
    with pytest.raises(PresetError, match="model_type=.gpt2."):
        preset("megatron_gpt", {**cfg, "model_type": "gpt2"})
    with pytest.raises(PresetError, match="needs the target HF model's config.json"):
        preset("megatron_gpt")


# ---------------------------------------------------------------- a training checkpoint (weights + Adam state)

MOMENTS = ("exp_avg", "exp_avg_sq")


def test_megatron_training_checkpoint_to_hf_model_weights_only(written, tmp_path, capsys):
    """ckpt_train (the same weights plus Adam moments, sharded by Megatron-Core's own optim_state_to_sharding_state
    as ``optimizer.state.<state>.<param key>``): the reader marks the moments as optimizer state, and
    ``oarlock convert --to hf`` with no AOA writes exactly the model tensors, each equal to the writer's own
    parameters, saying the optimizer state was left out."""

    exp = expected(written)
    moments = {f"optimizer.state.{m}.{k}" for m in MOMENTS for k in exp}
    with open_checkpoint(written / "ckpt_train") as r:
        assert set(r.metadata.optimizer_state_keys()) == moments
        assert set(r.metadata.tensors) == set(exp) | moments
    # the moments are read right: output layer (vocab rows per TP rank) and final norm (replicated)
    refs = [torch.load(written / f"optim_ref_rank{r}.pt", weights_only=True) for r in range(TP)]
    got = {"optimizer.state.exp_avg.output_layer.weight": torch.zeros(130, 64),
           "optimizer.state.exp_avg_sq.decoder.final_layernorm.weight": torch.zeros(64)}
    load_state_dict(got, written / "ckpt_train", strict=False)
    assert torch.equal(got["optimizer.state.exp_avg.output_layer.weight"],
                       torch.cat([refs[r]["output_layer.weight"]["exp_avg"] for r in range(TP)]))
    assert torch.equal(got["optimizer.state.exp_avg_sq.decoder.final_layernorm.weight"],
                       refs[0]["decoder.final_layernorm.weight"]["exp_avg_sq"])
    capsys.readouterr()
    out = tmp_path / "hf"
    assert main(["convert", str(written / "ckpt_train"), str(out), "--to", "hf"]) == 0
    assert f"left out {len(moments)} optimizer state tensor(s) (model weights only" in capsys.readouterr().out
    tensors = st_tensors(out)
    assert sorted(tensors) == sorted(exp)
    for k, v in exp.items():
        assert torch.equal(tensors[k], v), k


@pytest.mark.parametrize("ckpt", ["ckpt", "ckpt_train"])
def test_megatron_strict_model_load_hint(written, tmp_path, ckpt):
    """A strict load of a transformers Llama through the megatron_gpt preset: Megatron's common.* values and the
    layers' *._extra_state* objects (and ckpt_train's optimizer state) are not model weights, so the error names
    model_only=True (not an AOA statement for 'modules this load reads'), and model_only=True loads every weight
    strictly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from oarlock.checkpoint.errors import CheckpointMismatchError
    from oarlock.checkpoint.aoa.presets import preset

    cfg = hf_config(tmp_path)
    ref = hf_reference(expected(written))
    sd = LlamaForCausalLM(LlamaConfig.from_json_file(cfg)).state_dict()
    aoa = preset("megatron_gpt", cfg, source=written / ckpt)
    with pytest.raises(CheckpointMismatchError) as e:
        load_state_dict(sd, written / ckpt, aoa_config=aoa, strict=True)
    msg = str(e.value)
    assert "unexpected keys" in msg and "'common.iteration'" in msg and "_extra_state/shard_0_2'" in msg
    assert "none of them are model weights" in msg and "pass model_only=True" in msg
    assert "sit in modules whose other tensors this load reads" not in msg
    rep = load_state_dict(sd, written / ckpt, aoa_config=aoa, strict=True, model_only=True)
    assert rep.missing_keys == [] and "common.iteration" in rep.unexpected_keys
    for k, v in ref.items():
        assert torch.equal(sd[k], v), k
