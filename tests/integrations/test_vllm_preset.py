"""The vllm_* presets (HF keys -> vLLM's own parameters; issues 39 and 49) and the boxes a vLLM worker asks for
(``oarlock.integrations.vllm``: ``qkv_parts``, ``merged_parts``, ``fused_moe_layout``, ``layout_boxes``), on models
transformers builds from tiny configs, without vLLM.

The presets give vLLM's fused tensors a global layout that does not depend on the TP degree (HF's tensors
concatenated: ``qkv_proj`` = ``[q; k; v]``, ``gate_up_proj`` = ``[gate; up]``, experts stacked as ``w13_weight``
``[E, 2I, H]`` and ``w2_weight`` ``[E, H, I]``); each worker asks for its rows as boxes of it. Checked here with a
one-process reshard per worker against vLLM's per-rank layouts written out with plain ``chunk``/``cat``: a rank's
``qkv_proj`` is its q heads, then its k and v heads (``QKVParallelLinear``; with more TP ranks than KV heads the
KV head ``r // replicas``, replicated), its ``gate_up_proj`` its gate then up rows, its ``w13_weight`` the gate then
up rows of each of its experts (``w1`` then ``w3``, vLLM's ``RoutedExperts._load_w13``); experts held one module
per expert (checkpoints), stacked (transformers 5 in memory) or as grouped-GEMM ``w1``/``w2``/``w3``; engines
TP-split or expert parallel (linear and round-robin placement). The reverse presets give the HF tensors back bit
for bit; a tied embedding also feeds ``lm_head.weight``."""

import pytest
import torch

from oarlock.checkpoint import ShardedWeight, reshard_state_dict
from oarlock.checkpoint.aoa.presets import PresetError, experts_format, preset
from oarlock.checkpoint.convert import convert_checkpoint, export_hf
from oarlock.integrations.vllm import fused_moe_layout, layout_boxes, merged_parts, qkv_parts
from testkit import run_cli, st_tensors

transformers = pytest.importorskip("transformers")


def build(arch):
    T = transformers
    # 8 q heads, 4 KV heads, head dim 4: over TP=2 a rank's [q_r; k_r; v_r] differs from HF's [q; k; v] order,
    # over TP=8 each KV head is replicated on 2 ranks
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
    moe = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               num_experts_per_tok=2, tie_word_embeddings=False)
    if arch == "qwen3_moe":
        return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**moe, intermediate_size=40, moe_intermediate_size=16,
                                                      num_experts=8, head_dim=8))
    if arch == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(**moe, intermediate_size=16, num_local_experts=8))
    raise AssertionError(arch)


def make(arch, d=None):
    torch.manual_seed(7)
    model = build(arch).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    if d is not None:
        model.save_pretrained(d)
    return model


def boxes(key, buf, layout):
    """A worker's target: its buffer cut into the boxes ``layout`` names (what describe_targets builds)."""
    sws = [ShardedWeight(key, buf[idx], tuple(buf[idx].shape), gshape, off)
           for idx, gshape, off in layout_boxes(tuple(buf.shape), layout)]
    return sws[0] if len(sws) == 1 else sws


def receive(src, cfg, wants, layouts):
    """One worker's round in one process: a buffer per key, filled through its boxes; checked against ``wants``
    (vLLM's per-rank tensors written out by hand), with exactly their bytes received."""
    bufs = {k: torch.full_like(w, float("nan")) for k, w in wants.items()}
    rep = reshard_state_dict(src, {k: boxes(k, bufs[k], layouts[k]) for k in wants}, aoa_config=cfg, strict=False)
    for k, w in wants.items():
        assert torch.equal(bufs[k], w), k
    assert rep.bytes_received == sum(w.numel() * w.element_size() for w in wants.values())


@pytest.mark.parametrize("tp", [2, 8])
@pytest.mark.parametrize("arch", ["llama", "llama_tied", "mistral", "qwen2"])
def test_each_tp_rank_receives_vllm_rows(arch, tp):
    model = make(arch)
    src = {k: v.detach() for k, v in model.named_parameters()}
    cfg = preset("vllm", model.config)
    assert cfg["preset"] == ("vllm_qwen2" if arch == "qwen2" else "vllm_llama")
    h, g, replicas = 8, 4, max(tp // 4, 1)
    for r in range(tp):
        wants, layouts = {}, {}
        for i in range(2):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            for suffix in (["weight", "bias"] if arch == "qwen2" else ["weight"]):
                q, k, v = (src[a + f"{x}_proj.{suffix}"] for x in "qkv")
                kv = (lambda t: t.chunk(g)[r // replicas]) if tp > g else (lambda t: t.chunk(tp)[r])
                wants[a + f"qkv_proj.{suffix}"] = torch.cat([q.chunk(tp)[r], kv(k), kv(v)])
                layouts[a + f"qkv_proj.{suffix}"] = {0: qkv_parts(r, tp, h, g, 4)}
            gate, up = src[m + "gate_proj.weight"], src[m + "up_proj.weight"]
            wants[m + "gate_up_proj.weight"] = torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
            layouts[m + "gate_up_proj.weight"] = {0: merged_parts([48, 48], r, tp)}
        if arch == "llama_tied":  # the embedding feeds vLLM's lm_head too (vocabulary-parallel rows)
            wants["lm_head.weight"] = src["model.embed_tokens.weight"].chunk(tp)[r]
            layouts["lm_head.weight"] = {0: ([(0, 64 // tp, r * 64 // tp)], 64)}
        receive(src, cfg, wants, layouts)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_vllm_preset_back_to_hf_bit_for_bit(arch, tmp_path):
    hf = tmp_path / "hf"
    make(arch, hf)
    src = st_tensors(hf)
    cfg = preset("vllm", hf)
    meta = convert_checkpoint(hf, tmp_path / "vllm", aoa_config=cfg, show_progress=False)
    assert "model.layers.1.self_attn.qkv_proj.weight" in meta.tensors and "model.layers.1.mlp.up_proj.weight" \
        not in meta.tensors
    export_hf(tmp_path / "vllm", tmp_path / "back", aoa_config=preset("vllm", hf, reverse=True))
    got = st_tensors(tmp_path / "back")
    assert set(got) == set(src)
    for k in src:
        assert torch.equal(got[k], src[k]), k


def experts_as(fmt, model, saved):
    """The trainer's parameters with its experts held as ``fmt``: one module per expert (what save_pretrained
    writes, ``saved``), stacked (transformers 5 in memory) or grouped-GEMM ``w1``/``w3`` ``[E, H, I]``, ``w2``
    ``[E, I, H]``; and every layer's stacked ``gate_up`` ``[E, 2I, H]`` and ``down`` ``[E, H, I]`` (the oracle)."""
    mem = {k: v.detach() for k, v in model.named_parameters()}
    stacked = {k: v for k, v in mem.items() if ".experts." in k}
    if fmt == "modules":
        return saved, stacked
    if fmt == "stacked":
        return mem, stacked
    out = {k: v for k, v in mem.items() if ".experts." not in k}
    for k, v in stacked.items():
        if k.endswith("gate_up_proj"):
            gate, up = v.chunk(2, 1)
            out[k.replace("gate_up_proj", "w1")] = gate.transpose(1, 2).contiguous()
            out[k.replace("gate_up_proj", "w3")] = up.transpose(1, 2).contiguous()
        else:
            out[k.replace("down_proj", "w2")] = v.transpose(1, 2).contiguous()
    return out, stacked


# (engine, worker) -> (the global ids of its experts, TP rank, TP size): a TP=2 engine splits every expert, an
# expert-parallel one holds whole experts (vLLM's linear placement, and round robin over 4 ranks)
MOE_WORKERS = {"tp2": [(list(range(8)), r, 2) for r in range(2)],
               "ep2": [(list(range(4 * r, 4 * r + 4)), 0, 1) for r in range(2)],
               "ep4_round_robin": [([r, r + 4], 0, 1) for r in range(4)]}


@pytest.mark.parametrize("engine", sorted(MOE_WORKERS))
@pytest.mark.parametrize("fmt", ["modules", "stacked", "grouped"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_each_moe_worker_receives_its_experts(arch, fmt, engine, tmp_path):
    model = make(arch, tmp_path / "hf")
    src, stacked = experts_as(fmt, model, st_tensors(tmp_path / "hf"))
    assert experts_format(src) == fmt
    cfg = preset("vllm", model.config, source=list(src))
    assert cfg["preset"] == f"vllm_{arch}"
    block = "mlp" if arch == "qwen3_moe" else "block_sparse_moe"
    for experts, r, tp in MOE_WORKERS[engine]:
        wants, layouts = {}, {}
        for i in range(2):
            gate_up, down = stacked[f"model.layers.{i}.mlp.experts.gate_up_proj"][experts], \
                stacked[f"model.layers.{i}.mlp.experts.down_proj"][experts]
            gate, up = gate_up.chunk(2, 1)
            w13 = torch.cat([gate.chunk(tp, 1)[r], up.chunk(tp, 1)[r]], 1)  # vLLM: w1 rows, then w3 rows
            w2 = down.chunk(tp, 2)[r]
            base = f"model.layers.{i}.{block}.experts.routed_experts."
            for pname, want in (("w13_weight", w13), ("w2_weight", w2)):
                wants[base + pname] = want
                layouts[base + pname] = fused_moe_layout(pname, tuple(want.shape), experts, 8, r, tp)
        receive(src, cfg, wants, layouts)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_vllm_moe_preset_back_to_hf_bit_for_bit(arch, tmp_path):
    hf = tmp_path / "hf"
    make(arch, hf)
    src = st_tensors(hf)
    convert_checkpoint(hf, tmp_path / "vllm", aoa_config=preset("vllm", hf), show_progress=False)
    export_hf(tmp_path / "vllm", tmp_path / "back", aoa_config=preset("vllm", hf, reverse=True))
    got = st_tensors(tmp_path / "back")
    assert set(got) == set(src)
    for k in src:
        assert torch.equal(got[k], src[k]), k


def test_layout_parts_of_replicated_kv_heads_and_experts():
    # 4 q heads, 1 KV head of dim 32 at TP=2: each rank 2 q heads, and the one k and v head (global rows 128:160,
    # 160:192) -- the same boxes on both ranks
    assert qkv_parts(0, 2, 4, 1, 32) == ([(0, 64, 0), (64, 32, 128), (96, 32, 160)], 192)
    assert qkv_parts(1, 2, 4, 1, 32) == ([(0, 64, 64), (64, 32, 128), (96, 32, 160)], 192)
    # 8 KV heads at TP=16: ranks 2k and 2k+1 hold KV head k
    assert qkv_parts(5, 16, 32, 8, 2)[0][1:] == [(4, 2, 64 + 2 * 2), (6, 2, 64 + 16 + 2 * 2)]
    with pytest.raises(Exception, match="cannot be split over 3 TP ranks"):
        qkv_parts(0, 3, 4, 2, 8)
    assert merged_parts([48, 48], 1, 2) == ([(0, 24, 24), (24, 24, 72)], 96)
    # round-robin experts are one box each, consecutive ones one box
    lay = fused_moe_layout("w13_weight", (3, 2 * 16, 32), [0, 1, 5], 8, 0, 1)
    assert lay[0] == ([(0, 2, 0), (2, 1, 5)], 8) and lay[1] == ([(0, 16, 0), (16, 16, 16)], 32)
    assert len(layout_boxes((3, 32, 32), lay)) == 4
    with pytest.raises(Exception, match="w13_weight_scale.*not an unquantised weight"):
        fused_moe_layout("w13_weight_scale", (3, 2), [0, 1, 2], 8, 0, 1)


def test_vllm_preset_refuses_an_architecture_it_lacks():
    cfg = {"model_type": "gpt2", "n_head": 4}
    with pytest.raises(PresetError, match="no vLLM preset for model_type 'gpt2'.*vllm_llama, vllm_mixtral, "
                                          "vllm_qwen2, vllm_qwen3_moe"):
        preset("vllm", cfg)
    with pytest.raises(PresetError, match="preset 'vllm_llama' is for model_type llama, mistral"):
        preset("vllm_llama", {"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2})
    with pytest.raises(PresetError, match="experts='packed' is not one of modules, stacked, grouped"):
        preset("vllm_mixtral", build("mixtral").config, experts="packed")


def test_aoa_explain_shows_the_vllm_presets(tmp_path):
    hf = tmp_path / "hf"
    make("llama", hf)
    r = run_cli("aoa", "explain", "--preset", "vllm_llama", "--source", hf, "--only",
                "model.layers.0.self_attn.qkv_proj.weight")
    assert r.returncode == 0, r.stderr
    # HF's [q; k; v] (8 q heads, 4 KV heads of 4 rows), whichever TP degree the engine runs
    assert "model.layers.0.self_attn.qkv_proj.weight  [64, 32] float32" in r.stdout, r.stdout
    assert "[28:32, 0:32] <- model.layers.0.self_attn.q_proj.weight[28:32, 0:32]" in r.stdout, r.stdout
    assert "[32:36, 0:32] <- model.layers.0.self_attn.k_proj.weight[0:4, 0:32]" in r.stdout, r.stdout
    assert "[48:52, 0:32] <- model.layers.0.self_attn.v_proj.weight[0:4, 0:32]" in r.stdout, r.stdout
    make("qwen3_moe", tmp_path / "moe")
    r = run_cli("aoa", "explain", "--preset", "vllm_qwen3_moe", "--source", tmp_path / "moe", "--tp", "2",
                "--only", "model.layers.1.mlp.experts.routed_experts.*")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "model.layers.1.mlp.experts.routed_experts.w13_weight  [8, 32, 32] float32" in out, out
    assert "TP 2 on axis 0: rank 0: 0:4; rank 1: 4:8" in out, out  # expert parallel: whole experts per rank
    assert "[5:6, 16:32, 0:32] <- model.layers.1.mlp.experts.5.up_proj.weight[0:16, 0:32]" in out, out
    assert "[7:8, 0:32, 0:16] <- model.layers.1.mlp.experts.7.down_proj.weight[0:32, 0:16]" in out, out


def test_with_casts_fp32_master_weights_into_bf16_vllm_targets():
    """``OarlockTrainerInitInfo(dtype="bfloat16")``: the vLLM preset plus a cast of every key it produces; a live
    reshard (one process) fills bf16 targets in vLLM's layout at TP=1 with the rounded fp32 values."""
    from oarlock.integrations.vllm import with_casts

    torch.manual_seed(3)
    model = build("llama")
    src = {k: v.detach().clone() for k, v in model.named_parameters()}
    cfg = with_casts(preset("vllm", model.config), src, "bfloat16")
    assert "model.layers.1.self_attn.qkv_proj.weight -> model.layers.1.self_attn.qkv_proj.weight, " \
           "dtype='bfloat16'" in cfg["aoa_statements"]
    # the appended casts are listed as generated (an error never quotes them as the user's)
    start = len(preset("vllm", model.config)["aoa_statements"])
    assert cfg["generated_statements"] == [[start, len(cfg["aoa_statements"]), "with_casts(dtype='bfloat16')"]]
    assert all(", dtype='bfloat16'" in st for st in cfg["aoa_statements"][start:])
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


@pytest.mark.multiproc
def test_moe_trainers_into_moe_workers_on_four_ranks(multirank):
    """Expert-parallel and FSDP2 trainers (2 ranks) into TP-split and expert-parallel vLLM-shaped workers (2 ranks)
    through WeightSync: each worker receives exactly its experts' slices (_vllm_moe_scenarios.py)."""
    multirank("_vllm_moe_scenarios", world=4, timeout_s=300).check()


def test_a_mismatch_in_a_preset_statement_names_the_preset_not_the_user():
    """aoa_config_for keeps the preset's name: a trainer whose intermediate_size differs from the engine's is told
    which preset statement fused its keys, not "your AOA statement" (issue 49 item 6)."""
    from oarlock.checkpoint import PlanError, WeightSync
    from oarlock.integrations.vllm import aoa_config_for

    T = transformers
    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                tie_word_embeddings=False)
    trainer = T.LlamaForCausalLM(T.LlamaConfig(**base, intermediate_size=96))
    aoa = aoa_config_for(trainer.config)
    assert aoa["preset"] == "vllm_llama"
    targets = {"model.layers.0.mlp.gate_up_proj.weight": torch.zeros(128, 32)}  # an engine with intermediate 64
    with pytest.raises(PlanError) as got:
        WeightSync(dict(trainer.named_parameters()), targets, aoa_config=aoa, strict=False).run()
    msg = str(got.value)
    assert "'model.layers.0.mlp.gate_proj.weight' [96, 32] float32" in msg and "[64, 32]" in msg, msg
    assert "of AOA preset 'vllm_llama': model.layers.0.mlp.gate_proj.weight, model.layers.0.mlp.up_proj.weight " \
           "-> model.layers.0.mlp.gate_up_proj.weight" in msg and "your AOA statement" not in msg, msg
    assert bool((targets["model.layers.0.mlp.gate_up_proj.weight"] == 0).all())
