"""Errors of a live reshard a user can act on (issue 49 item 6): a mismatch names the target key, the source keys
it is made from, both shapes and dtypes, and an AOA statement only when the user wrote it; every error raised
before any byte moves is a PlanError (keeping its own class) that leaves the targets and WeightSync.torn alone,
while a transfer failure is not one and marks the targets torn. One-process checks here; on 2 gloo ranks in
_live_error_scenarios.py."""

import pickle

import pytest
import torch

from multirank import each_scenario, launch_fixture
from oarlock.checkpoint import CheckpointMismatchError, WeightSync, reshard_state_dict
from oarlock.checkpoint.aoa.errors import AOAError
from oarlock.checkpoint.errors import PlanError
from oarlock.checkpoint.runtime.live_errors import GENERATED_KEY, as_plan_error

transformers = pytest.importorskip("transformers")

launched = launch_fixture("_live_error_scenarios", worlds=(2,), timeout_s=300)


@pytest.mark.multiproc
@each_scenario("_live_error_scenarios", worlds=(2,))
def test_live_errors_two_ranks(launched, world, scenario):
    launched.check(scenario, world)


def llama_pair(trainer_intermediate, engine_intermediate):
    """A 1-layer HF Llama trainer's parameters, and zeroed bf16 targets in vLLM's layout for an engine whose
    intermediate_size differs (the vllm_llama preset's destination shapes)."""
    from oarlock.checkpoint.aoa import compile_aoa
    from oarlock.checkpoint.model.mapping import TensorSpec
    from oarlock.integrations.vllm import aoa_config_for

    T = transformers
    base = dict(vocab_size=64, hidden_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                tie_word_embeddings=False)
    trainer = T.LlamaForCausalLM(T.LlamaConfig(**base, intermediate_size=trainer_intermediate))
    engine_cfg = T.LlamaConfig(**base, intermediate_size=engine_intermediate)
    specs = {k: TensorSpec(tuple(v.shape), "bfloat16") for k, v in T.LlamaForCausalLM(engine_cfg).named_parameters()}
    prog = compile_aoa(aoa_config_for(engine_cfg), specs, None)
    targets = {k: torch.full(prog.destination_spec(k).shape, 7.0, dtype=torch.bfloat16)
               for k in prog.destination_keys()}
    return dict(trainer.named_parameters()), targets, trainer.config


def test_intermediate_size_mismatch_with_generated_casts_speaks_in_shapes():
    # issue 49: trainer intermediate_size 768, engine 512, fp32 -> bf16 through with_casts' generated statements
    from oarlock.integrations.vllm import aoa_config_for, with_casts

    src, tgt, cfg = llama_pair(768, 512)
    aoa = with_casts(aoa_config_for(cfg), src, "bfloat16")
    sync = WeightSync(src, tgt, aoa_config=aoa)
    with pytest.raises(PlanError) as got:
        sync.run()
    e = got.value
    assert isinstance(e, CheckpointMismatchError) and e.phase == "plan"
    msg = str(e)
    assert msg.startswith("live reshard: target 'model.layers.0.mlp.down_proj.weight' is [256, 512] bfloat16, "
                          "but the source key it is made from, 'model.layers.0.mlp.down_proj.weight' [256, 768] "
                          "float32, gives [256, 768]"), msg
    assert "slice" not in msg and "aoa_statements[" not in msg and "dtype='bfloat16'" not in msg, msg
    assert "statement" not in msg, msg  # the blamed statement was a generated cast: not quoted
    assert sync.torn is False
    assert all(bool((t == 7).all()) for t in tgt.values()), "a target was written before the error"


def test_fused_targets_name_every_source_and_the_size_each_would_need():
    src = {"gate": torch.randn(768, 256), "up": torch.randn(768, 256)}
    tgt = {"gate_up": torch.zeros(1024, 256)}
    with pytest.raises(CheckpointMismatchError) as got:
        reshard_state_dict(src, tgt, aoa_config=["gate, up -> gate_up, axis=0"])
    assert isinstance(got.value, PlanError)
    assert str(got.value) == (
        "live reshard: target 'gate_up' is [1024, 256] float32, but the source keys it is made from, 'gate' "
        "[768, 256] float32 and 'up' [768, 256] float32, give [1536, 256] (to give [1024, 256], each would have to "
        "be [512, 256]): the two sides hold models of different sizes (a hidden or intermediate size, a head "
        "count, a vocabulary?) or the AOA config maps them wrongly; made by your AOA statement [0]: "
        "gate, up -> gate_up, axis=0")
    # the same statement marked as generated (what a helper that writes statements records): not quoted
    with pytest.raises(CheckpointMismatchError) as got:
        reshard_state_dict(src, tgt, aoa_config={"aoa_statements": ["gate, up -> gate_up, axis=0"],
                                                 GENERATED_KEY: [[0, 1, "a helper"]]})
    assert "each would have to be [512, 256]" in str(got.value) and "statement" not in str(got.value)
    # a preset's statement is named with the preset
    with pytest.raises(CheckpointMismatchError) as got:
        reshard_state_dict(src, tgt, aoa_config={"aoa_statements": ["gate, up -> gate_up, axis=0"],
                                                 "preset": "my_preset"})
    assert str(got.value).endswith("; made by statement [0] of AOA preset 'my_preset': gate, up -> gate_up, axis=0")
    assert bool((tgt["gate_up"] == 0).all())


def test_transposed_source_and_dtype_without_cast():
    src = {"w": torch.randn(768, 256)}
    with pytest.raises(CheckpointMismatchError, match=r"target 'wt' is \[256, 512\] float32, but the source key it "
                       r"is made from, 'w' \[768, 256\] float32, gives \[256, 768\] \(to give \[256, 512\], it "
                       r"would have to be \[512, 256\]\)"):
        reshard_state_dict(src, {"wt": torch.zeros(256, 512)}, aoa_config=["w -> wt, permute='[1, 0]'"])
    with pytest.raises(CheckpointMismatchError) as got:
        reshard_state_dict(src, {"v": torch.zeros(768, 256, dtype=torch.bfloat16)}, aoa_config=["w -> v"])
    assert isinstance(got.value, PlanError)
    assert str(got.value).startswith("live reshard: target 'v' is bfloat16, but the source key it is made from, 'w' "
                                     "[768, 256] float32, gives float32; casts happen only on request: add "
                                     "\"w -> v, dtype='bfloat16'\" to the AOA config"), str(got.value)


def test_same_keys_without_aoa_list_both_sides():
    src = {"a": torch.ones(8, 8), "b": torch.ones(4), "c": torch.ones(3)}
    tgt = {"a": torch.full((8, 9), 5.0), "b": torch.full((4,), 5.0, dtype=torch.float16), "c": torch.zeros(3)}
    sync = WeightSync(src, tgt)
    with pytest.raises(CheckpointMismatchError) as got:
        sync.run()
    assert isinstance(got.value, PlanError) and sync.torn is False
    assert str(got.value) == ("live reshard: the targets do not match the sources: 'a': target [8, 9] float32, "
                              "source [8, 8] float32; 'b': target [4] float16, source [4] float32; casts happen only "
                              "on request: aoa_config=[\"b -> b, dtype='float16'\", ...]")
    assert bool((tgt["a"] == 5).all()) and bool((tgt["b"] == 5).all()) and bool((tgt["c"] == 0).all())


def test_a_bad_aoa_config_is_a_plan_error_and_still_an_aoa_error():
    with pytest.raises(AOAError) as got:
        reshard_state_dict({"w": torch.ones(2)}, {"v": torch.zeros(2)}, aoa_config=["nothing.* -> v"])
    assert isinstance(got.value, PlanError) and got.value.phase == "plan"
    back = pickle.loads(pickle.dumps(got.value))  # crosses processes (a vLLM worker's RPC) as both classes
    assert isinstance(back, PlanError) and isinstance(back, AOAError) and str(back) == str(got.value)
    assert type(back).__name__ == "AOAError" and back.statement_index == got.value.statement_index


def test_as_plan_error_keeps_what_it_can():
    e = as_plan_error(ValueError("odd"))
    assert type(e) is PlanError and str(e) == "ValueError: odd"
    m = as_plan_error(CheckpointMismatchError("x"))
    assert isinstance(m, CheckpointMismatchError) and isinstance(m, PlanError) and as_plan_error(m) is m
