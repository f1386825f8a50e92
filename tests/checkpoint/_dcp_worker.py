"""Rank body that writes real torch.distributed.checkpoint (DCP) fixtures on gloo (launched by test_dcp.py).

Every checkpoint here is written by torch's own ``dcp.save``; the reference values are the writer's full
tensors (``DTensor.full_tensor()`` / ``get_state_dict(full_state_dict=True)``), saved by rank 0 next to it.

* ``fsdp``: a tiny HF ``LlamaForCausalLM`` under FSDP2 (``fully_shard``) on 4 ranks plus AdamW after one step,
  ``{"model": ..., "optim": ...}`` from ``get_state_dict`` (default ``torch.save`` serialisation).
* ``fsdp_st``: the same state dict with ``SerializationFormat.SAFETENSORS``; ``fsdp_zstd``: with the zstd
  stream transform; ``hf_model``: the model state dict alone (HF key names, for ``convert --to hf``).
* ``mesh``: DTensors on a 2x2 mesh (Shard(0)/Shard(1), Shard(1)/Replicate, 3-D) and a bf16 key.
* ``multi``: a ShardedTensor with two chunks of one key on every rank (interleaved rows).
* ``two``: saved by a 2-rank subgroup (ranks 0 and 1) only.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

MESH_SHAPES = {"mesh.a": ((16, 12), torch.float32), "mesh.b": ((10, 6), torch.float32),
               "mesh.c": ((4, 6, 8), torch.bfloat16), "mesh.d": ((9,), torch.int64)}


def mesh_full(name: str) -> torch.Tensor:
    shape, dtype = MESH_SHAPES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    if dtype == torch.int64:
        return torch.randint(-10**9, 10**9, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def multi_full() -> torch.Tensor:
    return torch.arange(8 * 16 * 5, dtype=torch.float32).reshape(8 * 16 // 8, 8, 5).reshape(16, 8, 5) / 7


def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False)


def run(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _body(rank, world, Path(root))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _body(rank: int, world: int, root: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import Shard as STShard
    from torch.distributed._shard.sharded_tensor import init_from_local_shards
    from torch.distributed._shard.sharded_tensor.metadata import ShardMetadata
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from transformers import LlamaForCausalLM

    # FSDP2 model + optimizer
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.save(sd, checkpoint_id=str(root / "fsdp"))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(root / "fsdp_st"),
                                                     serialization_format=SerializationFormat.SAFETENSORS))
    if ZStandard.is_available():
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(root / "fsdp_zstd"), _extensions=[ZStandard()]))
    dcp.save(msd, checkpoint_id=str(root / "hf_model"))
    fm, fo = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"model": fm, "optim": fo}, root / "fsdp_ref.pt")

    # DTensors on a 2x2 mesh
    mesh2 = init_device_mesh("cpu", (2, 2))
    placements = {"mesh.a": [Shard(0), Shard(1)], "mesh.b": [Shard(1), Replicate()],
                  "mesh.c": [Shard(2), Shard(0)], "mesh.d": [Replicate(), Shard(0)]}
    dsd = {k: distribute_tensor(mesh_full(k), mesh2, placements[k]) for k in MESH_SHAPES}
    dsd["step"] = 11
    dsd["note"] = {"text": "hello", "values": [1, 2.5]}
    dcp.save(dsd, checkpoint_id=str(root / "mesh"))

    # two chunks of one key per rank: rows [8*j + 2*rank, 8*j + 2*rank + 2) for j in 0, 1
    full = multi_full()
    shards, metas = [], []
    for j in range(2):
        for r in range(world):
            md = ShardMetadata([8 * j + 2 * r, 0, 0], [2, 8, 5], f"rank:{r}/cpu")
            metas.append(md)
            if r == rank:
                shards.append(STShard(full[8 * j + 2 * r: 8 * j + 2 * r + 2].clone(), md))
    st = init_from_local_shards(shards, 16, 8, 5)
    dcp.save({"multi.w": st}, checkpoint_id=str(root / "multi"))

    # saved by a 2-rank subgroup only
    sub = dist.new_group([0, 1])
    if rank < 2:
        two_full = mesh_full("mesh.a")
        md = [ShardMetadata([8 * r, 0], [8, 12], f"rank:{r}/cpu") for r in range(2)]
        st2 = init_from_local_shards([STShard(two_full[8 * rank: 8 * rank + 8].clone(), md[rank])], 16, 12,
                                     process_group=sub)
        dcp.save({"two.w": st2, "two.step": 3}, checkpoint_id=str(root / "two"), process_group=sub)
