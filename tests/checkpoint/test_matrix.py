"""The FlexCheckpoint strategy-conversion matrix (spec 6.11, issue 12) on a real model, end to end.

One launch of 4 gloo ranks runs all 23 pairs of ``_matrix_scenarios.PAIRS``, one test per pair named after it
(dense Llama, or Qwen2-MoE-style MoE when either side is expert parallel): train 2 steps in layout A, export to
HF, save model + optimizer, import a transformers-written HF checkpoint into layout B, load A's checkpoint into B,
and train 2 more steps. The
independent references are a single-process ``Llama`` + ``torch.optim.AdamW`` run and the HF files written by
``transformers`` (read back with plain safetensors + ``convert_hf_state_dict``). See ``_matrix_scenarios`` for the
exact checks.

Uneven layouts are part of the matrix: vocabulary 101 on TP 2 and 4 (uneven DTensor shards of the embedding and
lm_head), 5 experts on EP 2 and 4 (3/2 and 2/1/1/1 experts per rank). Degrees that cannot work fail with an error
listing the ones that do (last tests).
"""

import pytest
import torch

import _matrix_scenarios as W
from multirank import each_scenario, launch_fixture, scenario_names
from oarlock.errors import OarlockError
from oarlock.models.llama import Llama, LlamaConfig
from oarlock.models.parallel import ParallelLayout, check_layout, expert_range, parallelize_llama

pytestmark = pytest.mark.multiproc


def _write_hf(tmp_path, world: int = 4) -> dict[str, str]:
    """HF checkpoints of the matrix's two configs written by transformers itself (random weights, std 0.1 so
    biases and norms are not trivially zeros/ones)."""
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=W.DENSE.vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=4, rms_norm_eps=1e-5,
                  tie_word_embeddings=False)
    models = {"dense": transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)),
              "moe": transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
                  **common, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=5,
                  num_experts_per_tok=2, norm_topk_prob=False))}
    out = {}
    g = torch.Generator().manual_seed(7)
    for name, hf in models.items():
        assert LlamaConfig.from_hf(hf.config) == {"dense": W.DENSE, "moe": W.MOE}[name], name
        with torch.no_grad():
            for p in hf.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        d = tmp_path / f"hf_{name}"
        hf.save_pretrained(d)
        out[name] = str(d)
    return out


launched = launch_fixture("_matrix_scenarios", worlds=(4,), prepare=_write_hf, timeout_s=300,
                          threads=1)


@pytest.mark.slow
@each_scenario("_matrix_scenarios", worlds=(4,))
def test_strategy_conversion_matrix(launched, world, scenario):
    """Every pair: A's losses and weights equal the single-process reference; A's HF export equals
    to_hf_state_dict of its gathered weights; the transformers HF checkpoint imports exactly into B; B loads A's
    weights bit for bit; B's next 2 steps give the reference's losses and weights (optimizer state carried over);
    every rank of B read part of the checkpoint and of the HF files. Then pipeline stage 0 loading alone shows
    that strictness is judged over the whole load group."""
    launched.check(scenario, world)


def test_every_pair_has_a_scenario():
    assert scenario_names("_matrix_scenarios") == [f"scenario_{W.pair_name(p)}" for p in W.PAIRS] + [
        "scenario_strictness_is_judged_over_the_load_group"]
    assert len(W.PAIRS) == 23


def test_uneven_expert_and_vocab_degrees_work_or_name_the_ones_that_do():
    """5 experts on EP 2/4 and vocabulary 101 on TP 2/4 work (uneven, contiguous); EP 6 and TP 3 are refused with
    the degrees that work; the checks run before anything is built."""
    assert [list(expert_range(5, 4, r)) for r in range(4)] == [[0, 1], [2], [3], [4]]
    for lay in ("e2", "e4", "t2", "t4", "t2e2"):
        check_layout(W.MOE, ParallelLayout.parse(lay))
    with pytest.raises(OarlockError, match=r"ep=6 exceeds the 5 experts .*degrees that work: 1\.\.5"):
        check_layout(W.MOE, ParallelLayout(ep=6))
    with pytest.raises(OarlockError, match=r"tp=3 is impossible: it does not divide the 4 KV heads.*"
                                           r"degrees that work: 1, 2, 4"):
        check_layout(W.DENSE, ParallelLayout(tp=3))
    with pytest.raises(OarlockError, match=r"ep=6 exceeds"):  # parallelize_llama refuses before any collective
        parallelize_llama(Llama(W.MOE), None, ep=6)
