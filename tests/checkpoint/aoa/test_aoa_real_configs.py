"""Statements from public model code (FlexCheckpoint spec section 6), rendered with small numbers, applied to
synthetic checkpoints of the right key layout and checked against plain torch."""

import torch

from oarlock.checkpoint.aoa import compile_aoa
from oarlock.checkpoint.model.mapping import TensorSpec, execute_on_full_tensors

from aoa_shardsim import assert_shards_equal, even_boxes, load_shards, shard


def spec(t):
    return TensorSpec(tuple(t.shape), str(t.dtype).removeprefix("torch."))


def run(cfg, ck, dst=None, **kw):
    prog = compile_aoa(cfg, {k: spec(v) for k, v in ck.items()}, dst, **kw)
    return prog, execute_on_full_tensors(prog, ck)


def r(*shape):
    return torch.randn(*shape)


def test_llama_paddleformers_config():  # 6.1, model_prefix = "model."
    ck = {"model.embed_tokens.weight": r(10, 4)}
    for i in range(2):
        ck[f"model.layers.{i}.input_layernorm.weight"] = r(4)
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            ck[f"model.layers.{i}.self_attn.{n}.weight"] = r(4, 4)
    cfg = ["model.embed_tokens.weight -> model.embed_tokens.weight",
           "model.layers.$LAYER_ID.input_layernorm.weight -> model.layers.$LAYER_ID.input_layernorm.weight"]
    cfg += [f"model.layers.$LAYER_ID.self_attn.{n}.weight^T -> model.layers.$LAYER_ID.self_attn.{n}.weight"
            for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    cfg += ["model.embed_tokens.weight -> lm_head.weight"]
    _, sinks = run(cfg, ck)
    # without a destination only dataflow sinks are produced: the tied embedding was consumed by the head
    assert "model.embed_tokens.weight" not in sinks and len(sinks) == 1 + 2 * 5
    dst = {k: spec(v) for k, v in sinks.items()} | {"model.embed_tokens.weight": spec(ck["model.embed_tokens.weight"])}
    _, out = run(cfg, ck, dst)
    assert torch.equal(out["lm_head.weight"], ck["model.embed_tokens.weight"])
    assert torch.equal(out["model.embed_tokens.weight"], ck["model.embed_tokens.weight"])
    for i in range(2):
        k = f"model.layers.{i}.self_attn.k_proj.weight"
        assert torch.equal(out[k], ck[k].T)


def test_qwen3_moe_grouped_gemm_with_joined_literals():  # 6.3: two f-strings adjacent without a comma
    experts, hid, inter = 3, 4, 2
    ck = {"model.layers.0.mlp.gate.weight": r(experts, hid).to(torch.bfloat16),
          "model.layers.0.self_attn.q_norm.weight": r(hid)}
    for e in range(experts):
        ck[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = r(inter, hid)
        ck[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = r(hid, inter)
    g1 = ", ".join(f"model.layers.0.mlp.experts.{e}.up_proj.weight^T" for e in range(experts))
    g2 = ", ".join(f"model.layers.0.mlp.experts.{e}.down_proj.weight^T" for e in range(experts))
    tgt = "layers.0"
    cfg = [f"{g1} -> {tgt}.mlp.grouped_gemm_experts.weight1, axis=0"
           f"{g2} -> {tgt}.mlp.grouped_gemm_experts.weight2, axis=0",
           "model.layers.$LAYER_ID.mlp.gate.weight^T -> layers.$LAYER_ID.mlp.gate.weight, dtype='float32'",
           "model.layers.$LAYER_ID.self_attn.q_norm.weight -> layers.$LAYER_ID.self_attn.q_layernorm.weight"]
    _, out = run(cfg, ck)
    assert torch.equal(out["layers.0.mlp.grouped_gemm_experts.weight1"],
                       torch.cat([ck[f"model.layers.0.mlp.experts.{e}.up_proj.weight"].T for e in range(experts)], 0))
    assert torch.equal(out["layers.0.mlp.grouped_gemm_experts.weight2"],
                       torch.cat([ck[f"model.layers.0.mlp.experts.{e}.down_proj.weight"].T for e in range(experts)], 0))
    assert out["layers.0.mlp.gate.weight"].dtype == torch.float32
    assert torch.equal(out["layers.0.mlp.gate.weight"], ck["model.layers.0.mlp.gate.weight"].T.float())
    assert torch.equal(out["layers.0.self_attn.q_layernorm.weight"], ck["model.layers.0.self_attn.q_norm.weight"])


def test_ernie_round_trip_unfuse_tp2_checkpoint():  # 6.8: fused_qkv_old / fused_ffn split into plain weights
    h, kv, d, hid, inter, t = 20, 4, 2, 6, 8, 2
    q, k, v = r(hid, h * d), r(hid, kv * d), r(hid, kv * d)
    gate, up = r(hid, inter), r(hid, inter)
    qkv = torch.cat([x for rk in range(t) for x in (q.chunk(t, 1)[rk], k.chunk(t, 1)[rk], v.chunk(t, 1)[rk])], 1)
    ug = torch.cat([x for rk in range(t) for x in (gate.chunk(t, 1)[rk], up.chunk(t, 1)[rk])], 1)
    ck = {"ernie.layers.0.self_attn.qkv_proj.weight": qkv, "ernie.layers.0.mlp.up_gate_proj.weight": ug}
    cfg = ["ernie.layers.$LAYER_ID.self_attn.qkv_proj.weight -> ernie.layers.$LAYER_ID.self_attn.q_proj.weight,"
           "ernie.layers.$LAYER_ID.self_attn.k_proj.weight,ernie.layers.$LAYER_ID.self_attn.v_proj.weight, "
           "fused_qkv_old, num_heads=20, num_key_value_groups=4",
           "ernie.layers.$LAYER_ID.mlp.up_gate_proj.weight -> ernie.layers.$LAYER_ID.mlp.gate_proj.weight,"
           "ernie.layers.$LAYER_ID.mlp.up_proj.weight, fused_ffn"]
    expect = {"ernie.layers.0.self_attn.q_proj.weight": q, "ernie.layers.0.self_attn.k_proj.weight": k,
              "ernie.layers.0.self_attn.v_proj.weight": v, "ernie.layers.0.mlp.gate_proj.weight": gate,
              "ernie.layers.0.mlp.up_proj.weight": up}
    prog = compile_aoa(cfg, {n: spec(x) for n, x in ck.items()}, {n: spec(x) for n, x in expect.items()},
                       source_shards={n: t for n in ck})
    loaded = load_shards(prog, {n: shard(x, even_boxes(x.shape, 1, t)) for n, x in ck.items()},
                         {n: even_boxes(x.shape, 1, 2) for n, x in expect.items()})
    assert_shards_equal(loaded, expect)


def test_ernie_star_stacks_experts_and_moe_generator_offsets():  # 6.10 and 6.7
    ck = {f"ernie.layers.1.mlp.experts.{e}.down_proj.weight": r(3, 2) for e in range(4)}
    ck |= {f"model.layers.5.mlp.experts.{e}.{n}.weight": r(2, 3) for e in range(2) for n in ("gate_proj", "up_proj")}
    prefix, prefix_offset = "model.layers.5", "model.layers.4"  # num_empty_layers_add_in_head = 1
    cfg = ["ernie.layers.1.mlp.experts.*.down_proj.weight -> ernie.layers.1.mlp.experts_fused.down_proj.weight,axis=1",
           f"{prefix}.mlp.experts.$EXPERT_ID.gate_proj.weight, {prefix}.mlp.experts.$EXPERT_ID.up_proj.weight -> "
           f"{prefix_offset}.mlp.experts.$EXPERT_ID.up_gate_proj.weight, axis=0"]
    _, out = run(cfg, ck)
    assert torch.equal(out["ernie.layers.1.mlp.experts_fused.down_proj.weight"],
                       torch.cat([ck[f"ernie.layers.1.mlp.experts.{e}.down_proj.weight"] for e in range(4)], 1))
    for e in range(2):
        assert torch.equal(out[f"model.layers.4.mlp.experts.{e}.up_gate_proj.weight"],
                           torch.cat([ck[f"model.layers.5.mlp.experts.{e}.gate_proj.weight"],
                                      ck[f"model.layers.5.mlp.experts.{e}.up_proj.weight"]], 0))
    assert len(out) == 3


def test_gpt_oss_sourceless_buffers_and_deepseek_inverse():  # 6.6 and 6.4
    ck = {"layers.0.mlp.up_gate_proj.weight": r(3, 8), "layers.0.mlp.gate.weight": r(4, 3)}
    dst = {"model.layers.0.mlp.gate_proj.weight": TensorSpec((3, 4), "float32"),
           "model.layers.0.mlp.up_proj.weight": TensorSpec((3, 4), "float32"),
           "model.layers.0.mlp.gate.weight": TensorSpec((4, 3), "bfloat16"),
           "rotary_emb.inv_freq": TensorSpec((2,), "float32")}
    cfg = ["_ -> rotary_emb.inv_freq",
           "layers.$LAYER_ID.mlp.gate.weight -> model.layers.$LAYER_ID.mlp.gate.weight, dtype='bfloat16'",
           "layers.0.mlp.up_gate_proj.weight -> model.layers.0.mlp.gate_proj.weight, "
           "model.layers.0.mlp.up_proj.weight, "
           "fused_ffn"]
    prog, out = run(cfg, ck, dst)
    assert prog.skipped == ["rotary_emb.inv_freq"]
    assert torch.equal(out["model.layers.0.mlp.gate_proj.weight"], ck["layers.0.mlp.up_gate_proj.weight"][:, :4])
    assert torch.equal(out["model.layers.0.mlp.up_proj.weight"], ck["layers.0.mlp.up_gate_proj.weight"][:, 4:])
    assert torch.equal(out["model.layers.0.mlp.gate.weight"], ck["layers.0.mlp.gate.weight"].to(torch.bfloat16))
