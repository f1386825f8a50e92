"""Write real DeepSpeed ZeRO and Megatron-Core torch_dist checkpoints on CPU, with the writers' own full tensors as
references: multirank scenarios run on 2 gloo ranks with .foreign-venv's python (made by scripts/foreign_env.sh),
through the harness's command line, so a failing writer is reported by scenario and rank::

    PY tests/multirank.py tests/checkpoint/_foreign_writers.py 2 OUT megatron_gpt_tp2
        # GPTModel, TP=2 -> OUT/ckpt, OUT/ref_rank{r}.pt, OUT/logits.pt (Megatron's own forward),
        # OUT/ckpt_train (the same weights with Adam state), OUT/optim_ref_rank{r}.pt
    PY tests/multirank.py tests/checkpoint/_foreign_writers.py 2 OUT deepspeed_zero1 deepspeed_zero2 deepspeed_zero3
        # tiny HF Llama, one ZeRO stage each -> OUT/z{S}/ckpt, OUT/z{S}/ref.pt
    PY tests/multirank.py tests/checkpoint/_foreign_writers.py 1 OUT deepspeed_zero1_adamw
        # one process, ZeRO-1, AdamW -> OUT/z1w/ckpt, OUT/z1w/ckpt_intstep (Python-int steps), OUT/z1w/ref.pt

DeepSpeed's C++ op (``deepspeed_shm_comm``) is loaded from ``.foreign-venv/torch_extensions``, where
``scripts/foreign_env.sh`` prebuilt it; a stale build lock there fails the writer naming the file
(:func:`deepspeed_op_ready`) instead of hanging.

Megatron-Core's async file writer calls ``torch.cuda.synchronize()`` and ``torch.cuda.current_device()`` even
for CPU tensors; both are replaced by CPU no-ops in these writer processes only, and for Megatron's own forward
(reference logits, after the save) its CUDA RNG fork around the eval-mode (identity) attention dropout is a no-op
context too (nothing else is patched).
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any

import torch

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))


def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       tie_word_embeddings=False)


SHM_OP = "deepspeed_shm_comm"  # the C++ op DeepSpeed's distributed init loads (torch.utils.cpp_extension)
LOCK_WAIT_S = 60.0  # a live holder keeps the build lock for milliseconds: the op is prebuilt, nothing compiles


def extensions_dir(venv: str | None = None) -> str:
    """The torch extensions directory of ``.foreign-venv`` (``venv``, default this interpreter's ``sys.prefix``),
    where ``scripts/foreign_env.sh`` prebuilds DeepSpeed's C++ op: ``<real venv path>/torch_extensions``."""
    return os.path.join(os.path.realpath(venv or sys.prefix), "torch_extensions")


def deepspeed_op_ready(ext: str, wait_s: float = LOCK_WAIT_S) -> None:
    """Check that DeepSpeed's ``deepspeed_shm_comm`` op is prebuilt in ``ext`` and that no stale build lock stands
    in the way, before DeepSpeed loads it.

    torch.utils.cpp_extension.load takes ``<ext>/<op>/lock`` (created with O_EXCL) on every load, also of an
    up-to-date op, and a process that finds it waits until it disappears, with no limit: a process killed while
    holding it leaves every later DeepSpeed init hanging. A live holder releases it within milliseconds, so a lock
    still there after ``wait_s`` seconds is reported here instead of waited on forever.

    Raises:
        RuntimeError: the op is not prebuilt (naming ``scripts/foreign_env.sh``), or the lock file (named) stayed.
    """
    so = os.path.join(ext, SHM_OP, f"{SHM_OP}.so")
    if not os.path.isfile(so):
        raise RuntimeError(f"DeepSpeed's {SHM_OP} op is not prebuilt ({so} is missing): run scripts/foreign_env.sh "
                           "(tests never build it)")
    lock = os.path.join(ext, SHM_OP, "lock")
    deadline = time.monotonic() + wait_s
    while os.path.exists(lock):
        if time.monotonic() >= deadline:
            raise RuntimeError(f"stale torch extension build lock {lock} (still there after {wait_s:g} s): a process "
                               f"killed while loading DeepSpeed's {SHM_OP} op left it, and DeepSpeed would wait on it "
                               "forever; delete that file when no scripts/foreign_env.sh is running")
        time.sleep(0.1)


def _env(rank: int, world: int) -> None:
    """What DeepSpeed and Megatron read of a launcher's environment (the harness set MASTER_ADDR/PORT)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world),
                      DS_ACCELERATOR="cpu")


def scenario_megatron_gpt_tp2(ctx) -> None:
    """GPTModel with tensor parallelism ``world``, distinct values per tensor and TP shard, saved by
    ``dist_checkpointing.save`` into ``ctx.shared/ckpt``; each rank's own parameters in ``ref_rank{r}.pt``."""
    rank, world, out = ctx.rank, ctx.world, str(ctx.shared)
    _env(rank, world)
    import argparse

    import torch.distributed as dist

    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=world, pipeline_model_parallel_size=1)
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=96, use_cpu_initialization=True, gated_linear_unit=True,
                            activation_func=torch.nn.functional.silu, normalization="RMSNorm", add_bias_linear=False,
                            params_dtype=torch.float32)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=130, max_sequence_length=64, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    for name, p in model.named_parameters():  # distinct values per tensor and TP shard (norms start as ones)
        seed = sum(map(ord, name)) + (1000 * rank if getattr(p, "tensor_model_parallel", False) else 0)
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    sd = model.sharded_state_dict()
    sd["iteration"] = 7
    sd["checkpoint_version"] = 3.0
    sd["args"] = argparse.Namespace(num_layers=2, hidden_size=64, tensor_model_parallel_size=world,
                                    params_dtype=torch.float32)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)},
               os.path.join(out, f"ref_rank{rank}.pt"))
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    os.makedirs(os.path.join(out, "ckpt"), exist_ok=True)
    dist_checkpointing.save(sd, os.path.join(out, "ckpt"))
    dist.barrier()
    assert os.path.isfile(os.path.join(out, "ckpt", "metadata.json")), os.listdir(os.path.join(out, "ckpt"))
    megatron_logits(model, out, rank, world)  # after the save: the CPU stand-ins above are in place
    megatron_training_checkpoint(model, out, rank)


def megatron_training_checkpoint(model, out: str, rank: int) -> None:
    """A training checkpoint OUT/ckpt_train: the same weights plus the state of torch Adam after one step with
    lr=0 (weights unchanged; moments from seeded gradients, distinct per tensor and TP shard), sharded under
    ``optimizer`` the way Megatron-Core's ``FP32Optimizer.sharded_state_dict`` does (its own
    ``optim_state_to_sharding_state``: keys ``optimizer.state.<exp_avg|exp_avg_sq>.<param key>``; the
    per-parameter step left out); each rank's moments in OUT/optim_ref_rank{r}.pt ``{name: {state: tensor}}``."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                            optim_state_to_sharding_state)

    named = list(model.named_parameters())
    adam = torch.optim.Adam([p for _, p in named], lr=0.0)
    for name, p in named:
        seed = 100 + sum(map(ord, name)) + (1000 * rank if getattr(p, "tensor_model_parallel", False) else 0)
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
    adam.step()
    torch.save({name: {m: adam.state[p][m].clone() for m in ("exp_avg", "exp_avg_sq")} for name, p in named},
               os.path.join(out, f"optim_ref_rank{rank}.pt"))
    msd = model.sharded_state_dict()
    osd = adam.state_dict()
    optim_state_to_sharding_state(osd, get_param_id_to_sharded_param_map(msd, [p for _, p in named]),
                                  exclude_keys="step")
    os.makedirs(os.path.join(out, "ckpt_train"), exist_ok=True)
    dist_checkpointing.save({**msd, "optimizer": osd, "iteration": 8}, os.path.join(out, "ckpt_train"))


def megatron_logits(model, out: str, rank: int, world: int) -> None:
    """Megatron's own forward on CPU (causal mask, RoPE positions 0..S-1), logits gathered over the TP ranks:
    OUT/logits.pt holds ``ids`` and ``logits`` ``[1, S, padded vocab]``; on failure OUT/logits_error.txt says why
    (the checkpoint is still written)."""
    import torch.distributed as dist

    try:
        import contextlib

        from megatron.core import tensor_parallel

        # attention dropout runs inside a CUDA RNG fork even in eval mode (where dropout is the identity): on CPU
        # the fork is replaced by a no-op context, in this writer process only
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
        seq = 12
        ids = torch.randint(0, 128, (1, seq), generator=torch.Generator().manual_seed(5))
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]  # True = masked out
        model.eval()
        with torch.no_grad():
            local = model(input_ids=ids, position_ids=torch.arange(seq)[None], attention_mask=mask)
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous())
        if rank == 0:
            torch.save({"ids": ids, "logits": torch.cat(parts, -1)}, os.path.join(out, "logits.pt"))
    except Exception as e:  # noqa: BLE001 - the reason is recorded for the test's docstring-stated fallback
        if rank == 0:
            import traceback

            with open(os.path.join(out, "logits_error.txt"), "w") as f:
                f.write(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")


def _trained_engine(ctx, optimizer: dict, stage: int) -> Any:
    """A fresh DeepSpeed engine for ZeRO ``stage`` with ``optimizer`` (DeepSpeed's ``optimizer`` config block) on
    the tiny Llama, after two training steps (one rank-seeded batch)."""
    rank, world = ctx.rank, ctx.world
    _env(rank, world)
    # DeepSpeed loads its C++ op from .foreign-venv's own extensions directory, prebuilt at set-up time, never from
    # the shared ~/.cache/torch_extensions
    os.environ["TORCH_EXTENSIONS_DIR"] = extensions_dir()
    deepspeed_op_ready(os.environ["TORCH_EXTENSIONS_DIR"])
    import deepspeed
    from transformers import LlamaForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")  # uses the harness's process group
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    cfg = {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1, "optimizer": optimizer,
           "zero_optimization": {"stage": stage}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    _unlink_shm_buffer(rank)
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    return engine


def _unlink_shm_buffer(rank: int) -> None:
    """Remove this rank's name of DeepSpeed's shared-memory allreduce buffer once every rank has mapped it.

    DeepSpeed's CPU op creates ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``
    (69 MB) per rank and never unlinks it, so each test run left them behind, in memory, until reboot. The
    mappings stay valid after the unlink; the barrier makes sure no rank still has to open another's name."""
    import torch.distributed as dist

    dist.barrier()
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")
    try:
        os.unlink(name)
    except FileNotFoundError:  # DeepSpeed did not use its shared-memory path
        pass


def _full_reference(engine: Any) -> dict[str, torch.Tensor]:
    """DeepSpeed's own full fp32 weights and Adam moments (``optim.state.<param>.exp_avg``/``exp_avg_sq``); a
    collective: every rank calls it."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    ref = {}
    for name, p in engine.module.named_parameters():
        ref[name] = safe_get_full_fp32_param(p).detach().clone()
        for m in ("exp_avg", "exp_avg_sq"):
            ref[f"optim.state.{name}.{m}"] = safe_get_full_optimizer_state(p, m).detach().clone()
    return ref


def _deepspeed_zero(ctx, stage: int) -> None:
    """A fresh engine for ZeRO ``stage`` on the same tiny Llama, two steps, save into ``z{stage}/ckpt``; rank 0
    saves DeepSpeed's own full fp32 weights and Adam moments as ``z{stage}/ref.pt``."""
    engine = _trained_engine(ctx, {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}, stage)
    d = os.path.join(str(ctx.shared), f"z{stage}")
    engine.save_checkpoint(os.path.join(d, "ckpt"), tag="global_step2")
    ref = _full_reference(engine)
    if ctx.rank == 0:
        torch.save(ref, os.path.join(d, "ref.pt"))
    torch.distributed.barrier()
    engine.destroy() if hasattr(engine, "destroy") else None


def scenario_deepspeed_zero1(ctx) -> None:
    _deepspeed_zero(ctx, 1)


def scenario_deepspeed_zero2(ctx) -> None:
    _deepspeed_zero(ctx, 2)


def scenario_deepspeed_zero3(ctx) -> None:
    _deepspeed_zero(ctx, 3)



def scenario_deepspeed_zero1_adamw(ctx) -> None:
    """ZeRO-1 with AdamW in ``world`` processes (the issue's case: one), two steps, saved into ``z1w/ckpt``;
    ``z1w/ref.pt`` holds DeepSpeed's own full fp32 weights and moments, ``z1w/steps.json`` each group's step.

    ``z1w/ckpt_intstep`` is the same checkpoint with each group's ``step`` stored as a Python int, the way
    DeepSpeed's own ``FusedAdam`` keeps it (``state['step'] = group.get('step', 0)``, then ``+= 1``): the writer
    uses torch's AdamW (``torch_adam``) because FusedAdam's CPU op is a C++ build of several minutes, and rewrites
    only the ``step`` entries of the optimizer files (loaded and saved with DeepSpeed importable)."""
    import glob
    import json
    import shutil

    rank, out = ctx.rank, str(ctx.shared)
    engine = _trained_engine(ctx, {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01,
                                                               "torch_adam": True}}, 1)
    d = os.path.join(out, "z1w")
    engine.save_checkpoint(os.path.join(d, "ckpt"), tag="global_step2")
    ref = _full_reference(engine)
    torch.distributed.barrier()
    if rank == 0:
        torch.save(ref, os.path.join(d, "ref.pt"))
        shutil.copytree(os.path.join(d, "ckpt"), os.path.join(d, "ckpt_intstep"))
        steps = []
        for f in sorted(glob.glob(os.path.join(d, "ckpt_intstep", "global_step2", "*optim_states.pt"))):
            sd = torch.load(f, weights_only=False)
            inner = sd["optimizer_state_dict"]["base_optimizer_state"]
            for g, st in inner["state"].items():
                st["step"] = int(st["step"])
                steps.append(st["step"])
            torch.save(sd, f)
        with open(os.path.join(d, "steps.json"), "w") as f:
            json.dump({"steps": steps, "groups": len(engine.optimizer.optimizer.param_groups)}, f)
    torch.distributed.barrier()
