"""AOA completeness (issue 18 item 3): optimizer-state keys visible to patterns, ``_`` semantics, macro corners,
``reshape=``, chained casts, optimizer-state casts, prefix renames, and bounded range expansion. Every expected
value is computed in the test with plain torch."""

import pytest
import torch

from oarlock.checkpoint import load_state_dict, save_state_dict
from oarlock.checkpoint.aoa import AOAError, compile_aoa
from oarlock.checkpoint.model.mapping import TensorSpec, execute_on_full_tensors


def spec(t):
    return TensorSpec(tuple(t.shape), str(t.dtype).removeprefix("torch."))


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture
def with_moments(tmp_path):
    sd = {}
    for i in range(2):
        sd[f"layers.{i}.w"] = rand(4, 3, seed=i)
        sd[f"layers.{i}.w.exp_avg"] = rand(4, 3, seed=10 + i)
        sd[f"layers.{i}.w.exp_avg_sq"] = rand(4, 3, seed=20 + i)
    save_state_dict(sd, tmp_path / "ck")
    return tmp_path / "ck", sd


def test_optimizer_keys_match_patterns_and_drop(with_moments):
    path, sd = with_moments
    prog = compile_aoa(["layers.*.w.exp_avg -> _"], {k: spec(v) for k, v in sd.items()})
    assert sorted(prog.deleted_keys) == ["layers.0.w.exp_avg", "layers.1.w.exp_avg"]
    assert sorted(prog.destination_keys()) == sorted(k for k in sd if not k.endswith(".exp_avg"))
    # a load that does not request the dropped moments: strict, nothing unexpected
    got = {k: torch.zeros_like(v) for k, v in sd.items() if not k.endswith(".exp_avg")}
    rep = load_state_dict(got, path, aoa_config=["layers.$LAYER_ID.w.exp_avg -> _"], strict=True)
    assert rep.unexpected_keys == [] and rep.missing_keys == []
    assert all(torch.equal(got[k], sd[k]) for k in got)
    # a destination named like a dropped key keeps its value, reported as skipped, no strict error
    keep = torch.full((4, 3), 7.0)
    got = {"layers.0.w": torch.zeros(4, 3), "layers.0.w.exp_avg": keep.clone(), "layers.1.w": torch.zeros(4, 3)}
    rep = load_state_dict(got, path, aoa_config=["layers.*.w.exp_avg -> _", "layers.*.w.exp_avg_sq -> _"],
                          strict=True)
    assert torch.equal(got["layers.0.w.exp_avg"], keep) and torch.equal(got["layers.0.w"], sd["layers.0.w"])
    assert rep.skipped_keys == ["layers.0.w.exp_avg"] and rep.missing_keys == []


def test_model_statement_still_moves_moments_and_explicit_state_rename(with_moments):
    path, sd = with_moments
    got = {"a.w": torch.zeros(4, 3), "a.w.exp_avg": torch.zeros(4, 3), "b.w": torch.zeros(3, 4),
           "b.w.exp_avg": torch.zeros(3, 4), "x": torch.zeros(4, 3)}
    load_state_dict(got, path, aoa_config=["layers.0.w -> a.w", "layers.1.w^T -> b.w",
                                           "layers.0.w.exp_avg_sq -> x", "layers.1.w.exp_avg_sq -> _"])
    assert torch.equal(got["a.w.exp_avg"], sd["layers.0.w.exp_avg"])
    assert torch.equal(got["b.w"], sd["layers.1.w"].T) and torch.equal(got["b.w.exp_avg"], sd["layers.1.w.exp_avg"].T)
    assert torch.equal(got["x"], sd["layers.0.w.exp_avg_sq"])


def test_void_destination_keeps_value_and_satisfies_strict(with_moments):
    path, sd = with_moments
    buf = torch.arange(5.0)
    got = {"layers.0.w": torch.zeros(4, 3), "layers.1.w": torch.zeros(4, 3), "rotary.inv_freq": buf.clone()}
    rep = load_state_dict(got, path, aoa_config=["_ -> rotary.inv_freq", "layers.$LAYER_ID.w.exp_avg -> _",
                                                 "layers.$LAYER_ID.w.exp_avg_sq -> _"], strict=True)
    assert torch.equal(got["rotary.inv_freq"], buf) and rep.skipped_keys == ["rotary.inv_freq"]
    assert torch.equal(got["layers.1.w"], sd["layers.1.w"])
    with pytest.raises(Exception, match="missing keys"):  # without the statement it is a missing key
        load_state_dict({"rotary.inv_freq": buf.clone()}, path, aoa_config=["layers.*.w -> _"])


def test_void_destination_over_a_stored_key_of_that_name(tmp_path):
    """``_ -> lm_head.weight`` over a source that stores ``lm_head.weight`` (a tied-embedding model loading an
    untied checkpoint): the stored tensor and its moments are deliberately skipped, so a strict load succeeds, the
    target keeps its value and the rest is loaded; without the statement the load fills it from the source."""
    sd = {"emb": rand(6, 4, seed=1), "lm_head.weight": rand(6, 4, seed=2),
          "lm_head.weight.exp_avg": rand(6, 4, seed=3), "emb.exp_avg": rand(6, 4, seed=4)}
    save_state_dict(sd, tmp_path / "ck")
    keep = torch.full((6, 4), 9.0)
    got = {"emb": torch.zeros(6, 4), "lm_head.weight": keep.clone()}
    rep = load_state_dict(got, tmp_path / "ck", aoa_config=["_ -> lm_head.weight"], strict=True, model_only=True)
    assert rep.unexpected_keys == ["emb.exp_avg"]  # optimizer state: reported, ignored by model_only
    assert rep.missing_keys == [] and rep.skipped_keys == ["lm_head.weight"]
    assert torch.equal(got["lm_head.weight"], keep) and torch.equal(got["emb"], sd["emb"])
    got = {k: torch.zeros_like(v) for k, v in sd.items() if not k.startswith("lm_head")}
    rep = load_state_dict(got, tmp_path / "ck", aoa_config=["_ -> lm_head.weight"], strict=True)
    assert rep.unexpected_keys == [] and all(torch.equal(got[k], sd[k]) for k in got)
    prog = compile_aoa(["_ -> lm_head.weight"], {k: spec(v) for k, v in sd.items()})
    assert sorted(prog.deleted_keys) == ["lm_head.weight", "lm_head.weight.exp_avg"]
    got = {"emb": torch.zeros(6, 4), "lm_head.weight": torch.zeros(6, 4)}
    load_state_dict(got, tmp_path / "ck", model_only=True)
    assert torch.equal(got["lm_head.weight"], sd["lm_head.weight"])


def test_star_with_layer_id():
    src = {f"layers.{i}.experts.{e}.w": rand(2, 3, seed=10 * i + e) for i in range(2) for e in range(3)}
    prog = compile_aoa(["layers.$LAYER_ID.experts.*.w -> stacked.$LAYER_ID, axis=0"], {k: spec(v) for k, v in src.items()})
    out = execute_on_full_tensors(prog, src)
    for i in range(2):
        want = torch.cat([src[f"layers.{i}.experts.{e}.w"] for e in range(3)], 0)
        assert torch.equal(out[f"stacked.{i}"], want)


@pytest.mark.parametrize("reverse", [False, True])
def test_layer_id_statement_whose_first_name_is_a_temporary(reverse):
    # HF-style fused [Q; K; V] rows (2 q heads, 1 k, 1 v of 2 rows each) -> per-head temporaries -> GQA order
    src = {f"layers.{i}.qkv": rand(8, 3, seed=i) for i in range(2)}
    stmts = ["layers.$LAYER_ID.qkv -> tmp.$LAYER_ID.0, tmp.$LAYER_ID.1, tmp.$LAYER_ID.2, tmp.$LAYER_ID.3, axis=0",
             "tmp.$LAYER_ID.0, tmp.$LAYER_ID.2, tmp.$LAYER_ID.1, tmp.$LAYER_ID.3 -> out.$LAYER_ID, axis=0"]
    prog = compile_aoa(stmts, {k: spec(v) for k, v in src.items()})
    out = execute_on_full_tensors(prog, src)
    for i in range(2):
        rows = src[f"layers.{i}.qkv"].chunk(4, 0)
        assert torch.equal(out[f"out.{i}"], torch.cat([rows[0], rows[2], rows[1], rows[3]], 0))
    if reverse:  # and back: the same statements inverted, matched right to left
        back = compile_aoa({"aoa_statements": stmts, "aoa_config_reverse": True}, {k: spec(v) for k, v in out.items()})
        got = execute_on_full_tensors(back, out)
        assert set(got) == set(src) and all(torch.equal(got[k], src[k]) for k in src)


def test_cast_chain_rounds_in_order(tmp_path):
    x = rand(64, seed=3) * 3.0  # fp32 values that bfloat16 cannot hold exactly
    save_state_dict({"s": x}, tmp_path / "ck")
    chain = ["s -> d, dtype='bfloat16'", "d -> d, dtype='float32'"]
    got = {"d": torch.zeros(64)}
    load_state_dict(got, tmp_path / "ck", aoa_config=chain)
    want = x.to(torch.bfloat16).to(torch.float32)  # Paddle applies each cast: the bfloat16 rounding stays
    assert not torch.equal(want, x) and torch.equal(got["d"], want)
    prog = compile_aoa(chain, {"s": spec(x)})
    assert prog.mappings_for("d")[0].dtype == "bfloat16>float32"
    assert torch.equal(execute_on_full_tensors(prog, {"s": x})["d"], want)
    # a single cast still casts once
    got = {"d": torch.zeros(64, dtype=torch.float16)}
    load_state_dict(got, tmp_path / "ck", aoa_config=["s -> d, dtype='float16'"])
    assert torch.equal(got["d"], x.to(torch.float16))


def test_optimizer_state_cast(with_moments):
    path, sd = with_moments
    # a statement on the model key casts the weight; one naming the moment casts the moment
    got = {"layers.0.w": torch.zeros(4, 3, dtype=torch.bfloat16),
           "layers.0.w.exp_avg": torch.zeros(4, 3, dtype=torch.bfloat16),
           "layers.0.w.exp_avg_sq": torch.zeros(4, 3, dtype=torch.float16)}
    load_state_dict(got, path, aoa_config=["layers.0.w -> layers.0.w, dtype='bfloat16'",
                                           "layers.0.w.exp_avg_sq -> layers.0.w.exp_avg_sq, dtype='float16'",
                                           "layers.1.w -> _"], strict=True)
    assert torch.equal(got["layers.0.w"], sd["layers.0.w"].to(torch.bfloat16))
    assert torch.equal(got["layers.0.w.exp_avg"], sd["layers.0.w.exp_avg"].to(torch.bfloat16))
    assert torch.equal(got["layers.0.w.exp_avg_sq"], sd["layers.0.w.exp_avg_sq"].to(torch.float16))


def test_keys_ending_like_optimizer_states_that_are_model_keys(tmp_path):
    # Paddle static-graph parameter names: fc_0.w_0 (weight) with fc_0.b_0; a parameter with states of its own
    sd = {"fc_0.w_0": rand(4, 3, seed=1), "fc_0.b_0": rand(4, seed=2),
          "emb.moment1_0": rand(5, 3, seed=3), "emb.moment1_0.moment1_0": rand(5, 3, seed=4)}
    specs = {k: spec(v) for k, v in sd.items()}
    prog = compile_aoa(["fc_0.w_0^T -> fc.weight", "fc_0.b_0 -> fc.bias", "emb.moment1_0 -> emb.weight"], specs)
    out = execute_on_full_tensors(prog, sd)
    assert torch.equal(out["fc.weight"], sd["fc_0.w_0"].T) and torch.equal(out["fc.bias"], sd["fc_0.b_0"])
    assert torch.equal(out["emb.weight"], sd["emb.moment1_0"])
    assert torch.equal(out["emb.weight.moment1_0"], sd["emb.moment1_0.moment1_0"])  # its state followed it
    # a pattern over such keys
    save_state_dict({f"fc_{i}.w_0": rand(2, 2, seed=i) for i in range(3)}, tmp_path / "ck")
    got = {f"w{i}": torch.zeros(2, 2) for i in range(3)}
    load_state_dict(got, tmp_path / "ck", aoa_config=["fc_$LAYER_ID.w_0 -> w$LAYER_ID"])
    for i in range(3):
        assert torch.equal(got[f"w{i}"], rand(2, 2, seed=i))


@pytest.mark.parametrize("reverse", [False, True])
def test_prefix_rename_of_the_rest(reverse):
    src = {"model.embed.weight": rand(5, 4, seed=1), "model.layers.0.q": rand(4, 4, seed=2),
           "model.layers.0.k": rand(4, 4, seed=3), "model.layers.0.norm": rand(4, seed=4), "lm_head.weight":
           rand(5, 4, seed=5), "model.layers.0.norm.exp_avg": rand(4, seed=6)}
    # keys outside the prefix are named (in reverse mode '**' would match every remaining key)
    stmts = ["model.layers.$LAYER_ID.q, model.layers.$LAYER_ID.k -> layers.$LAYER_ID.qk, axis=0",
             "lm_head.weight -> lm_head.weight", "model.** -> **"]
    prog = compile_aoa(stmts, {k: spec(v) for k, v in src.items()})
    out = execute_on_full_tensors(prog, src)
    assert sorted(out) == ["embed.weight", "layers.0.norm", "layers.0.norm.exp_avg", "layers.0.qk", "lm_head.weight"]
    assert torch.equal(out["layers.0.qk"], torch.cat([src["model.layers.0.q"], src["model.layers.0.k"]]))
    assert torch.equal(out["embed.weight"], src["model.embed.weight"])
    assert torch.equal(out["layers.0.norm.exp_avg"], src["model.layers.0.norm.exp_avg"])
    if reverse:
        back = compile_aoa({"aoa_statements": stmts, "aoa_config_reverse": True}, {k: spec(v) for k, v in out.items()})
        got = execute_on_full_tensors(back, out)
        assert set(got) == set(src) and all(torch.equal(got[k], src[k]) for k in src)
    with pytest.raises(AOAError, match="'\\*\\*' exactly once"):
        compile_aoa(["model.** -> a.**.**"], {k: spec(v) for k, v in src.items()})


@pytest.mark.parametrize("to_hf", [True, False])
def test_rotary_permutation_meta_hf(to_hf):
    from oarlock.checkpoint.aoa.presets import rotary_permutation_statements

    H, D, n_in = 3, 8, 5
    meta = rand(H * D, n_in, seed=7)
    hf = meta.view(H, D // 2, 2, n_in).transpose(1, 2).reshape(H * D, n_in)  # HF's own conversion formula
    src, want = (meta, hf) if to_hf else (hf, meta)
    stmts = rotary_permutation_statements("layers.$LAYER_ID.wq", "layers.$LAYER_ID.q_proj", H, D, to_hf=to_hf)
    prog = compile_aoa(stmts, {"layers.0.wq": spec(src), "layers.1.wq": spec(src * 2)})
    out = execute_on_full_tensors(prog, {"layers.0.wq": src, "layers.1.wq": src * 2})
    assert torch.equal(out["layers.0.q_proj"], want) and torch.equal(out["layers.1.q_proj"], want * 2)
