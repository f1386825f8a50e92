"""Issue 18's silent-wrong-number paths: TP-blocked layouts recorded at save and re-laid out (or refused) at load,
fused_qkv / fused_ffn parameters checked against the tensor shapes, and strict-mode errors that never suggest
dropping data. References come from plain torch (``convert_hf_state_dict``, ``ffn_fused_permutation``) and from
transformers itself."""

import json

import pytest
import torch

from oarlock.checkpoint import load_state_dict
from oarlock.checkpoint.aoa import AOAError, compile_aoa
from oarlock.checkpoint.convert import convert_checkpoint
from oarlock.checkpoint.errors import CheckpointError, CheckpointMismatchError
from oarlock.checkpoint.model.mapping import TensorSpec
from oarlock.checkpoint.storage import open_checkpoint


def f32(*shape):
    return TensorSpec(tuple(shape), "float32")


def test_fused_qkv_head_counts_contradicting_shapes_fail():
    # q: 8 heads x 4 rows, k/v: 2 heads x 4 rows. num_key_value_groups=4 would cut k into 2-row pieces.
    src = {"q": f32(32, 6), "k": f32(8, 6), "v": f32(8, 6)}
    with pytest.raises(AOAError) as ei:
        compile_aoa(["q, k, v -> x, fused_qkv, num_heads=8, num_key_value_groups=4, axis=0"], src)
    msg = str(ei.value)
    assert "8 heads of 4" in msg and "4 heads of 2" in msg
    assert "num_key_value_groups is the number of KV heads" in msg
    # the right count compiles (and its k pieces are the 4-row heads)
    prog = compile_aoa(["q, k, v -> x, fused_qkv, num_heads=8, num_key_value_groups=2, axis=0"], src)
    assert prog.destination_spec("x").shape == (48, 6)


def test_fused_qkv_indivisible_split_explains_parameters():
    src = {"q": f32(30, 6), "k": f32(8, 6), "v": f32(8, 6)}
    with pytest.raises(AOAError, match="not divisible by 8.*number of KV heads"):
        compile_aoa(["q, k, v -> x, fused_qkv, num_heads=8, num_key_value_groups=2, axis=0"], src)


def test_fused_ffn_gate_up_shapes_must_agree():
    with pytest.raises(AOAError, match="'g' has extent 8.*'u' has extent 4"):
        compile_aoa(["g, u -> x, fused_ffn, axis=0"], {"g": f32(8, 6), "u": f32(4, 6)})


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=3, head_dim=8,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("llama") / "hf"
    model.save_pretrained(d)
    return d, model


def _oarlock_model(hf_dir):
    from oarlock.models.llama import Llama, LlamaConfig

    config = LlamaConfig.from_hf(json.loads((hf_dir / "config.json").read_text()))
    return Llama(config), config


@pytest.mark.parametrize("tp", [2, 3])
def test_tp_blocked_ffn_saved_at_tp_loads_right_at_tp1(tiny_llama, tmp_path, tp):
    from oarlock.models.llama import convert_hf_state_dict, hf_aoa_config

    hf_dir, hf_model = tiny_llama
    model, config = _oarlock_model(hf_dir)
    ckpt = tmp_path / f"tp{tp}"
    convert_checkpoint(hf_dir, ckpt, aoa_config=hf_aoa_config(config), tp=tp)
    with open_checkpoint(ckpt) as r:
        rec = r.metadata.extra["tp_layouts"]
    assert rec["layers.0.mlp.gate_up_proj.weight"] == {"statement": "fused_ffn", "tp": tp, "axis": 0}
    # a plain load at TP=1, no AOA config: re-laid out automatically, equal to the plain-torch conversion
    sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    load_state_dict(sd, ckpt)
    want = convert_hf_state_dict(hf_model.state_dict(), config)
    assert set(want) == set(sd)
    for k in want:
        assert torch.equal(sd[k], want[k]), k
    model.load_state_dict(sd)
    ids = torch.tensor([[1, 5, 9, 33, 2, 60, 7]])
    with torch.no_grad():
        assert torch.allclose(model(ids), hf_model(ids).logits, atol=2e-5, rtol=0)


def test_tp_blocked_ffn_read_as_plain_tensor_fails_naming_statement(tiny_llama, tmp_path):
    from oarlock.models.llama import hf_aoa_config

    hf_dir, _ = tiny_llama
    model, config = _oarlock_model(hf_dir)
    ckpt = tmp_path / "tp3"
    convert_checkpoint(hf_dir, ckpt, aoa_config=hf_aoa_config(config), tp=3)
    sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    sd["renamed"] = sd.pop("layers.1.mlp.gate_up_proj.weight")
    with pytest.raises(CheckpointError) as ei:  # an AOAError, re-raised alike on every rank
        load_state_dict(sd, ckpt, aoa_config=["layers.1.mlp.gate_up_proj.weight -> renamed"])
    msg = str(ei.value)
    assert "TP degree 3" in msg and "TP degree 1" in msg
    assert "'layers.1.mlp.gate_up_proj.weight -> renamed, fused_ffn, axis=0'" in msg
    # the statement it names works
    load_state_dict(sd, ckpt, aoa_config=["layers.1.mlp.gate_up_proj.weight -> renamed, fused_ffn, axis=0"])
    ref = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    load_state_dict(ref, ckpt)
    assert torch.equal(sd["renamed"], ref["layers.1.mlp.gate_up_proj.weight"])


def test_strict_error_does_not_suggest_dropping_biases(tmp_path):
    transformers = pytest.importorskip("transformers")
    from oarlock.models.llama import Llama, LlamaConfig, hf_aoa_config

    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # biases forgotten
    sd = Llama(config).state_dict()
    with pytest.raises(CheckpointMismatchError) as ei:
        load_state_dict(sd, tmp_path / "hf", aoa_config=hf_aoa_config(config))
    msg = str(ei.value)
    assert "model.layers.0.self_attn.q_proj.bias" in msg
    assert "strict=False" not in msg and "wrong numbers" in msg and "'KEY -> _'" in msg


def test_recorded_layout_survives_convert_and_export(tiny_llama, tmp_path):
    """A TP=3 checkpoint converted to TP=2 and exported to HF without any AOA config: the gate/up blocks are
    re-laid out for each output (and the TP=2 output records its own degree)."""
    from oarlock.checkpoint.convert import export_hf
    from oarlock.models.llama import convert_hf_state_dict, ffn_fused_permutation, hf_aoa_config

    hf_dir, hf_model = tiny_llama
    _, config = _oarlock_model(hf_dir)
    want = convert_hf_state_dict(hf_model.state_dict(), config)
    key = "layers.1.mlp.gate_up_proj.weight"
    convert_checkpoint(hf_dir, tmp_path / "tp3", aoa_config=hf_aoa_config(config), tp=3)
    meta = convert_checkpoint(tmp_path / "tp3", tmp_path / "tp2", tp=2)
    assert meta.extra["tp_layouts"][key]["tp"] == 2
    got = torch.zeros_like(want[key])
    load_state_dict({key: got}, tmp_path / "tp2", strict=False)
    assert torch.equal(got, want[key])
    with open_checkpoint(tmp_path / "tp2") as r:  # on disk: the degree-2 blocks
        s = r.metadata.tensors[key].shards[0]
        assert s.local_shape[0] == want[key].shape[0] // 2
    from safetensors import safe_open

    with safe_open(str(tmp_path / "tp2" / s.file), "pt") as fh:
        assert torch.equal(fh.get_tensor(key), want[key][ffn_fused_permutation(config.intermediate_size, 2)][:48])
    export_hf(tmp_path / "tp3", tmp_path / "flat")
    with safe_open(str(tmp_path / "flat" / "model.safetensors"), "pt") as fh:
        assert torch.equal(fh.get_tensor(key), want[key])  # [gate | up], not rank blocks
