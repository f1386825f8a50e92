"""torch's training-state layout written by the real writers, on CPU/gloo (one rank by default): a tiny HF
``LlamaForCausalLM`` (``transformers.LlamaConfig``) under FSDP2 (``fully_shard``) plus AdamW after one step,
``get_state_dict(model, optim)`` saved as ``{"model": ..., "optim": ...}`` by oarlock's ``save_state_dict`` into
``ctx.shared/oar`` and by ``dcp.save`` into ``ctx.shared/dcp``. Rank 0 leaves the references next to them:
``full.pt`` (the full model state dict from ``get_state_dict(full_state_dict=True)``), ``logits.pt`` (``ids`` and
the FSDP2 model's own eval-mode logits) and ``config.json`` (the model's config, so the checkpoints become HF
directories)."""

from __future__ import annotations

import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from oarlock.checkpoint import save_state_dict

warnings.filterwarnings("ignore")


def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       tie_word_embeddings=False)


def _trained_fsdp2_llama(rank: int):
    """The tiny Llama under FSDP2 with AdamW after one step (the same on every call)."""
    from transformers import LlamaForCausalLM

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return model, opt


def scenario_write_get_state_dict(ctx):
    root, rank = ctx.shared, ctx.rank
    model, opt = _trained_fsdp2_llama(rank)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    save_state_dict(sd, root / "oar")
    dcp.save(sd, checkpoint_id=str(root / "dcp"))
    fm, _ = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    model.eval()
    test_ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = model(input_ids=test_ids).logits
    if rank == 0:
        torch.save({k: v.clone() for k, v in fm.items()}, root / "full.pt")
        torch.save({"ids": test_ids, "logits": logits}, root / "logits.pt")
        tiny_llama_config().save_pretrained(root / "cfg")
        for d in ("oar", "dcp"):
            shutil.copyfile(root / "cfg" / "config.json", root / d / "config.json")
    dist.barrier()


def scenario_write_accelerate_save_state(ctx):
    """accelerate's FSDP2 ``save_state`` layout written by accelerate's own writers into ``ctx.shared/acc``:
    ``save_fsdp_model`` and ``save_fsdp_optimizer`` (the functions ``Accelerator.save_state`` calls for an FSDP
    model, ``SHARDED_STATE_DICT``) and ``save_accelerator_state`` (its RNG pickle). ``Accelerator`` itself
    enables FSDP only on GPU back ends, so the writers get torch's ``fully_shard`` model and accelerate's
    ``PartialState`` (the process state an ``Accelerator`` wraps; the writers read its ``num_processes`` and
    ``process_index``). ``acc_full.pt``: the full state dict."""
    from accelerate import PartialState
    from accelerate.checkpointing import save_accelerator_state
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer

    root, rank = ctx.shared, ctx.rank
    model, opt = _trained_fsdp2_llama(rank)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    acc = PartialState(cpu=True)  # joins the harness's gloo group
    assert acc.num_processes == dist.get_world_size() and acc.process_index == rank
    out = str(root / "acc")
    save_fsdp_model(plugin, acc, model, out, 0)
    save_fsdp_optimizer(plugin, acc, opt, model, out, 0)
    save_accelerator_state(out, [], [], [], [], rank, 1)
    fm, _ = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({k: v.clone() for k, v in fm.items()}, root / "acc_full.pt")
        tiny_llama_config().save_pretrained(out)  # the user's config.json beside accelerate's output
    dist.barrier()
