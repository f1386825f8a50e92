"""Fused macros checked numerically: the fused tensor is built from known Q/K/V (or gate/up) with plain torch,
stored as TP shards of degree T_src, loaded shard by shard into TP degree T_dst, compared element by element.
Also the forward -> reverse round trip of a full model config."""

import pytest
import torch

from oarlock.checkpoint.aoa import compile_aoa
from oarlock.checkpoint.model.mapping import TensorSpec, execute_on_full_tensors

from aoa_shardsim import assert_shards_equal, even_boxes, load_shards, shard


def spec(t):
    return TensorSpec(tuple(t.shape), str(t.dtype).removeprefix("torch."))


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def heads(t, n, axis):
    return list(t.chunk(n, axis))


def gqa_fused(q, k, v, h, g, axis):
    """Reference GQA layout: per KV group, its R = h/g query heads, then its K head, then its V head."""
    qh, kh, vh = heads(q, h, axis), heads(k, g, axis), heads(v, g, axis)
    r = h // g
    return torch.cat([x for j in range(g) for x in qh[j * r:(j + 1) * r] + [kh[j], vh[j]]], axis)


def tp_blocked_qkv(q, k, v, t, axis):
    """Reference legacy Paddle layout: rank r's [Q heads, K heads, V heads] blocks, concatenated over ranks."""
    return torch.cat([x for r in range(t) for x in (q.chunk(t, axis)[r], k.chunk(t, axis)[r], v.chunk(t, axis)[r])],
                     axis)


def tp_blocked_ffn(gate, up, t, axis):
    return torch.cat([x for r in range(t) for x in (gate.chunk(t, axis)[r], up.chunk(t, axis)[r])], axis)


@pytest.mark.parametrize("h,g,t_src,t_dst", [(8, 2, 2, 4), (4, 4, 1, 2), (6, 3, 2, 3), (8, 1, 4, 2), (2, 1, 1, 1)])
def test_fused_qkv_gqa_from_hf_sharded(h, g, t_src, t_dst):
    d, hid = 4, 6
    q, k, v = rand(h * d, hid, seed=1), rand(g * d, hid, seed=2), rand(g * d, hid, seed=3)
    src = {"q": q, "k": k, "v": v}
    expect = gqa_fused(q.T, k.T, v.T, h, g, 1)
    prog = compile_aoa([f"q^T, k^T, v^T -> qkv, fused_qkv, num_heads={h}, num_key_value_groups={g}"],
                       {n: spec(x) for n, x in src.items()}, {"qkv": spec(expect)})
    # HF column-parallel [out, in] shards along dim 0 with degree T_src; the fused target along dim 1 with T_dst
    stored = {n: shard(x, even_boxes(x.shape, 0, t_src)) for n, x in src.items()}
    loaded = load_shards(prog, stored, {"qkv": even_boxes(expect.shape, 1, t_dst)})
    assert_shards_equal(loaded, {"qkv": expect})
    # the split form inverts it (export): q/k/v from the fused tensor, sharded the other way round
    prog2 = compile_aoa([f"qkv -> q, k, v, fused_qkv, num_heads={h}, num_key_value_groups={g}"], {"qkv": spec(expect)})
    back = load_shards(prog2, {"qkv": shard(expect, even_boxes(expect.shape, 1, t_dst))},
                       {n: even_boxes(x.T.shape, 1, t_src) for n, x in src.items()})
    assert_shards_equal(back, {n: x.T for n, x in src.items()})


@pytest.mark.parametrize("h,kv,t_src,t_dst", [(8, 4, 2, 4), (8, 2, 1, 2), (6, 3, 3, 1), (12, 4, 4, 2), (4, 4, 4, 4)])
def test_fused_qkv_old_relayout(h, kv, t_src, t_dst):
    d, hid, axis = 2, 5, 1
    q, k, v = rand(hid, h * d, seed=4), rand(hid, kv * d, seed=5), rand(hid, kv * d, seed=6)
    x_src = tp_blocked_qkv(q, k, v, t_src, axis)
    x_dst = tp_blocked_qkv(q, k, v, t_dst, axis)
    key = "layers.2.self_attn.qkv_proj.weight"
    m1 = rand(*x_src.shape, seed=7)  # an optimizer moment stored in the same layout
    src = {key: x_src, key + ".moment1_0": m1}
    # the moments are stored in layout(T_src) too: recover their q/k/v parts to build the expected layout(T_dst)
    blocks = [list(b.split([h * d // t_src, kv * d // t_src, kv * d // t_src], axis)) for b in m1.chunk(t_src, axis)]
    qm1, km1, vm1 = (torch.cat([b[i] for b in blocks], axis) for i in range(3))
    prog = compile_aoa([f"{key} -> {key}, fused_qkv_old, num_heads = {h}, num_key_value_groups = {kv}"],
                       {n: spec(x) for n, x in src.items()}, {key: spec(x_dst), key + ".moment1_0": spec(x_dst)},
                       source_shards={key: t_src, key + ".moment1_0": t_src}, destination_shards={key: t_dst})
    stored = {n: shard(x, even_boxes(x.shape, axis, t_src)) for n, x in src.items()}
    loaded = load_shards(prog, stored, {key: even_boxes(x_dst.shape, axis, t_dst),
                                        key + ".moment1_0": even_boxes(x_dst.shape, axis, t_dst)})
    assert_shards_equal(loaded, {key: x_dst, key + ".moment1_0": tp_blocked_qkv(qm1, km1, vm1, t_dst, axis)})
    # 1 -> 3: split a TP-blocked checkpoint into plain q, k, v (ERNIE 4-round config)
    prog = compile_aoa([f"x -> qq, kk, vv, fused_qkv_old, num_heads={h}, num_key_value_groups={kv}"],
                       {"x": spec(x_src)}, source_shards={"x": t_src})
    out = execute_on_full_tensors(prog, {"x": x_src})
    assert torch.equal(out["qq"], q) and torch.equal(out["kk"], k) and torch.equal(out["vv"], v)
    # 3 -> 1: build the TP-blocked layout for T_dst from plain q, k, v
    prog = compile_aoa([f"qq, kk, vv -> y, fused_qkv_old, num_heads={h}, num_key_value_groups={kv}"],
                       {"qq": spec(q), "kk": spec(k), "vv": spec(v)}, {"y": spec(x_dst)},
                       destination_shards={"y": t_dst})
    loaded = load_shards(prog, {"qq": shard(q, even_boxes(q.shape, 0, 1)), "kk": shard(k, even_boxes(k.shape, 0, 1)),
                                "vv": shard(v, even_boxes(v.shape, 0, 1))}, {"y": even_boxes(x_dst.shape, axis, t_dst)})
    assert_shards_equal(loaded, {"y": x_dst})


@pytest.mark.parametrize("t_src,t_dst", [(2, 4), (4, 2), (1, 3), (3, 2), (2, 2)])
@pytest.mark.parametrize("axis", [0, 1])
def test_fused_ffn_relayout(t_src, t_dst, axis):
    inter, hid = 12, 3
    shape = (inter, hid) if axis == 0 else (hid, inter)
    gate, up = rand(*shape, seed=11), rand(*shape, seed=12)
    x_src, x_dst = tp_blocked_ffn(gate, up, t_src, axis), tp_blocked_ffn(gate, up, t_dst, axis)
    k = "layers.2.mlp.gate_up_fused_proj.weight"
    prog = compile_aoa([f"{k} -> {k}, fused_ffn, axis={axis}"], {k: spec(x_src)}, {k: spec(x_dst)},
                       source_shards={k: t_src}, destination_shards={k: t_dst})
    loaded = load_shards(prog, {k: shard(x_src, even_boxes(x_src.shape, axis, t_src))},
                         {k: even_boxes(x_dst.shape, axis, t_dst)})
    assert_shards_equal(loaded, {k: x_dst})
    # 1 -> 2: split into gate, up (always gate first)
    prog = compile_aoa([f"x -> g, u, fused_ffn, axis={axis}"], {"x": spec(x_src)}, source_shards={"x": t_src})
    out = execute_on_full_tensors(prog, {"x": x_src})
    assert torch.equal(out["g"], gate) and torch.equal(out["u"], up)
    # 2 -> 1: fuse plain gate/up for TP degree t_dst
    prog = compile_aoa([f"g, u -> y, fused_ffn, axis={axis}"], {"g": spec(gate), "u": spec(up)}, {"y": spec(x_dst)},
                       destination_shards={"y": t_dst})
    loaded = load_shards(prog, {"g": shard(gate, even_boxes(gate.shape, 1 - axis, 1)),
                                "u": shard(up, even_boxes(up.shape, 1 - axis, 1))},
                         {"y": even_boxes(x_dst.shape, axis, t_dst)})
    assert_shards_equal(loaded, {"y": x_dst})


def _qwen_like_checkpoint(layers=2, experts=2, h=4, g=2, d=2, hid=8, inter=6, vocab=10):
    torch.manual_seed(0)
    ck = {"model.embed_tokens.weight": torch.randn(vocab, hid).to(torch.bfloat16),
          "model.norm.weight": torch.randn(hid)}
    for i in range(layers):
        p = f"model.layers.{i}"
        ck[f"{p}.input_layernorm.weight"] = torch.randn(hid)
        ck[f"{p}.self_attn.q_proj.weight"] = torch.randn(h * d, hid)
        ck[f"{p}.self_attn.k_proj.weight"] = torch.randn(g * d, hid)
        ck[f"{p}.self_attn.v_proj.weight"] = torch.randn(g * d, hid)
        ck[f"{p}.self_attn.q_proj.bias"] = torch.randn(h * d)
        ck[f"{p}.self_attn.k_proj.bias"] = torch.randn(g * d)
        ck[f"{p}.self_attn.v_proj.bias"] = torch.randn(g * d)
        ck[f"{p}.self_attn.o_proj.weight"] = torch.randn(hid, h * d)
        ck[f"{p}.mlp.gate.weight"] = torch.randn(experts, hid).to(torch.bfloat16)
        for e in range(experts):
            for n in ("gate_proj", "up_proj"):
                ck[f"{p}.mlp.experts.{e}.{n}.weight"] = torch.randn(inter, hid)
            ck[f"{p}.mlp.experts.{e}.down_proj.weight"] = torch.randn(hid, inter)
    return ck


QWEN_LIKE = [
    "model.embed_tokens.weight -> embed_tokens.weight, src_dtype='bfloat16', dst_dtype='float32'",
    "model.layers.$LAYER_ID.input_layernorm.weight -> layers.$LAYER_ID.input_layernorm.weight",
    "model.layers.$LAYER_ID.self_attn.q_proj.weight^T, model.layers.$LAYER_ID.self_attn.k_proj.weight^T, "
    "model.layers.$LAYER_ID.self_attn.v_proj.weight^T -> layers.$LAYER_ID.self_attn.qkv_proj.weight, fused_qkv, "
    "num_heads=4, num_key_value_groups=2",
    "model.layers.$LAYER_ID.self_attn.q_proj.bias, model.layers.$LAYER_ID.self_attn.k_proj.bias, "
    "model.layers.$LAYER_ID.self_attn.v_proj.bias -> layers.$LAYER_ID.self_attn.qkv_proj.bias, fused_qkv, "
    "num_heads=4, num_key_value_groups=2, axis=0",
    "model.layers.$LAYER_ID.self_attn.o_proj.weight^T -> layers.$LAYER_ID.self_attn.o_proj.weight",
    "model.layers.$LAYER_ID.mlp.gate.weight^T -> layers.$LAYER_ID.mlp.gate.weight, "
    "src_dtype='bfloat16', dst_dtype='float32'",
    "model.layers.$LAYER_ID.mlp.experts.$EXPERT_ID.gate_proj.weight^T, "
    "model.layers.$LAYER_ID.mlp.experts.$EXPERT_ID.up_proj.weight^T -> "
    "layers.$LAYER_ID.mlp.experts.$EXPERT_ID.up_gate_proj.weight, fused_ffn",
    "model.layers.$LAYER_ID.mlp.experts.$EXPERT_ID.down_proj.weight -> "
    "layers.$LAYER_ID.mlp.experts.$EXPERT_ID.down_proj.weight, permute='[1, 0]'",
    "model.norm.weight -> norm.weight\n",
]


def test_forward_then_reverse_round_trip_is_bit_exact():
    ck = _qwen_like_checkpoint()
    fwd = compile_aoa(QWEN_LIKE, {k: spec(v) for k, v in ck.items()})
    model = execute_on_full_tensors(fwd, ck)
    assert len(model) == 2 + 2 * (5 + 2 * 2)
    assert model["embed_tokens.weight"].dtype == torch.float32
    up_gate = model["layers.1.mlp.experts.0.up_gate_proj.weight"]
    assert torch.equal(up_gate, torch.cat([ck["model.layers.1.mlp.experts.0.gate_proj.weight"].T,
                                           ck["model.layers.1.mlp.experts.0.up_proj.weight"].T], 1))
    # reverse mode with no destination: the sinks are exactly the checkpoint keys again
    rev = compile_aoa({"aoa_statements": QWEN_LIKE, "aoa_config_reverse": True}, {k: spec(v) for k, v in model.items()})
    back = execute_on_full_tensors(rev, model)
    assert set(back) == set(ck)
    for k, v in ck.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    # and with the HF key set given as destination, sharded both ways
    rev2 = compile_aoa({"aoa_statements": QWEN_LIKE, "aoa_config_reverse": True},
                       {k: spec(v) for k, v in model.items()}, {k: spec(v) for k, v in ck.items()})
    stored = {k: shard(v, even_boxes(v.shape, 0, 2 if v.shape[0] % 2 == 0 else 1)) for k, v in model.items()}
    loaded = load_shards(rev2, stored, {k: even_boxes(v.shape, v.dim() - 1, 2) for k, v in ck.items()})
    assert_shards_equal(loaded, ck)


def test_reverse_plain_cast_uses_destination_dtype():
    w = rand(3, 2).to(torch.bfloat16)
    fwd = compile_aoa(["w -> w, dtype='float32'"], {"w": spec(w)})
    model = execute_on_full_tensors(fwd, {"w": w})
    rev = compile_aoa({"aoa_statements": ["w -> w, dtype='float32'"], "aoa_config_reverse": True},
                      {"w": spec(model["w"])}, {"w": spec(w)})
    back = execute_on_full_tensors(rev, model)
    assert back["w"].dtype == torch.bfloat16 and torch.equal(back["w"], w)


def test_shard_counts_from_metadata_drive_fused_ffn():
    from oarlock.checkpoint.aoa import shard_counts, source_specs
    from oarlock.checkpoint.model.metadata import CheckpointMetadata, ShardMeta, TensorMeta

    gate, up = rand(3, 8, seed=1), rand(3, 8, seed=2)
    x = tp_blocked_ffn(gate, up, 2, 1)
    meta = CheckpointMetadata("oarlock")
    # TP 2 x DP 2: two distinct offsets, each stored twice (a replica); the moment is flattened per TP box
    meta.tensors["w"] = TensorMeta("w", (3, 16), "float32", [
        ShardMeta((0, 0), (3, 8), "0.safetensors", "w"), ShardMeta((0, 8), (3, 8), "1.safetensors", "w"),
        ShardMeta((0, 0), (3, 8), "2.safetensors", "w", replica_id=1)])
    meta.tensors["w.exp_avg"] = TensorMeta("w.exp_avg", (3, 16), "float32", [
        ShardMeta((0, 0), (3, 8), "0.safetensors", "m", (0, 12)),
        ShardMeta((0, 0), (3, 8), "2.safetensors", "m", (12, 24)),
        ShardMeta((0, 8), (3, 8), "1.safetensors", "m")])
    assert shard_counts(meta) == {"w": 2, "w.exp_avg": 2}
    prog = compile_aoa(["w -> g, u, fused_ffn"], source_specs(meta), source_shards=shard_counts(meta))
    out = execute_on_full_tensors(prog, {"w": x, "w.exp_avg": x * 2})
    assert torch.equal(out["g"], gate) and torch.equal(out["u"], up)
    assert torch.equal(out["g.exp_avg"], gate * 2) and torch.equal(out["u.exp_avg"], up * 2)
