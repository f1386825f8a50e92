"""Parallel layouts (tp, pp, ep, dp with ZeRO-1) against single-process references."""

import pytest
import torch

import _parallel_scenarios as S
from multirank import each_scenario, launch_fixture, scenario_names
from oarlock.errors import OarlockError
from oarlock.models.llama import Llama, LlamaConfig, causal_lm_loss
from oarlock.models.parallel import (ParallelLayout, check_layout, expert_range, parallelize_llama,
                                     stage_layer_range, valid_tp_degrees)
from oarlock.models.zero import ZeroRedundancyAdamW

launched = launch_fixture("_parallel_scenarios", worlds=(2, 4), timeout_s=300, threads=1)


@pytest.mark.multiproc
@pytest.mark.slow
@each_scenario("_parallel_scenarios", worlds=(2, 4))
def test_layouts_train_like_a_single_process(launched, world, scenario):
    """One launch per world size runs every layout of that size (see _parallel_scenarios.CHECKS): 3 steps of
    ZeRO-1 AdamW give the single-process torch.optim.AdamW losses and parameters, and the ZeRO flattened ranges
    tile every parameter and hold AdamW's first moments."""
    launched.check(scenario, world)


def test_every_layout_has_a_scenario():
    extra = {2: ["scenario_c2_cp_methods_one_step"], 4: ["scenario_t2c2_cp_methods_one_step"]}
    for world, n in ((2, 9), (4, 13)):
        assert scenario_names("_parallel_scenarios", world) == [f"scenario_{S._name(spec)}"
                                                                 for spec, _ in S.CHECKS[world]] + extra[world]
        assert len(S.CHECKS[world]) == n


def test_layout_notation_round_trips():
    assert ParallelLayout.parse("d2t2") == ParallelLayout(dp=2, tp=2)
    assert str(ParallelLayout(pp=2, ep=2, dp=2)) == "d2p2e2"
    assert ParallelLayout.parse("single").world_size == 1
    with pytest.raises(OarlockError, match="unknown layout 'x2'.*d=data, t=tensor"):
        ParallelLayout.parse("x2")
    with pytest.raises(OarlockError, match="gives 'd' twice"):
        ParallelLayout.parse("d2d2")


def test_impossible_degrees_say_which_work():
    smol = LlamaConfig.smollm2_135m()
    assert valid_tp_degrees(smol) == [1, 3]
    with pytest.raises(OarlockError, match=r"tp=2 is impossible: it does not divide the 3 KV heads.*"
                                           r"degrees that work: 1, 3"):
        check_layout(smol, ParallelLayout(tp=2))
    check_layout(smol, ParallelLayout(tp=3, dp=2))
    dense = LlamaConfig(vocab_size=30522, hidden_size=64, intermediate_size=36, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=8)
    with pytest.raises(OarlockError, match="tp=8 is impossible: it does not divide the MLP width; degrees that "
                                           "work: 1, 2, 4"):
        check_layout(dense, ParallelLayout(tp=8))
    with pytest.raises(OarlockError, match="pp=3 exceeds the 2 layers"):
        check_layout(dense, ParallelLayout(pp=3))
    with pytest.raises(OarlockError, match="needs an MoE config"):
        check_layout(dense, ParallelLayout(ep=2))
    with pytest.raises(OarlockError, match="tied embeddings"):
        check_layout(smol, ParallelLayout(pp=2))
    moe = LlamaConfig(**{**dense.to_dict(), "num_experts": 5})
    check_layout(moe, ParallelLayout(ep=2))  # 5 experts over 2 ranks: 3 + 2
    with pytest.raises(OarlockError, match="ep=6 exceeds the 5 experts.*1..5"):
        check_layout(moe, ParallelLayout(ep=6))


def test_unknown_cp_method_is_named():
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(OarlockError, match=r"cp_method='tree' is unknown; use one of allgather, ring"):
        parallelize_llama(Llama(cfg), cp_method="tree")
    assert parallelize_llama(Llama(cfg)).parallel_state.cp_method == "ring"  # the attention's default
    assert parallelize_llama(Llama(cfg), cp_method="allgather").parallel_state.cp_method == "allgather"


def test_stage_and_expert_ranges_partition():
    assert [list(stage_layer_range(30, 4, s)) for s in range(4)] == \
        [list(range(0, 8)), list(range(8, 16)), list(range(16, 23)), list(range(23, 30))]
    assert [list(expert_range(5, 2, r)) for r in range(2)] == [[0, 1, 2], [3, 4]]


def test_zero_single_process_equals_adamw():
    """Degree 1 (no group): the flat-buffer update equals torch.optim.AdamW; every range is the whole tensor."""
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    a, b = Llama(cfg), Llama(cfg)
    b.load_state_dict(a.state_dict())
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    opt = ZeroRedundancyAdamW(b.named_parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    ids = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for m, o in ((a, ref), (b, opt)):
            o.zero_grad()
            causal_lm_loss(m(ids[:, :-1]), ids[:, 1:]).backward()
            o.step()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
        sh = opt.flat_shards()[n]
        assert sh.flattened_range == (0, p.numel()) and sh.global_offset == (0,) * p.dim()
        torch.testing.assert_close(opt.state[n]["exp_avg"].view(p.shape), ref.state[p]["exp_avg"])
    # Per-rank snapshot round trip
    snap = opt.state_dict()
    before = opt.state["norm.weight"]["exp_avg"].clone()
    opt.state["norm.weight"]["exp_avg"].zero_()
    opt.load_state_dict(snap)
    assert torch.equal(opt.state["norm.weight"]["exp_avg"], before)
    with pytest.raises(OarlockError, match="appears twice"):
        ZeroRedundancyAdamW([("w", torch.nn.Parameter(torch.ones(2))), ("w", torch.nn.Parameter(torch.ones(2)))])


def test_zero_bf16_parameters_keep_fp32_master_weights():
    """bf16 parameters: the update runs on fp32 master copies (exposed as state 'master_weight'), like
    torch.optim.AdamW applied to fp32 copies fed with the bf16 gradients, then rounded to bf16."""
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    model = Llama(cfg).to(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, eps=1e-4)
    opt = ZeroRedundancyAdamW(model.named_parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    ids = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        opt.zero_grad()
        causal_lm_loss(model(ids[:, :-1]), ids[:, 1:]).backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
        ref.step()
        opt.step()
    for (n, p), m in zip(model.named_parameters(), masters):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(opt.state[n]["master_weight"].view(p.shape), m.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(p, m.detach().to(torch.bfloat16)), n


def test_convert_pp_places_layers_on_the_stages_parallelize_llama_uses(tmp_path):
    """`oarlock convert SRC DST --pp 4` on a 10-layer Llama: every layer's tensors are written by the rank of the
    stage that holds it under parallelize_llama (3, 3, 2, 2 layers), the embedding by stage 0, norm and head by
    the last stage (issue 15: the two used to disagree, 3, 2, 3, 2)."""
    from safetensors.torch import save_file

    from oarlock.checkpoint import open_checkpoint
    from oarlock.cli import main

    cfg = LlamaConfig(vocab_size=17, hidden_size=8, intermediate_size=8, num_hidden_layers=10, num_attention_heads=2,
                      num_key_value_heads=1)
    src = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in Llama(cfg).state_dict().items()}, src)
    assert main(["convert", str(src), str(tmp_path / "oar"), "--pp", "4"]) == 0
    assert [len(stage_layer_range(10, 4, s)) for s in range(4)] == [3, 3, 2, 2]
    stage_of = {i: s for s in range(4) for i in stage_layer_range(10, 4, s)}
    with open_checkpoint(tmp_path / "oar") as reader:
        tensors = reader.metadata.tensors
    checked = 0
    for key, t in tensors.items():
        want = stage_of[int(key.split(".")[1])] if key.startswith("layers.") else \
            0 if key.startswith("embed_tokens") else 3
        assert {s.file for s in t.shards} == {f"rank-{want:05d}.safetensors"}, key
        checked += 1
    assert checked == len(Llama(cfg).state_dict())
