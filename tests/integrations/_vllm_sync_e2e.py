"""One trainer rank of the vLLM MoE / replicated-KV-head tests (tests/integrations/test_vllm_layouts.py), run by
``.vllm-venv``'s Python:

    python _vllm_sync_e2e.py RANK TRAINER_PORT SYNC_PORT MODEL_DIR OUT_JSON [REFUSAL_PORT]

Two trainer ranks (gloo) take one FSDP2 training step of the transformers model in MODEL_DIR (a tiny Qwen3-MoE,
Mixtral or 1-KV-head Llama); rank 0 also holds a vLLM engine (TP=2, CPU) built from the same initial weights with
``WeightTransferConfig(backend="oarlock")``. Rank 0 records vLLM's greedy tokens and logprobs before the sync and
after it, transformers' on the trainer's new weights, the workers' states, and each worker's parameter names and
shapes; both ranks' reports. With REFUSAL_PORT, it first asks the engine to join with an init request carrying a
field its workers do not know: every trainer rank must raise the workers' refusal within seconds (recorded with
its time), then the real sync follows on SYNC_PORT.
"""

import json
import sys
import time
import traceback

import torch
import torch.distributed as dist

from _vllm_e2e import PROMPTS, fsdp2_step, hf_outputs, vllm_outputs  # the same probes as the dense test

TP = 2


def worker_params(worker):
    """Each of a worker's parameters in the shape vLLM loads it (the layer-wise reload's record)."""
    from oarlock.integrations.vllm import _loadable

    model = worker.weight_transfer_engine.model
    out = {}
    for mname, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            out[f"{mname}.{pname}" if mname else pname] = list(_loadable(module, pname, param).shape)
    return out


def refusal_round(rank, sport, client, model):
    """An init request whose worker part carries an unknown field: the workers join, refuse, and every trainer
    rank raises why."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from oarlock.checkpoint import CheckpointError
    from oarlock.integrations.vllm import OarlockTrainerInitInfo

    class NewerClient:  # a trainer whose oarlock adds an init field the engine's does not know
        def init_weight_transfer_engine(self, info):
            client.init_weight_transfer_engine({**info, "a_future_field": 1})

    info = OarlockTrainerInitInfo(host="127.0.0.1", port=sport, trainer_world_size=2, engine_world_size=TP,
                                  timeout=120.0, rank=rank)
    t0 = time.perf_counter()
    try:
        WeightTransferTrainerFactory.trainer_init(info, client=NewerClient() if rank == 0 else None, source=model)
        error = "no error"
    except CheckpointError as e:
        error = f"CheckpointError: {e}"
    return {"error": error, "seconds": time.perf_counter() - t0}


def main() -> None:
    rank, tport, sport, model_dir, out_json = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], \
        sys.argv[5]
    refusal_port = int(sys.argv[6]) if len(sys.argv) > 6 else None
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{tport}", rank=rank, world_size=2)
    from transformers import AutoModelForCausalLM

    from oarlock.integrations.vllm import LLMClient, OarlockTrainerInitInfo, register, worker_states

    register()
    res: dict = {"times": {}}
    t0 = time.perf_counter()
    llm = client = None
    if rank == 0:  # the engine starts from the checkpoint the trainer starts from
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        llm = LLM(model=model_dir, skip_tokenizer_init=True, tensor_parallel_size=TP, dtype="float32",
                  enforce_eager=True, max_model_len=64, max_num_seqs=4, kv_cache_memory_bytes=32 << 20, seed=0,
                  weight_transfer_config=WeightTransferConfig(backend="oarlock"))
        client = LLMClient(llm)
        res["times"]["engine_start"] = time.perf_counter() - t0
        res["before"] = vllm_outputs(client.generate, PROMPTS)
        res["worker_params"] = llm.collective_rpc(worker_params)

    # -- one FSDP2 training step on 2 gloo ranks
    model, shapes = fsdp2_step(AutoModelForCausalLM, model_dir, rank, res)

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    if refusal_port is not None:
        res["refusal"] = refusal_round(rank, refusal_port, client, model)
        all_refusals = [None, None]
        dist.all_gather_object(all_refusals, res["refusal"])
        res["refusals"] = all_refusals

    # -- the sync: trainer ranks 0, 1 and the engine's workers 2, 3 meet at 127.0.0.1:sport
    t1 = time.perf_counter()
    info = OarlockTrainerInitInfo(host="127.0.0.1", port=sport, trainer_world_size=2, engine_world_size=TP,
                                  timeout=120.0, rank=rank)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=model)
    res["times"]["trainer_init"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    rep = engine.send_weights(step=1)
    res["times"]["sync"] = time.perf_counter() - t1
    reports = [None, None]
    dist.all_gather_object(reports, {"bytes_sent": rep.bytes_sent, "bytes_received": rep.bytes_received})
    res["trainer_reports"] = reports

    # the reference: transformers on the trainer's new weights, gathered on every rank
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        res["after"] = vllm_outputs(client.generate, PROMPTS)
        res["workers"] = worker_states(llm)
        ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        missing, unexpected = ref_model.load_state_dict(full, strict=False)
        assert not unexpected and all(k == "lm_head.weight" and ref_model.config.tie_word_embeddings
                                      for k in missing), (missing, unexpected)
        res["reference"] = hf_outputs(ref_model.eval(), PROMPTS)
        res["shapes"] = shapes
        res["times"]["total"] = time.perf_counter() - t0
        with open(out_json, "w") as f:
            json.dump(res, f)
    engine.shutdown()
    dist.barrier()
    dist.destroy_process_group()
    if llm is not None:
        del llm


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.exit(1)  # a normal exit: vLLM's exit handlers stop the engine's processes
