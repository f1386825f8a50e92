"""One trainer rank of the vLLM server test (tests/integrations/test_vllm_server.py), run by ``.vllm-venv``'s Python:

    python _vllm_server_e2e.py RANK TRAINER_PORT SYNC_PORT MODEL_DIR OUT_JSON BASE_URL MODEL_NAME ENGINE_WORKERS

A vLLM OpenAI server (started by the test: ``--weight-transfer-config '{"backend":"oarlock"}'``, data-parallel
replicas of a TP engine) is driven over HTTP only: vLLM's ``HTTPVLLMWeightSyncClient`` is the ``client`` of
``WeightTransferTrainerFactory.trainer_init`` on trainer rank 0 (rank 1 passes None), and every answer comes from
``/v1/completions`` with token-id prompts (greedy, logprobs), sent to each replica with vLLM's
``X-data-parallel-rank`` header. Two trainer ranks (gloo) hold a transformers Llama in FSDP2 and take two training
steps; after each, one round syncs every worker of every replica:

* round 1 inside ``/pause?mode=keep`` ... ``/resume``: a request started before the pause and one sent while
  paused are both answered in full after the resume (the second with the new weights);
* round 2 without a pause (the engine idle), replaying the plan.

The sync group's secret is in ``OARLOCK_SYNC_TOKEN`` (set by the test for the server and the trainer ranks alike),
never in an HTTP request. Rank 0 records vLLM's tokens and logprobs per replica before and after each round,
transformers' greedy decoding on the trainer's gathered weights, the server's per-engine prompt-token counters
(``/metrics``) around the per-replica requests, the trainer engine's ``worker_states`` and both trainer ranks'
reports. The test asserts on OUT_JSON.
"""

import json
import re
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from _vllm_e2e import NEW_TOKENS, PROMPTS, hf_outputs  # the probes of the offline test
LONG_TOKENS = 40
IN_FLIGHT_TOKENS = 240  # long enough to be still running when the pause comes (most likely)


def complete(base, model, prompt, replica, max_tokens=NEW_TOKENS):
    """Greedy completion of ``prompt`` (token ids) by data-parallel replica ``replica``: (tokens, logprobs,
    finish_reason)."""
    import requests

    r = requests.post(f"{base}/v1/completions", headers={"X-data-parallel-rank": str(replica)}, timeout=300,
                      json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
                            "ignore_eos": True})
    r.raise_for_status()
    c = r.json()["choices"][0]
    return c["token_ids"], c["logprobs"]["token_logprobs"], c["finish_reason"]


def prompt_tokens(base):
    """The server's ``vllm:prompt_tokens_total`` per engine (data-parallel replica)."""
    import requests

    text = requests.get(f"{base}/metrics", timeout=60).text
    out = {}
    for m in re.finditer(r'^vllm:prompt_tokens_total\{[^}]*engine="(\d+)"[^}]*\} ([0-9.e+]+)$', text, re.M):
        out[int(m.group(1))] = out.get(int(m.group(1)), 0.0) + float(m.group(2))
    return out


def running(base):
    """Requests the server's engines are running (``vllm:num_requests_running``)."""
    import requests

    text = requests.get(f"{base}/metrics", timeout=60).text
    return sum(float(m.group(1)) for m in re.finditer(r'^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$', text,
                                                        re.M))


def replica_outputs(base, model, replicas):
    """Every prompt on every replica: ``{replica: {"tokens", "logprobs"}}``, and the prompt tokens each engine
    counted while replica r was asked (``counted[r][engine]``)."""
    outs, counted = {}, {}
    for r in range(replicas):
        before = prompt_tokens(base)
        tokens, logprobs = [], []
        for p in PROMPTS:
            t, lp, _ = complete(base, model, p, r)
            tokens.append(t)
            logprobs.append(lp)
        outs[r] = {"tokens": tokens, "logprobs": logprobs}
        time.sleep(0.5)  # the counters are updated as outputs arrive; let the last one land
        after = prompt_tokens(base)
        counted[r] = {e: after.get(e, 0.0) - before.get(e, 0.0) for e in after}
    return outs, counted


def main() -> None:
    rank, tport, sport, model_dir, out_json = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], \
        sys.argv[5]
    base, model_name, engine_workers = sys.argv[6], sys.argv[7], int(sys.argv[8])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{tport}", rank=rank, world_size=2)
    import requests
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from oarlock.integrations.vllm import OarlockTrainerInitInfo, register

    register()
    res: dict = {"times": {}, "rounds": []}
    replicas = 0
    if rank == 0:
        replicas = engine_workers // int(requests.get(f"{base}/get_world_size", params={"include_dp": "false"},
                                                      timeout=60).json()["world_size"])
        res["replicas"] = replicas
        res["before"], res["before_counted"] = replica_outputs(base, model_name, replicas)

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    res["shapes"] = {n: list(p.shape) for n, p in model.named_parameters()}
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    res["fsdp_placements"] = sorted({str(p.placements) for p in model.parameters()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(200 + rank)  # each rank its own batch

    def train_step() -> None:
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    client = HTTPVLLMWeightSyncClient(base) if rank == 0 else None
    t1 = time.perf_counter()
    info = OarlockTrainerInitInfo(host="127.0.0.1", port=sport, trainer_world_size=2, engine_world_size=engine_workers,
                                  timeout=120.0, rank=rank)  # the secret: OARLOCK_SYNC_TOKEN, on both sides
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=model)
    res["times"]["trainer_init"] = time.perf_counter() - t1

    for round_ in (1, 2):
        train_step()
        held: dict = {}
        threads = []
        if rank == 0 and round_ == 1:
            def ask(key: str, prompt: list, n: int = LONG_TOKENS) -> None:
                t, _, reason = complete(base, model_name, prompt, 0, n)
                held[key] = {"tokens": t, "finish_reason": reason, "at": time.monotonic()}

            threads.append(threading.Thread(target=ask, args=("in_flight", [11, 12, 13], IN_FLIGHT_TOKENS)))
            held["asked_at"] = time.monotonic()
            threads[-1].start()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not running(base) and "in_flight" not in held:
                time.sleep(0.005)
            r = requests.post(f"{base}/pause", params={"mode": "keep"}, timeout=120)
            r.raise_for_status()
            held["in_flight_unfinished_at_pause"] = "in_flight" not in held
            held["paused_at"] = time.monotonic()
            held["paused"] = requests.get(f"{base}/is_paused", timeout=60).json()["is_paused"]
            threads.append(threading.Thread(target=ask, args=("while_paused", PROMPTS[0])))
            threads[-1].start()
            time.sleep(1.0)
            held["answered_while_paused"] = "while_paused" in held
        t1 = time.perf_counter()
        rep = engine.send_weights(step=round_)
        seconds = time.perf_counter() - t1
        reports = [None, None]
        dist.all_gather_object(reports, {"bytes_sent": rep.bytes_sent, "bytes_received": rep.bytes_received,
                                         "plan_reused": rep.plan_reused, "seconds": seconds})
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        if rank == 0:
            if round_ == 1:
                resumed_at = time.monotonic()
                requests.post(f"{base}/resume", timeout=120).raise_for_status()
                for t in threads:
                    t.join(timeout=300)
                held["resumed_at"] = resumed_at
            after, counted = replica_outputs(base, model_name, replicas)
            ref_model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            ref_model.load_state_dict(full)
            res["rounds"].append({"trainer_reports": reports, "workers": engine.worker_states, "after": after,
                                  "counted": counted, "reference": hf_outputs(ref_model.eval(), PROMPTS),
                                  "reference_long": hf_outputs(ref_model.eval(), [PROMPTS[0]], LONG_TOKENS),
                                  "held": held})
        dist.barrier()

    engine.shutdown()
    if rank == 0:
        client.shutdown_weight_transfer_engine()  # the workers leave the sync group; the server keeps serving
        with open(out_json, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
