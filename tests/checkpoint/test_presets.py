"""Presets (issue 18): for every architecture, a model that transformers itself builds from a tiny config (random
weights, save_pretrained) goes HF -> TP 2 / 3 training layout -> HF bit for bit, and transformers' logits on the
exported directory equal the original's. The fused tensors are checked against plain-torch constructions, Llama-
family checkpoints load into oarlock's Llama exactly as the independent converter ``convert_hf_state_dict`` gives,
and a preset applied to another architecture fails naming what did not match."""

import json

import pytest
import torch
from safetensors import safe_open

from oarlock.checkpoint import load_state_dict
from oarlock.checkpoint.aoa import AOAError
from oarlock.checkpoint.convert import convert_checkpoint, export_hf
from oarlock.checkpoint.aoa.presets import PresetError, preset
from oarlock.checkpoint.storage import open_checkpoint
from testkit import st_tensors

transformers = pytest.importorskip("transformers")


def build(arch, tp):
    """(model class, config) of a tiny model whose heads split evenly over ``tp`` ranks."""
    h, g = (6, 3) if tp == 3 else (4, 2)
    hid = 8 * h
    base = dict(vocab_size=64, hidden_size=hid, intermediate_size=48, num_hidden_layers=2, num_attention_heads=h,
                num_key_value_heads=g)
    T = transformers
    if arch == "llama":
        return T.LlamaForCausalLM, T.LlamaConfig(**base, tie_word_embeddings=False)
    if arch == "llama_bias":  # attention_bias: q/k/v and o biases
        return T.LlamaForCausalLM, T.LlamaConfig(**base, attention_bias=True, tie_word_embeddings=True)
    if arch == "mistral":
        return T.MistralForCausalLM, T.MistralConfig(**base)
    if arch == "qwen2":
        return T.Qwen2ForCausalLM, T.Qwen2Config(**base)
    if arch == "qwen2_moe":
        return T.Qwen2MoeForCausalLM, T.Qwen2MoeConfig(**base, num_experts=4, num_experts_per_tok=2,
                                                       moe_intermediate_size=24, shared_expert_intermediate_size=24)
    if arch == "mixtral":
        return T.MixtralForCausalLM, T.MixtralConfig(**base, num_local_experts=4, num_experts_per_tok=2)
    if arch == "deepseek_v3":
        return T.DeepseekV3ForCausalLM, T.DeepseekV3Config(
            vocab_size=64, hidden_size=hid, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=3,
            num_attention_heads=h, num_key_value_heads=h, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=4, n_group=1, topk_group=1)
    if arch == "gemma":
        return T.GemmaForCausalLM, T.GemmaConfig(**base, head_dim=8)
    if arch == "gemma2":
        return T.Gemma2ForCausalLM, T.Gemma2Config(**base, head_dim=8)
    if arch == "phi3":
        return T.Phi3ForCausalLM, T.Phi3Config(**base, pad_token_id=0)
    if arch == "gpt2":
        return T.GPT2LMHeadModel, T.GPT2Config(vocab_size=64, n_embd=hid, n_layer=2, n_head=h, n_positions=32)
    if arch == "bert":
        return T.BertModel, T.BertConfig(vocab_size=64, hidden_size=hid, num_hidden_layers=2, num_attention_heads=h,
                                         intermediate_size=48, max_position_embeddings=32)
    raise AssertionError(arch)


ARCHS = ["llama", "llama_bias", "mistral", "qwen2", "qwen2_moe", "mixtral", "deepseek_v3", "gemma", "gemma2",
         "phi3", "gpt2", "bert"]


def make(arch, tp, d):
    cls, cfg = build(arch, tp)
    torch.manual_seed(1234)
    model = cls(cfg).eval()
    with torch.no_grad():  # random everywhere: biases and norms too, so a misplaced row shows
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    model.save_pretrained(d)
    return model


def logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_through_tp_layout(arch, tp, tmp_path):
    hf = tmp_path / "hf"
    model = make(arch, tp, hf)
    cfg = preset(hf)  # 'auto': from config.json's model_type
    expected_name = {"llama_bias": "llama", "mistral": "llama"}.get(arch, arch)
    assert cfg["preset"] == expected_name
    meta = convert_checkpoint(hf, tmp_path / "tp", aoa_config=cfg, tp=tp, tp_rules=cfg["tp_rules"],
                              show_progress=False)
    assert len(meta.files) == tp
    fused = [k for k in meta.tensors if "qkv_proj" in k or "gate_up_proj" in k]
    assert fused, sorted(meta.tensors)
    for k in fused:  # every fused tensor really is split over the ranks
        assert len({s.global_offset for s in meta.tensors[k].shards}) == tp, k
    export_hf(tmp_path / "tp", tmp_path / "back", aoa_config=preset(hf, reverse=True))
    ref, got = st_tensors(hf), st_tensors(tmp_path / "back")
    assert set(got) == set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    back = type(model).from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 33, 2, 60, 7, 11]])
    assert torch.equal(logits(back, ids), logits(model, ids))


def gqa(q, k, v, h, g):
    """Reference fused_qkv order, written out: per KV group its h/g query heads, then its K and V head."""
    qs, ks, vs, r = q.chunk(h), k.chunk(g), v.chunk(g), h // g
    return torch.cat([x for j in range(g) for x in (*qs[j * r:(j + 1) * r], ks[j], vs[j])])


def full_tensor(ckpt, key, shape):
    t = torch.zeros(shape)
    load_state_dict({key: t}, ckpt, strict=False)  # recorded fused_ffn layouts are re-laid out for TP=1
    return t


def test_fused_tensors_equal_plain_torch(tmp_path):
    # Phi-3 ([Q; K; V] and [gate; up] in HF), GPT-2 (Conv1D [in, out] c_attn), BERT (separate q/k/v)
    for arch in ("phi3", "gpt2", "bert"):
        hf = tmp_path / arch
        model = make(arch, 2, hf)
        sd = model.state_dict()
        cfg = preset(hf)
        convert_checkpoint(hf, tmp_path / f"{arch}-tp", aoa_config=cfg, tp=2, tp_rules=cfg["tp_rules"],
                           show_progress=False)
        ck = tmp_path / f"{arch}-tp"
        if arch == "phi3":
            w = sd["model.layers.1.self_attn.qkv_proj.weight"]
            q, k, v = w[:32], w[32:48], w[48:]
            got = full_tensor(ck, "layers.1.self_attn.qkv_proj.weight", w.shape)
            assert torch.equal(got, gqa(q, k, v, 4, 2))
            gu = sd["model.layers.1.mlp.gate_up_proj.weight"]
            assert torch.equal(full_tensor(ck, "layers.1.mlp.gate_up_proj.weight", gu.shape), gu)
            with open_checkpoint(ck) as r:  # on disk: rank r holds [gate_r; up_r]
                assert r.metadata.extra["tp_layouts"]["layers.1.mlp.gate_up_proj.weight"]["tp"] == 2
        elif arch == "gpt2":
            w = sd["transformer.h.0.attn.c_attn.weight"].T  # Conv1D [in, out] -> [out, in]
            q, k, v = w.chunk(3)
            got = full_tensor(ck, "transformer.h.0.attn.qkv_proj.weight", w.shape)
            assert torch.equal(got, gqa(q, k, v, 4, 4))
            fc = sd["transformer.h.0.mlp.c_fc.weight"]
            assert torch.equal(full_tensor(ck, "transformer.h.0.mlp.up_proj.weight", fc.T.shape), fc.T)
        else:
            p = "encoder.layer.1.attention.self."
            q, k, v = (sd[p + n + ".bias"] for n in ("query", "key", "value"))
            got = full_tensor(ck, p + "qkv_proj.bias", (96,))
            assert torch.equal(got, gqa(q, k, v, 4, 4))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2_moe", "mixtral"])
def test_llama_family_loads_into_oarlock_llama(arch, tmp_path):
    """The TP=3 training layout loads into oarlock's single-device Llama (fused_ffn re-laid out from its recorded
    degree) exactly as the independent plain-torch converter gives, and its logits match transformers'."""
    from oarlock.models.llama import Llama, LlamaConfig, convert_hf_state_dict

    hf = tmp_path / "hf"
    model = make(arch, 3, hf)
    config = LlamaConfig.from_hf(json.loads((hf / "config.json").read_text()))
    assert config.qkv_bias == (arch in ("qwen2", "qwen2_moe"))  # Qwen2's config has no flag for its biases
    cfg = preset(hf)
    convert_checkpoint(hf, tmp_path / "tp3", aoa_config=cfg, tp=3, tp_rules=cfg["tp_rules"], show_progress=False)
    ours = Llama(config)
    sd = {k: torch.zeros_like(v) for k, v in ours.state_dict().items()}
    rep = load_state_dict(sd, tmp_path / "tp3")
    assert rep.missing_keys == [] and rep.unexpected_keys == []
    want = convert_hf_state_dict(model.state_dict(), config)
    assert set(want) == set(sd)
    for k in want:
        assert torch.equal(sd[k], want[k]), k
    ours.load_state_dict(sd)
    ids = torch.tensor([[1, 5, 9, 33, 2, 60, 7, 11]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), logits(model, ids), atol=5e-5, rtol=1e-4)


def test_wrong_architecture_fails_naming_the_mismatch(tmp_path):
    make("qwen2", 2, tmp_path / "qwen2")
    with pytest.raises(PresetError, match="preset 'mixtral' is for model_type mixtral.*model_type='qwen2'.*'qwen2'"):
        preset("mixtral", tmp_path / "qwen2")
    # a table whose rows do not fit the keys (config edited to lie about the architecture): the pattern is named
    cfg = json.loads((tmp_path / "qwen2" / "config.json").read_text())
    cfg["model_type"] = "mixtral"
    with pytest.raises(AOAError, match="block_sparse_moe.gate.weight' matches no source key"):
        convert_checkpoint(tmp_path / "qwen2", tmp_path / "out", aoa_config=preset("mixtral", cfg),
                           show_progress=False)
    with pytest.raises(PresetError, match="unknown preset 'llama3'.*known presets: bert, deepseek_v3"):
        preset("llama3", cfg)
    # and the Llama preset on Qwen2 keys with the biases forgotten: the biases are named, strict=False is not
    from oarlock.checkpoint.errors import CheckpointMismatchError
    from oarlock.models.llama import Llama, LlamaConfig

    cfg["model_type"] = "llama"
    config = LlamaConfig.from_hf(cfg)
    with pytest.raises(CheckpointMismatchError) as ei:
        load_state_dict(Llama(config).state_dict(), tmp_path / "qwen2", aoa_config=preset("llama", cfg))
    assert "q_proj.bias" in str(ei.value) and "strict=False" not in str(ei.value)


@pytest.mark.parametrize("arch", ARCHS)
def test_aoa_statements_equal_the_table_run_in_plain_torch(arch, tmp_path):
    """Each table's AOA statements (through convert at TP=2, every rank file read back) give what the same
    table executed with plain torch ops gives (presets.reference_convert), tensor for tensor."""
    from oarlock.checkpoint.aoa.presets import ARCHITECTURES, params_from_config, reference_convert

    hf = tmp_path / "hf"
    make(arch, 2, hf)
    cfg = preset(hf)
    table = ARCHITECTURES[cfg["preset"]]
    params = params_from_config(table, json.loads((hf / "config.json").read_text()))
    want = reference_convert(table, params, st_tensors(hf), tp=2)
    meta = convert_checkpoint(hf, tmp_path / "tp2", aoa_config=cfg, tp=2, tp_rules=cfg["tp_rules"],
                              show_progress=False)
    assert set(meta.tensors) == set(want)
    for k, t in meta.tensors.items():  # reassemble each tensor from its shards by global offset
        full = torch.empty(t.global_shape, dtype=want[k].dtype)
        for s in t.shards:
            with safe_open(str(tmp_path / "tp2" / s.file), "pt") as fh:
                full[tuple(slice(o, o + n) for o, n in zip(s.global_offset, s.local_shape))] = fh.get_tensor(k)
        assert torch.equal(full, want[k]), k


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_stacked_experts_round_trip_tp2(arch, tmp_path):
    """``stacked_experts=True``: each layer's experts become ``layers.N.mlp.experts.gate_up_proj.weight``
    ``[E, 2I, hidden]`` (expert e's [gate_e; up_e], built here with torch.stack) and ``...experts.down_proj.weight``
    ``[E, hidden, I]``, split over 2 ranks on the expert axis; exporting back (reverse mode: the reshape's
    ``src_shape`` restores HF's 2-D shapes) is bit-identical and transformers' logits are unchanged."""
    from oarlock.checkpoint.aoa.presets import ARCHITECTURES, params_from_config, reference_convert

    hf = tmp_path / "hf"
    model = make(arch, 2, hf)
    sd = st_tensors(hf)
    cfg = preset(hf, stacked_experts=True)
    meta = convert_checkpoint(hf, tmp_path / "tp2", aoa_config=cfg, tp=2, tp_rules=cfg["tp_rules"],
                              show_progress=False)
    E = 4
    if arch == "mixtral":
        x = "model.layers.{}.block_sparse_moe.experts.{}.w{}.weight"
        gate, up, down = (lambda i, e, n=n: sd[x.format(i, e, n)] for n in (1, 3, 2))
    else:
        x = "model.layers.{}.mlp.experts.{}.{}_proj.weight"
        gate, up, down = (lambda i, e, n=n: sd[x.format(i, e, n)] for n in ("gate", "up", "down"))
    for i in range(2):
        gu_key, d_key = f"layers.{i}.mlp.experts.gate_up_proj.weight", f"layers.{i}.mlp.experts.down_proj.weight"
        want_gu = torch.stack([torch.cat([gate(i, e), up(i, e)]) for e in range(E)])
        want_d = torch.stack([down(i, e) for e in range(E)])
        assert tuple(meta.tensors[gu_key].global_shape) == tuple(want_gu.shape)
        assert sorted(s.global_offset for s in meta.tensors[gu_key].shards) == [(0, 0, 0), (2, 0, 0)]
        assert torch.equal(full_tensor(tmp_path / "tp2", gu_key, want_gu.shape), want_gu)
        assert torch.equal(full_tensor(tmp_path / "tp2", d_key, want_d.shape), want_d)
    assert not [k for k in meta.tensors if ".experts.0." in k]
    # the table's plain-torch oracle agrees on every tensor
    table = ARCHITECTURES[cfg["preset"]]
    want = reference_convert(table, params_from_config(table, json.loads((hf / "config.json").read_text()), True),
                             sd, tp=2)
    assert set(meta.tensors) == set(want)
    export_hf(tmp_path / "tp2", tmp_path / "back", aoa_config=preset(hf, reverse=True, stacked_experts=True))
    got = st_tensors(tmp_path / "back")
    assert set(got) == set(sd)
    for k in sd:
        assert torch.equal(got[k], sd[k]), k
    back = type(model).from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 33, 2, 60, 7, 11]])
    assert torch.equal(logits(back, ids), logits(model, ids))
    with pytest.raises(PresetError, match="preset 'llama' has no experts to stack"):
        make("llama", 2, tmp_path / "llama")
        preset(tmp_path / "llama", stacked_experts=True)
