"""The vLLM back end on the layouts RL policies use beyond a dense GQA Llama (issue 49): MoE experts (Qwen3-MoE,
Mixtral) and a TP degree above the KV heads, in ``.vllm-venv`` (scripts/vllm_env.sh; skipped without it).

Each test: two trainer ranks (gloo) take one FSDP2 step of a tiny random transformers model (transformers 5 holds
the experts stacked: ``mlp.experts.gate_up_proj`` ``[E, 2I, H]``); trainer rank 0 also runs a vLLM engine at TP=2 on
CPU built from the initial weights; ``trainer_init`` + ``send_weights`` push the FSDP2 shards into the workers.
Checked against transformers itself on the trainer's new weights: vLLM's greedy tokens equal and its logprobs within
1e-4; before the sync they differ; each worker received exactly the bytes of its slices, computed here from the HF
shapes (experts: I/2 gate and up rows of every expert, I/2 columns of every down projection; KV heads: a 1-KV-head
model's k and v whole on both ranks), and the trainers sent no more. The 1-KV-head run first asks the engine to
join with an init request its workers cannot take: both trainer ranks raise the workers' reason within seconds.
"""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
from _vllm_launch import SKIP_REASON, VPY, free_port, run_trainer_ranks

SCRIPT = Path(__file__).with_name("_vllm_sync_e2e.py")
LIMIT_S = 600
pytestmark = pytest.mark.skipif(not VPY.is_file(), reason=SKIP_REASON)

# tiny random models, built by the vLLM venv's transformers (so its save format is the one vLLM reads)
MODELS = {
    # 8 experts, top-2; I = 128 so that each TP rank's 64 rows fit the CPU MoE kernel's alignment without padding
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                       num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False,
                       bos_token_id=1, eos_token_id=2)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(vocab_size=512, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                     max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
    # one KV head at TP=2: vLLM replicates it, each rank's qkv_proj holds 2 q heads and the k and v head
    "llama_1kv": ("LlamaConfig", "LlamaForCausalLM",
                  dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
}


def build_model(kind: str, d: Path) -> Path:
    """Saves the tiny model ``kind`` once under ``d`` (by the vLLM venv's Python)."""
    if (d / "model.safetensors").is_file():
        return d
    cfg_cls, model_cls, kw = MODELS[kind]
    tmp = d.with_name(d.name + f".partial-{os.getpid()}")
    code = (f"import torch, transformers as T; torch.manual_seed(0); "
            f"T.{model_cls}(T.{cfg_cls}(**{kw!r})).float().save_pretrained({str(tmp)!r})")
    subprocess.run([str(VPY), "-c", code], check=True, capture_output=True, timeout=300,
                   env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    if not d.exists():
        os.replace(tmp, d)
    return d


def run_ranks(model_dir: Path, tmp_path: Path, *extra: str) -> dict:
    """Both trainer ranks of _vllm_sync_e2e.py; their result (rank 0's JSON), with the wall time."""
    out = tmp_path / "result.json"
    return run_trainer_ranks(SCRIPT, [str(free_port()), str(free_port()), str(model_dir), str(out), *extra],
                             tmp_path, out, LIMIT_S)


def tp2_slice_numel(name: str, shape: list[int], kv_heads: int) -> int:
    """Elements of HF parameter ``name`` (transformers 5 names, stacked experts) that one rank of a TP=2 vLLM
    engine holds, from vLLM's TP rules written out independently of the back end: 1-D tensors (norms) and the
    router whole; k/v projections halved, or whole when the model has one KV head (replicated); everything else
    (embedding, lm_head, q/o projections, dense MLP, every expert's gate/up rows and down columns) halved."""
    n = math.prod(shape)
    if len(shape) == 1 or name.endswith("mlp.gate.weight"):
        return n
    if name.endswith(("k_proj.weight", "v_proj.weight")) and kv_heads < 2:
        return n
    return n // 2


def check_sync(res: dict, kv_heads: int) -> None:
    diffs = {k: max(abs(a - b) for x, y in zip(res[k]["logprobs"], res["reference"]["logprobs"]) for a, b in zip(x, y))
             for k in ("before", "after")}
    print(json.dumps({"seconds": round(res["seconds"], 1), **{k: round(v, 2) for k, v in res["times"].items()},
                      "max_logprob_diff": diffs}))
    assert res["fsdp_placements"] == ["(Shard(dim=0),)"]  # the trainer really held FSDP2 shards
    ref, before, after = res["reference"], res["before"], res["after"]
    assert before["tokens"] != ref["tokens"] and diffs["before"] > 1e-2  # the sync carried the training step
    assert after["tokens"] == ref["tokens"]
    assert diffs["after"] <= 1e-4, diffs
    want = sum(tp2_slice_numel(k, s, kv_heads) for k, s in res["shapes"].items()) * 4  # fp32
    workers = res["workers"]
    assert sorted(w["rank"] for w in workers) == [2, 3]
    for w in workers:
        assert not w["torn"] and not w.get("refused"), w
        assert w["report"]["bytes_received"] == want, (w["report"]["bytes_received"], want)
        assert w["target_bytes"] == want
        assert w["report"]["bytes_sent"] == 0
    assert sum(t["bytes_sent"] for t in res["trainer_reports"]) == 2 * want  # nothing beyond the slices moved


@pytest.mark.slow
@pytest.mark.multiproc
def test_qwen3_moe_fsdp2_into_vllm_tp2(cache_dir, tmp_path):
    res = run_ranks(build_model("qwen3_moe", cache_dir / "vllm-tiny-qwen3-moe-v1"), tmp_path)
    check_sync(res, kv_heads=2)
    # vLLM holds the experts stacked, each rank I/2 of every expert's gate and up rows (w13) and down columns (w2)
    for params in res["worker_params"]:
        assert params["model.layers.0.mlp.experts.routed_experts.w13_weight"] == [8, 128, 128]
        assert params["model.layers.0.mlp.experts.routed_experts.w2_weight"] == [8, 128, 64]


@pytest.mark.slow
@pytest.mark.multiproc
def test_mixtral_fsdp2_into_vllm_tp2(cache_dir, tmp_path):
    res = run_ranks(build_model("mixtral", cache_dir / "vllm-tiny-mixtral-v1"), tmp_path)
    check_sync(res, kv_heads=2)
    for params in res["worker_params"]:  # Mixtral's block is block_sparse_moe in vLLM (mlp in transformers 5)
        assert params["model.layers.1.block_sparse_moe.experts.routed_experts.w13_weight"] == [8, 128, 128]
        assert params["model.layers.1.block_sparse_moe.experts.routed_experts.w2_weight"] == [8, 128, 64]


@pytest.mark.slow
@pytest.mark.multiproc
def test_one_kv_head_llama_into_vllm_tp2_and_a_refusal_within_seconds(cache_dir, tmp_path):
    res = run_ranks(build_model("llama_1kv", cache_dir / "vllm-tiny-llama-1kv-v1"), tmp_path, str(free_port()))
    # a worker that cannot take part (an init field its oarlock does not know) refuses once the group formed, and
    # both trainer ranks raise its reason at once, not at the rendezvous timeout (120 s here)
    print(json.dumps({"refusal_seconds": [round(r["seconds"], 2) for r in res["refusals"]]}))
    for r in res["refusals"]:
        assert r["error"].startswith("CheckpointError: oarlock vLLM back end: the engine cannot take part"), r
        assert "vLLM worker 2: this worker's oarlock does not know the init fields ['a_future_field']" in r["error"]
        assert "vLLM worker 3:" in r["error"]
        assert r["seconds"] < 30, r
    check_sync(res, kv_heads=1)
    for params in res["worker_params"]:  # 2 of the 4 q heads and the one k and v head (replicated), head dim 32
        assert params["model.layers.0.self_attn.qkv_proj.weight"] == [128, 128]
