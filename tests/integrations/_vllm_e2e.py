"""One trainer rank of the vLLM end-to-end test (tests/integrations/test_vllm.py), run by ``.vllm-venv``'s Python:

    python _vllm_e2e.py RANK TRAINER_PORT SYNC_PORT MODEL_DIR OUT_JSON WRONG_SYNC_PORT

Two trainer ranks (gloo) fine-tune a transformers Llama wrapped in FSDP2 for one step; rank 0 also holds a vLLM
engine (TP=2, CPU) built from the same initial weights with ``WeightTransferConfig(backend="oarlock")``. First a
trainer whose ``intermediate_size`` is wrong (768 instead of 512, FSDP2 too, through ``dtype="float32"``'s
generated casts) joins at WRONG_SYNC_PORT: its round fails while it is planned (PlanError on both ranks), the
engine is not torn and still answers with its old tokens, and that trainer leaves. Rank 0 then records vLLM's
greedy tokens and logprobs before the sync, after it, after a replayed sync, after a sync whose bytes were
tampered with (verify=True catches it: torn), after a plan-time error while torn (still torn) and after a
repaired sync; and the same greedy decoding by transformers on the trainer's new weights (gathered with
``full_tensor()``), the workers' states and both trainer ranks' reports. The test asserts on OUT_JSON.
"""

import json
import sys
import time
import traceback

import torch
import torch.distributed as dist

PROMPTS = [[5, 17, 99, 200, 3], [7, 8, 9], [300, 301, 302, 303, 304, 305, 306]]
NEW_TOKENS = 6
TP = 2


def vllm_outputs(generate, prompts):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, detokenize=False, ignore_eos=True)
    outs = generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    tokens, logprobs = [], []
    for o in outs:
        c = o.outputs[0]
        tokens.append(list(c.token_ids))
        logprobs.append([step[t].logprob for t, step in zip(c.token_ids, c.logprobs)])
    return {"tokens": tokens, "logprobs": logprobs}


def hf_outputs(model, prompts, new_tokens=NEW_TOKENS):
    """Greedy decoding by transformers, with the log-softmax of the raw logits of each chosen token."""
    tokens, logprobs = [], []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True,
                                 eos_token_id=None, pad_token_id=0)
            new = out.sequences[0, len(p):].tolist()
            lp = [torch.log_softmax(step[0].double(), -1)[t].item() for t, step in zip(new, out.logits)]
            tokens.append(new)
            logprobs.append(lp)
    return {"tokens": tokens, "logprobs": logprobs}


def fsdp2_step(model_cls, model_dir, rank, res):
    """One FSDP2 training step of ``model_cls`` loaded from ``model_dir`` on the 2 gloo ranks (each rank its own
    random batch); returns the model and its HF parameter shapes, records the loss, placements and time."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    t1 = time.perf_counter()
    model = model_cls.from_pretrained(model_dir, dtype=torch.float32)
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    res["loss"] = loss.item()
    res["fsdp_placements"] = sorted({str(p.placements) for p in model.parameters()})
    res["times"]["train_step"] = time.perf_counter() - t1
    return model, shapes


def main() -> None:
    rank, tport, sport, model_dir, out_json = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], \
        sys.argv[5]
    wport = int(sys.argv[6])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{tport}", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    import oarlock.checkpoint.runtime.transfer as transfer
    from oarlock.checkpoint import CheckpointError, CheckpointMismatchError, PlanError
    from oarlock.integrations.vllm import (LLMClient, OarlockTrainerInitInfo, TornWeightsError, register,
                                           worker_states)

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

    # -- one FSDP2 training step on 2 gloo ranks
    model, shapes = fsdp2_step(LlamaForCausalLM, model_dir, rank, res)
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    # -- a trainer of another size (intermediate_size 768, the engine's is 512): the round cannot be planned
    wrong = LlamaForCausalLM(LlamaConfig(**{**model.config.to_dict(), "intermediate_size": 768}))
    mesh = init_device_mesh("cpu", (2,))
    for layer in wrong.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(wrong, mesh=mesh)
    t1 = time.perf_counter()
    wrong_engine = WeightTransferTrainerFactory.trainer_init(
        OarlockTrainerInitInfo(host="127.0.0.1", port=wport, trainer_world_size=2, engine_world_size=TP,
                               dtype="float32", timeout=120.0, rank=rank), client=client, source=wrong)
    try:
        wrong_engine.send_weights(step=0)
        said = {"error": "no error"}
    except Exception as e:  # noqa: BLE001 - recorded for the test
        said = {"error": f"{type(e).__name__}: {e}", "plan_error": isinstance(e, PlanError),
                "mismatch": isinstance(e, CheckpointMismatchError), "phase": getattr(e, "phase", None)}
    said["trainer_torn"] = wrong_engine.sync.torn
    said["seconds"] = time.perf_counter() - t1
    errors = [None, None]
    dist.all_gather_object(errors, said)
    res["plan_errors"] = errors
    res["wrong_aoa_generated"] = wrong_engine.sync.aoa_config.get("generated_statements")
    wrong_engine.shutdown()
    if rank == 0:
        res["client_torn_after_plan_error"] = client.torn
        res["workers_after_plan_error"] = worker_states(llm)
        res["after_plan_error"] = vllm_outputs(client.generate, PROMPTS)  # still the old weights
        client.shutdown_weight_transfer_engine()  # the workers leave that trainer's group

    # -- the sync: trainer ranks 0, 1 and the engine's workers 2, 3 meet at 127.0.0.1:sport
    t1 = time.perf_counter()
    info = OarlockTrainerInitInfo(host="127.0.0.1", port=sport, trainer_world_size=2, engine_world_size=TP,
                                  verify=True, timeout=120.0, rank=rank)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=model)
    res["times"]["trainer_init"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    rep = engine.send_weights(step=1)
    res["times"]["sync"] = time.perf_counter() - t1
    reports = [None, None]
    dist.all_gather_object(reports, {"bytes_sent": rep.bytes_sent, "bytes_received": rep.bytes_received,
                                     "plan_reused": rep.plan_reused})
    res["trainer_reports"] = reports

    # the reference: transformers on the trainer's new weights, gathered on every rank
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        res["after"] = vllm_outputs(client.generate, PROMPTS)
        res["workers"] = worker_states(llm)
        ref_model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        missing, unexpected = ref_model.load_state_dict(full, strict=False)
        assert not unexpected and all(k == "lm_head.weight" and ref_model.config.tie_word_embeddings
                                      for k in missing), (missing, unexpected)
        res["reference"] = hf_outputs(ref_model.eval(), PROMPTS)
        res["shapes"] = shapes

    # -- a replayed sync (nothing changed: the plan is reused)
    t1 = time.perf_counter()
    rep = engine.send_weights(step=2)
    res["times"]["sync_replayed"] = time.perf_counter() - t1
    res["replay_plan_reused"] = rep.plan_reused

    # -- a sync whose bytes to worker 2 are corrupted on the way: caught by verify=True, the engine is torn
    def flip(sender: int, receiver: int, round_: int, buf: torch.Tensor) -> None:
        if receiver == 2:
            buf[0] ^= 0xFF

    transfer._tamper = flip
    try:
        engine.send_weights(step=3)
        res["tampered_sync"] = "no error"
    except CheckpointError as e:
        res["tampered_sync"] = f"CheckpointError: {e}"
    finally:
        transfer._tamper = None
    res["trainer_sync_torn"] = engine.sync.torn
    dist.barrier()
    if rank == 0:
        try:
            client.generate([[1, 2, 3]])
            res["generate_when_torn"] = "no error"
        except TornWeightsError as e:
            res["generate_when_torn"] = f"TornWeightsError: {e}"
        res["workers_torn"] = [w["torn"] for w in worker_states(llm)]

    # -- a round that cannot be planned while the engine is torn (the wrong trainer's shapes): it stays torn
    read = engine._read
    engine._read = lambda: dict(wrong.named_parameters())
    try:
        engine.send_weights(step=3)
        res["plan_error_when_torn"] = "no error"
    except PlanError as e:
        res["plan_error_when_torn"] = f"PlanError: {e}"
    finally:
        engine._read = read
    if rank == 0:
        res["client_torn_after_second_plan_error"] = client.torn
        res["workers_torn_after_plan_error"] = [w["torn"] for w in worker_states(llm)]

    # -- a later sync succeeds: the engine serves the new weights again
    engine.send_weights(step=4)
    if rank == 0:
        res["workers_after_repair"] = [w["torn"] for w in worker_states(llm)]
        res["after_repair"] = vllm_outputs(client.generate, PROMPTS)
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
