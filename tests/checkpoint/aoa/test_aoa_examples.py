"""The spec's worked examples (FlexCheckpoint spec 2.5, 2.7, 2.8, 2.10, 6.11), checked numerically against plain
torch code written here, and the macro expansions against the expansions the spec quotes."""

import re

import pytest
import torch

from oarlock.checkpoint.aoa import AOAError, compile_aoa, expand_statements
from oarlock.checkpoint.model.mapping import SliceMapping, TensorSpec, execute_on_full_tensors

from aoa_shardsim import assert_shards_equal, even_boxes, load_shards, shard


def spec(t: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(t.shape), str(t.dtype).removeprefix("torch."))


def specs(d):
    return {k: spec(v) for k, v in d.items()}


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g).to(dtype)


def run(config, src, dst=None, **kw):
    prog = compile_aoa(config, specs(src), None if dst is None else specs(dst), **kw)
    return prog, execute_on_full_tensors(prog, src)


def norm(s: str) -> str:
    return re.sub(r"\s+", "", s).replace('"', "'")


def expanded(config, src_keys, dst_keys=None, **kw):
    return [norm(e.render()) for e in expand_statements(config, src_keys, dst_keys, **kw)]


# ---- section 2.7 worked examples --------------------------------------------------------------------------

def test_split_merge_query_matches_spec_entries():
    src = {"s0": rand(2, 2), "s1": rand(2, 2, seed=1)}
    dst = {"d0": torch.empty(1, 4), "d1": torch.empty(1, 4)}
    prog, out = run(["s0, s1 -> s, axis = 1", "s -> d0, d1, axis = 0"], src, dst)
    # spec: d1 full box -> d1[0:1,0:2] <- s0[1:2,0:2] and d1[0:1,2:4] <- s1[1:2,0:2]
    assert prog.mappings_for("d1") == [SliceMapping("d1", ((0, 1), (0, 2)), "s0", ((1, 2), (0, 2))),
                                       SliceMapping("d1", ((0, 1), (2, 4)), "s1", ((1, 2), (0, 2)))]
    full = torch.cat([src["s0"], src["s1"]], dim=1)
    assert torch.equal(out["d0"], full[0:1]) and torch.equal(out["d1"], full[1:2])


def test_transpose_cast_example():
    src = {"s0": rand(2, 2, dtype=torch.float16), "s1": rand(2, 2, dtype=torch.float16, seed=3)}
    prog, out = run(["s0, s1 -> s, axis = 1", "s -> s, dtype = 'float32'", "s^T -> d", "d -> d0, d1, axis = 1"], src)
    ref = torch.cat([src["s0"], src["s1"]], 1).float().T
    assert sorted(out) == ["d0", "d1"]
    assert torch.equal(out["d0"], ref[:, 0:1]) and torch.equal(out["d1"], ref[:, 1:2])
    # spec: d0 rows 2..3 come from s1 row 0 (shape (1, 2)), cast to float32 then transposed
    m = [m for m in prog.mappings_for("d0") if m.dst_box[0] == (2, 4)]
    assert m == [SliceMapping("d0", ((2, 4), (0, 1)), "s1", ((0, 1), (0, 2)), (1, 0), "float32")]


# ---- section 2.5 macro expansions -------------------------------------------------------------------------

def test_layer_id_offset_expansion():
    keys = ["layers.1.experts.0.weight", "layers.2.experts.0.weight"]
    got = expanded(["layers.$LAYER_ID_OFFSET.experts.0.weight -> layers.$LAYER_ID_OFFSET.experts.0.weight, axis = 1"],
                   keys)
    assert got == ["layers.1.experts.0.weight->layers.0.experts.0.weight,axis=1",
                   "layers.2.experts.0.weight->layers.1.experts.0.weight,axis=1"]


def test_star_expansion_numeric_order():
    keys = ["layers.2.experts.10.weight", "layers.2.experts.0.weight", "layers.2.experts.1.weight",
            "layers.3.experts.0.weight"]
    assert expanded(["layers.2.experts.*.weight -> fused_experts, axis = 1"], keys) == [
        "layers.2.experts.0.weight,layers.2.experts.1.weight,layers.2.experts.10.weight->fused_experts,axis=1"]


def test_array_expansion():
    assert expanded(["w[0:3] -> w, axis = 0"], ["w_0", "w_1", "w_2"]) == ["w_0,w_1,w_2->w,axis=0"]


def test_transpose_suffix_expansion():
    assert expanded(["a^T, b -> c, axis=0"], ["a", "b"]) == ["a->a_transpose_tmp,permute='[]'",
                                                           "a_transpose_tmp,b->c,axis=0"]


def test_fused_qkv_expansion():
    got = expanded(["layers.2.self_attn.qkv_proj.weight -> Q, K, V, fused_qkv, num_heads = 8, "
                    "num_key_value_groups = 2"], ["layers.2.self_attn.qkv_proj.weight"])
    assert got == ["layers.2.self_attn.qkv_proj.weight->Q0,Q1,Q2,Q3,K0,V0,Q4,Q5,Q6,Q7,K1,V1,axis=1",
                   "Q0,Q1,Q2,Q3,Q4,Q5,Q6,Q7->Q,axis=1", "K0,K1->K,axis=1", "V0,V1->V,axis=1"]


def _pieces(text):
    return [n.split(".")[-1] for n in text.split("->")[0 if text.startswith("fused") else 1].split(",")
            if "tmp" in n]


def test_fused_qkv_old_expansion_tp2_to_tp4():
    k = "layers.2.self_attn.qkv_proj.weight"
    got = expanded([f"{k} -> {k}, fused_qkv_old, num_heads = 8, num_key_value_groups = 4"], [k], [k],
                   source_shards={k: 2}, destination_shards={k: 4})
    assert len(got) == 2
    assert _pieces(got[0]) == "Q_0,Q_1,Q_2,Q_3,K_0,K_1,V_0,V_1,Q_4,Q_5,Q_6,Q_7,K_2,K_3,V_2,V_3".split(",")
    assert _pieces(got[1]) == "Q_0,Q_1,K_0,V_0,Q_2,Q_3,K_1,V_1,Q_4,Q_5,K_2,V_2,Q_6,Q_7,K_3,V_3".split(",")


def test_fused_ffn_expansion_tp2_to_tp4():
    k = "layers.2.mlp.gate_up_fused_proj.bias"
    got = expanded([f"{k} -> {k}, fused_ffn, axis=0"], [k], [k], source_shards={k: 2}, destination_shards={k: 4})
    assert _pieces(got[0]) == "GATE_0,GATE_1,UP_0,UP_1,GATE_2,GATE_3,UP_2,UP_3".split(",")
    assert _pieces(got[1]) == "GATE_0,UP_0,GATE_1,UP_1,GATE_2,UP_2,GATE_3,UP_3".split(",")
    assert got[0].endswith("axis=0")


def test_ids_match_jointly_not_cartesian():
    # ragged MoE: layer 1 has experts {0, 1}, layer 2 only expert {5}
    keys = ["m.layers.1.experts.0.w", "m.layers.1.experts.1.w", "m.layers.2.experts.5.w", "m.layers.2.norm"]
    got = expanded(["m.layers.$LAYER_ID.experts.$EXPERT_ID.w -> l$LAYER_ID.e$EXPERT_ID"], keys)
    assert got == ["m.layers.1.experts.0.w->l1.e0", "m.layers.1.experts.1.w->l1.e1", "m.layers.2.experts.5.w->l2.e5"]


def test_ids_ignore_optimizer_suffixes_and_follow_checkpoint():
    keys = ["a.3.w", "a.3.w.moment1_0", "a.7.w", "a.7.w.exp_avg"]
    assert expanded(["a.$LAYER_ID.w^T -> b.$LAYER_ID"], keys)[1::2] == ["a.3.w_transpose_tmp->b.3",
                                                                       "a.7.w_transpose_tmp->b.7"]


def test_newline_and_joined_literals(caplog):
    # "a -> b, axis=1" "c -> d" concatenated by accident: two statements (Paddle's greedy parser), with a warning
    assert expanded(["a -> b, axis=1" "c -> d", "e -> f\n\ng -> h"], ["a", "c", "e", "g"]) == [
        "a->b,axis=1", "c->d", "e->f", "g->h"]
    assert "aoa_statements[0]" in caplog.text and "without a newline" in caplog.text


# ---- section 2.10 examples, numerically -------------------------------------------------------------------

def test_cast_and_layer_transpose_and_permute():
    src = {"embedding.weight": rand(4, 3, dtype=torch.bfloat16),
           "model.layers.0.self_attn.o_proj.weight": rand(3, 5),
           "model.layers.1.self_attn.o_proj.weight": rand(3, 5, seed=1),
           "s": rand(2, 3, 4)}
    prog, out = run(["embedding.weight -> embedding.weight, dtype = 'float32'",
                     "model.layers.$LAYER_ID.self_attn.o_proj.weight^T -> "
                     "model.layers.$LAYER_ID.self_attn.o_proj.weight",
                     "s -> a, permute = '[2, 0, 1]'"], src)
    assert torch.equal(out["embedding.weight"], src["embedding.weight"].float())
    for i in (0, 1):
        k = f"model.layers.{i}.self_attn.o_proj.weight"
        assert torch.equal(out[k], src[k].T)
    assert torch.equal(out["a"], src["s"].permute(2, 0, 1))
    assert set(out) == {"embedding.weight", "model.layers.0.self_attn.o_proj.weight",
                        "model.layers.1.self_attn.o_proj.weight", "a"}


def test_star_array_offset_numerically():
    src = {f"layers.2.experts.{e}.weight": rand(2, 3, seed=e) for e in range(3)}
    src |= {f"w_{i}": rand(1, 3, seed=10 + i) for i in range(3)}
    src |= {f"layers.{i}.experts.0.bias": rand(4, seed=20 + i) for i in (1, 2)}
    _, out = run(["layers.2.experts.*.weight -> fused_experts, axis = 1", "w[0:3] -> w, axis = 0",
                  "layers.$LAYER_ID_OFFSET.experts.0.bias -> layers.$LAYER_ID_OFFSET.experts.0.bias, axis = 0"], src)
    assert torch.equal(out["fused_experts"], torch.cat([src[f"layers.2.experts.{e}.weight"] for e in range(3)], 1))
    assert torch.equal(out["w"], torch.cat([src["w_0"], src["w_1"], src["w_2"]], 0))
    assert torch.equal(out["layers.0.experts.0.bias"], src["layers.1.experts.0.bias"])
    assert torch.equal(out["layers.1.experts.0.bias"], src["layers.2.experts.0.bias"])


def test_hf_to_fused_qkv_and_back_per_layer():
    h, g, d, hid = 4, 2, 3, 5
    src = {}
    for layer in (0, 1):
        src[f"model.layers.{layer}.self_attn.q_proj.weight"] = rand(h * d, hid, seed=layer)
        src[f"model.layers.{layer}.self_attn.k_proj.weight"] = rand(g * d, hid, seed=layer + 10)
        src[f"model.layers.{layer}.self_attn.v_proj.weight"] = rand(g * d, hid, seed=layer + 20)
    p = "model.layers.$LAYER_ID.self_attn"
    cfg = [f"{p}.q_proj.weight^T, {p}.k_proj.weight^T, {p}.v_proj.weight^T -> {p}.qkv_proj.weight, fused_qkv, "
           f"num_heads={h}, num_key_value_groups={g}"]
    _, out = run(cfg, src)
    for layer in (0, 1):
        q, k, v = (src[f"model.layers.{layer}.self_attn.{n}_proj.weight"].T for n in "qkv")
        ref = torch.cat([q.reshape(hid, g, h // g, d), k.reshape(hid, g, 1, d), v.reshape(hid, g, 1, d)], 2)
        assert torch.equal(out[f"model.layers.{layer}.self_attn.qkv_proj.weight"], ref.reshape(hid, -1))
    # example 10: the inverse statement (export); split form restores the transposed q/k/v
    inv = [f"{p}.qkv_proj.weight -> {p}.q_proj.weight, {p}.k_proj.weight, {p}.v_proj.weight, fused_qkv, "
           f"num_heads={h}, num_key_value_groups={g}"]
    _, back = run(inv, out)
    for k2, v2 in src.items():
        assert torch.equal(back[k2], v2.T)


def test_layer_expert_fused_ffn_sinks_delete_create_fanout():
    src = {"model.embed_tokens.weight": rand(6, 4), "lm_head.weight": rand(6, 4, seed=9)}
    for layer in (0, 1):
        for e in range(2):
            src[f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight"] = rand(4, 3, seed=layer * 7 + e)
            src[f"model.layers.{layer}.mlp.experts.{e}.up_proj.weight"] = rand(4, 3, seed=layer * 7 + e + 100)
    p = "model.layers.$LAYER_ID.mlp.experts.$EXPERT_ID"
    prog, out = run([f"{p}.gate_proj.weight^T, {p}.up_proj.weight^T -> {p}.up_gate_proj.weight, fused_ffn",
                     "_ -> model.rotary_emb.inv_freq", "lm_head.weight -> _",
                     "model.embed_tokens.weight -> lm_head.weight"], src)
    for layer in (0, 1):
        for e in range(2):
            q = f"model.layers.{layer}.mlp.experts.{e}"
            ref = torch.cat([src[f"{q}.gate_proj.weight"].T, src[f"{q}.up_proj.weight"].T], 1)
            assert torch.equal(out[f"{q}.up_gate_proj.weight"], ref)
    assert torch.equal(out["lm_head.weight"], src["model.embed_tokens.weight"])
    assert "model.embed_tokens.weight" not in out  # consumed by the fan-out statement: not a sink
    assert prog.skipped == ["model.rotary_emb.inv_freq"] and prog.deleted == ["lm_head.weight"]
    assert len(out) == 5


def test_skipped_destination_and_identity_pass_through():
    src = {"a": rand(2, 2), "b": rand(3), "c": rand(4)}
    dst = {"a": torch.empty(2, 2), "b": torch.empty(3), "inv_freq": torch.empty(2), "nope": torch.empty(1)}
    prog, out = run(["_ -> inv_freq", "c -> _"], src, dst)
    assert prog.destination_keys() == ["a", "b"]
    assert torch.equal(out["a"], src["a"]) and torch.equal(out["b"], src["b"])
    assert prog.skipped == ["inv_freq"] and "nope" in prog.missing and prog.deleted == ["c"]
    assert prog.mappings_for("a") == [SliceMapping("a", ((0, 2), (0, 2)), "a", ((0, 2), (0, 2)))]


def test_reversible_cast_and_full_export_of_merged_tensor():
    src = {"A": rand(2, 2, dtype=torch.float16), "linear1.weight": rand(3, 2), "linear2.weight": rand(3, 4)}
    prog, out = run(["A -> fc1.weight ,src_dtype = 'float16', dst_dtype = 'float32'",
                     "linear1.weight, linear2.weight -> fused_weight, axis=1"], src)
    assert out["fc1.weight"].dtype == torch.float32 and torch.equal(out["fc1.weight"], src["A"].float())
    assert torch.equal(out["fused_weight"], torch.cat([src["linear1.weight"], src["linear2.weight"]], 1))
    _, back = run({"aoa_statements": ["A -> fc1.weight ,src_dtype = 'float16', dst_dtype = 'float32'"],
                   "aoa_config_reverse": True}, {"fc1.weight": out["fc1.weight"]})
    assert back["A"].dtype == torch.float16 and torch.equal(back["A"], src["A"])


def test_reverse_full_yields_original_hf_weight():
    # spec 2.8: HF (2,2) fp16 split into columns, each transposed and cast to fp32 into fc1/fc2 of shape (1,2)
    hf = rand(2, 2, dtype=torch.float16)
    cfg = ["huggingface.weight -> a, b, axis=1",
           "a^T -> fc1.weight, src_dtype='float16', dst_dtype='float32'",
           "b^T -> fc2.weight, src_dtype='float16', dst_dtype='float32'"]
    _, model = run(cfg, {"huggingface.weight": hf})
    assert model["fc1.weight"].shape == (1, 2) and model["fc1.weight"].dtype == torch.float32
    prog, back = run({"aoa_statements": cfg, "aoa_config_reverse": True}, model)
    assert list(back) == ["huggingface.weight"]
    assert back["huggingface.weight"].dtype == torch.float16 and torch.equal(back["huggingface.weight"], hf)


def test_example_18_reshape_flattened_to_canonical():
    """Example 18 (post-3.3): ``s0 -> d, reshape = '[2, 3, 2, 2]'``, flattened [6, 4] <-> canonical [2, 3, 2, 2]
    (more cases in test_aoa_reshape.py)."""
    s0 = rand(6, 4)
    _, out = run(["s0 -> d, reshape = '[2, 3, 2, 2]'"], {"s0": s0})
    assert torch.equal(out["d"], s0.reshape(2, 3, 2, 2))
    _, back = run(["d -> s0, reshape = '[6, 4]'"], out)
    assert torch.equal(back["s0"], s0)


# ---- section 6.11: Paddle unit-test scenarios -------------------------------------------------------------

def test_optimizer_suffix_queries():
    src = {"s0": rand(2, 2), "s1": rand(2, 2, seed=1)}
    for n in ("s0", "s1"):
        src[f"{n}.moment1_0"] = rand(2, 2, seed=30 + len(n) + int(n[1]))
        src[f"{n}.w_0"] = rand(2, 2, seed=40 + int(n[1]))
        src[f"{n}.beta1_pow_acc_0"] = torch.tensor([0.9 + int(n[1])])
    cfg = ["s0, s1 -> s, axis = 1", "s -> d0, d1, axis = 0"]
    dst = {k: torch.empty(1, 4) for k in ("d0", "d1", "d1.moment1_0", "d1.w_0")}
    dst["d1.beta1_pow_acc_0"] = torch.empty(1)
    with pytest.warns(UserWarning, match="several sources"):
        prog, out = run(cfg, src, dst)
    for suf in (".moment1_0", ".w_0"):
        assert torch.equal(out["d1" + suf], torch.cat([src["s0" + suf], src["s1" + suf]], 1)[1:2])
        assert [m.src_key for m in prog.mappings_for("d1" + suf)] == ["s0" + suf, "s1" + suf]
    assert torch.equal(out["d1.beta1_pow_acc_0"], src["s0.beta1_pow_acc_0"])
    # without a destination, the states follow the sinks too
    with pytest.warns(UserWarning, match="several sources"):
        prog2, out2 = run(cfg, src)
    assert set(out2) == {"d0", "d1", "d0.moment1_0", "d1.moment1_0", "d0.w_0", "d1.w_0", "d0.beta1_pow_acc_0",
                         "d1.beta1_pow_acc_0"}
    assert torch.equal(out2["d0.w_0"], torch.cat([src["s0.w_0"], src["s1.w_0"]], 1)[0:1])


def test_optimizer_states_keep_their_dtype_and_torch_names():
    src = {"w": rand(4, 2, dtype=torch.bfloat16), "w.exp_avg": rand(4, 2, seed=5), "w.exp_avg_sq": rand(4, 2, seed=6)}
    dst = {"v": torch.empty(2, 4), "v.exp_avg": torch.empty(2, 4), "v.exp_avg_sq": torch.empty(2, 4)}
    prog, out = run(["w^T -> v, dtype='float32'"], src, dst)
    assert out["v"].dtype == torch.float32 and torch.equal(out["v"], src["w"].T.float())
    assert torch.equal(out["v.exp_avg"], src["w.exp_avg"].T) and torch.equal(out["v.exp_avg_sq"], src["w.exp_avg_sq"].T)
    assert all(m.dtype is None for m in prog.mappings_for("v.exp_avg"))


def test_cast_and_add_queries():
    src = {"s0": rand(2, 2, dtype=torch.float16)}
    prog, out = run(['s0 -> d0, dtype="float32"'], src)
    assert [m.dtype for m in prog.mappings_for("d0")] == ["float32"]
    prog = compile_aoa(["_ -> d0"], {}, {"d0": TensorSpec((2,), "float32")})
    assert prog.destination_keys() == [] and prog.skipped == ["d0"]


def test_fused_ffn_transpose_rename_chain_tp2_to_tp4():
    k = "layers.0.gate_up_fused_proj.weight"
    n_in, inter = 3, 8
    gate, up = rand(n_in, inter), rand(n_in, inter, seed=1)

    def fused(t):  # Paddle TP-blocked gate/up along axis 1
        return torch.cat([x for r in range(t) for x in (gate.chunk(t, 1)[r], up.chunk(t, 1)[r])], 1)
    src_full = fused(2)
    dst = {"new_name_" + k: torch.empty(2 * inter, n_in)}
    prog = compile_aoa([f"{k} -> temp_var, fused_ffn", f"temp_var^T -> new_name_{k}"], {k: spec(src_full)},
                       specs(dst), source_shards={k: 2}, destination_shards={"new_name_" + k: 4})
    expect = fused(4).T
    loaded = load_shards(prog, {k: shard(src_full, even_boxes(src_full.shape, 1, 2))},
                         {"new_name_" + k: even_boxes(expect.shape, 0, 4)})
    assert_shards_equal(loaded, {"new_name_" + k: expect})


def test_transpose_cast_scenario():
    s0 = rand(4, 8)
    prog, out = run(["s0 -> a1, a2, a3, a4, axis = 1", "a2^T -> b2", "a3^T -> b3", "b2, b3 -> d0, axis = 1",
                     "a3, a4 -> d1, axis = 0"], {"s0": s0})
    a1, a2, a3, a4 = s0.chunk(4, 1)
    assert torch.equal(out["d0"], torch.cat([a2.T, a3.T], 1)) and torch.equal(out["d1"], torch.cat([a3, a4], 0))
    assert set(out) == {"a1", "d0", "d1"}


def test_reverse_permute():
    s0 = rand(2, 3, 4)
    prog, out = run(["s0 -> d0, permute= '[2, 0, 1]'"], {"s0": s0})
    assert torch.equal(out["d0"], s0.permute(2, 0, 1))
    rprog, back = run({"aoa_statements": ["s0 -> d0, permute= '[2, 0, 1]'"], "aoa_config_reverse": True}, out)
    assert [m.permute for m in rprog.mappings_for("s0")] == [(1, 2, 0)]
    assert torch.equal(back["s0"], s0)


def test_negative_axes_extension():
    src = {"a": rand(2, 3), "b": rand(2, 5)}
    _, out = run(["a, b -> c, axis=-1", "c -> d, e, axis=-1"], src)
    c = torch.cat([src["a"], src["b"]], -1)
    assert torch.equal(out["d"], c[:, :4]) and torch.equal(out["e"], c[:, 4:])
