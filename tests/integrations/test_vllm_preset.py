"""The vllm_* presets (HF keys -> vLLM's own parameters; issue 39): on models transformers builds from tiny configs,
each TP rank's part of ``qkv_proj`` is that rank's q, k and v rows one after the other (vLLM's QKVParallelLinear)
and of ``gate_up_proj`` its gate and up rows (MergedColumnParallelLinear), written out here with plain
``chunk``/``cat``; other keys keep their HF names; the reverse preset gives the HF tensors back bit for bit; a tied
embedding also feeds ``lm_head.weight`` (vLLM's CPU path packs a tied lm_head separately). Runs without vLLM."""

import pytest
import torch
from safetensors import safe_open

from oarlock.checkpoint.convert import convert_checkpoint, export_hf
from oarlock.checkpoint.aoa.presets import PresetError, preset
from testkit import run_cli, st_tensors

transformers = pytest.importorskip("transformers")


def build(arch):
    T = transformers
    # 4 KV heads over TP=2: a rank's [q_r; k_r; v_r] differs from the per-KV-group order of the training layout
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=4)
    if arch == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**base, tie_word_embeddings=False))
    if arch == "llama_tied":
        return T.LlamaForCausalLM(T.LlamaConfig(**base, tie_word_embeddings=True))
    if arch == "mistral":
        return T.MistralForCausalLM(T.MistralConfig(**base, tie_word_embeddings=False))
    if arch == "qwen2":  # q/k/v biases
        return T.Qwen2ForCausalLM(T.Qwen2Config(**base, tie_word_embeddings=False))
    raise AssertionError(arch)


def make(arch, d):
    torch.manual_seed(7)
    model = build(arch).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    model.save_pretrained(d)
    return model


def rank_parts(ckpt, meta, key):
    """{global offset: this shard's tensor} of ``key`` in a converted checkpoint."""
    out = {}
    for s in meta.tensors[key].shards:
        with safe_open(str(ckpt / s.file), "pt") as fh:
            out[tuple(s.global_offset)] = fh.get_tensor(key)
    return out


@pytest.mark.parametrize("arch", ["llama", "llama_tied", "mistral", "qwen2"])
def test_vllm_layout_per_tp_rank_and_back(arch, tmp_path):
    tp = 2
    hf = tmp_path / "hf"
    make(arch, hf)
    src = st_tensors(hf)
    cfg = preset("vllm", hf)
    assert cfg["preset"] == ("vllm_qwen2" if arch == "qwen2" else "vllm_llama")
    meta = convert_checkpoint(hf, tmp_path / "tp", aoa_config=cfg, tp=tp, tp_rules=cfg["tp_rules"],
                              show_progress=False)
    n_layers = 2
    want_keys = {k for k in src if not any(x in k for x in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))}
    for i in range(n_layers):
        want_keys |= {f"model.layers.{i}.self_attn.qkv_proj.weight", f"model.layers.{i}.mlp.gate_up_proj.weight"}
        if arch == "qwen2":
            want_keys.add(f"model.layers.{i}.self_attn.qkv_proj.bias")
    if arch == "llama_tied":
        assert "lm_head.weight" not in src
        want_keys.add("lm_head.weight")
    assert set(meta.tensors) == want_keys
    for i in range(n_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for suffix in (["weight", "bias"] if arch == "qwen2" else ["weight"]):
            q, k, v = (src[a + f"{x}_proj.{suffix}"] for x in "qkv")
            parts = rank_parts(tmp_path / "tp", meta, a + f"qkv_proj.{suffix}")
            rows = (q.shape[0] + 2 * k.shape[0]) // tp
            for r in range(tp):
                want = torch.cat([q.chunk(tp)[r], k.chunk(tp)[r], v.chunk(tp)[r]])
                assert torch.equal(parts[(r * rows,) + (0,) * (q.dim() - 1)], want), (a, suffix, r)
        gate, up = src[m + "gate_proj.weight"], src[m + "up_proj.weight"]
        parts = rank_parts(tmp_path / "tp", meta, m + "gate_up_proj.weight")
        for r in range(tp):
            want = torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
            assert torch.equal(parts[(r * 2 * gate.shape[0] // tp, 0)], want), (m, r)
    if arch == "llama_tied":
        parts = rank_parts(tmp_path / "tp", meta, "lm_head.weight")
        emb = src["model.embed_tokens.weight"]
        assert torch.equal(torch.cat([parts[o] for o in sorted(parts)]), emb)
    if arch == "llama_tied":
        return  # the fan-out has no single inverse (two vLLM tensors hold the embedding)
    export_hf(tmp_path / "tp", tmp_path / "back", aoa_config=preset("vllm", hf, reverse=True))
    got = st_tensors(tmp_path / "back")
    assert set(got) == set(src)
    for k in src:
        assert torch.equal(got[k], src[k]), k


def test_vllm_preset_refuses_an_architecture_it_lacks(tmp_path):
    cfg = {"model_type": "gpt2", "n_head": 4}
    with pytest.raises(PresetError, match="no vLLM preset for model_type 'gpt2'.*vllm_llama, vllm_qwen2"):
        preset("vllm", cfg)
    with pytest.raises(PresetError, match="preset 'vllm_llama' is for model_type llama, mistral"):
        preset("vllm_llama", {"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2})


def test_aoa_explain_shows_the_vllm_preset(tmp_path):
    hf = tmp_path / "hf"
    make("llama", hf)
    r = run_cli("aoa", "explain", "--preset", "vllm_llama", "--source", hf, "--tp", "2", "--only",
                "model.layers.0.self_attn.qkv_proj.weight")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "fused_qkv_old blocks for tp=2: rank 0: 0:32; rank 1: 32:64" in out, out
    # rank 0's rows: q heads 0-3, k heads 0-1, v heads 0-1; rank 1's: q heads 4-7, k 2-3, v 2-3 (head dim 4)
    assert "[12:16, 0:32] <- model.layers.0.self_attn.q_proj.weight[12:16, 0:32]" in out, out
    assert "[16:20, 0:32] <- model.layers.0.self_attn.k_proj.weight[0:4, 0:32]" in out, out
    assert "[24:28, 0:32] <- model.layers.0.self_attn.v_proj.weight[0:4, 0:32]" in out, out
    assert "[32:36, 0:32] <- model.layers.0.self_attn.q_proj.weight[16:20, 0:32]" in out, out


def test_with_casts_fp32_master_weights_into_bf16_vllm_targets():
    """``OarlockTrainerInitInfo(dtype="bfloat16")``: the vLLM preset plus a cast of every key it produces; a live
    reshard (one process) fills bf16 targets in vLLM's layout at TP=1 with the rounded fp32 values."""
    from oarlock.checkpoint import reshard_state_dict
    from oarlock.integrations.vllm import with_casts

    torch.manual_seed(3)
    model = build("llama")
    src = {k: v.detach().clone() for k, v in model.named_parameters()}
    cfg = with_casts(preset("vllm", model.config), src, "bfloat16")
    assert "model.layers.1.self_attn.qkv_proj.weight -> model.layers.1.self_attn.qkv_proj.weight, " \
           "dtype='bfloat16'" in cfg["aoa_statements"]
    want = {}
    for k, v in src.items():
        if "q_proj" in k or "gate_proj" in k:
            a = k.replace("q_proj", "{}").replace("gate_proj", "{}")
            parts = ["q_proj", "k_proj", "v_proj"] if "q_proj" in k else ["gate_proj", "up_proj"]
            fused = a.format("qkv_proj" if "q_proj" in k else "gate_up_proj")
            want[fused] = torch.cat([src[a.format(p)] for p in parts]).to(torch.bfloat16)
        elif not any(x in k for x in ("k_proj", "v_proj", "up_proj")) or "down_proj" in k:
            want[k] = v.to(torch.bfloat16)
    targets = {k: torch.zeros_like(v) for k, v in want.items()}
    rep = reshard_state_dict(src, targets, aoa_config=cfg)
    assert not rep.missing_keys and not rep.unexpected_keys
    for k in want:
        assert targets[k].dtype == torch.bfloat16 and torch.equal(targets[k], want[k]), k
    assert rep.bytes_received == sum(v.numel() * 2 for v in want.values())
