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

Then every rank loads with oarlock's ``load_state_dict`` (named scenarios; each rank writes
``results_{rank}.json`` with "ok" or the error per scenario): the 1-process DCP ``single`` the parent saved
into 2x2-mesh DTensors (1 -> 4 ranks), ``two`` into 4 ranks (2 -> 4), and ``fsdp``/``fsdp_st``/``fsdp_zstd``
into a fresh FSDP2 model + optimizer from ``get_state_dict`` (4 -> 4), each compared bit for bit with the
writer's local tensors.
"""

from __future__ import annotations

import json
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


def single_state() -> dict:
    """What the parent saves with ``dcp.save`` in one process (plain tensors and a value)."""
    return {**{k: mesh_full(k) for k in MESH_SHAPES}, "epoch": 5}


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

    results: dict[str, str] = {}

    def scenario(name, fn):
        try:
            fn()
            results[name] = "ok"
        except Exception as e:  # reported by name and rank in the parent
            import traceback

            results[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"

    from oarlock.checkpoint import load_state_dict, open_checkpoint

    def one_to_four():
        place = {"mesh.a": [Shard(1), Shard(0)], "mesh.b": [Shard(0), Shard(1)], "mesh.c": [Replicate(), Shard(1)],
                 "mesh.d": [Shard(0), Replicate()]}
        tgt = {k: distribute_tensor(torch.zeros_like(mesh_full(k)), mesh2, place[k]) for k in MESH_SHAPES}
        tgt["epoch"] = 0
        rep = load_state_dict(tgt, root / "single")
        for k in MESH_SHAPES:
            ref = distribute_tensor(mesh_full(k), mesh2, place[k]).to_local()
            assert torch.equal(tgt[k].to_local(), ref), k
        assert tgt["epoch"] == 5, tgt["epoch"]
        assert rep.bytes_read < sum(mesh_full(k).nbytes for k in MESH_SHAPES), rep.bytes_read

    def two_to_four():
        tgt = {"two.w": distribute_tensor(torch.zeros(16, 12), mesh, [Shard(1)]), "two.step": 0}
        load_state_dict(tgt, root / "two")
        assert torch.equal(tgt["two.w"].to_local(), mesh_full("mesh.a")[:, 3 * rank:3 * rank + 3])
        assert tgt["two.step"] == 3

    def fsdp_into(name):
        def body():
            torch.manual_seed(1)
            fresh = LlamaForCausalLM(tiny_llama_config())
            for layer in fresh.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(fresh, mesh=mesh)
            fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
            fresh(input_ids=ids, labels=ids).loss.backward()  # creates the optimizer state to load into
            fopt.step()
            m2, o2 = get_state_dict(fresh, fopt)
            tgt = {"model": m2, "optim": o2}
            load_state_dict(tgt, root / name)
            for k, v in msd.items():
                a, b = m2[k], v
                a, b = (a.to_local() if hasattr(a, "to_local") else a), (b.to_local() if hasattr(b, "to_local") else b)
                assert torch.equal(a, b), k
            for fqn, st in osd["state"].items():
                for k, v in st.items():
                    a, b = o2["state"][fqn][k], v
                    a = a.to_local() if hasattr(a, "to_local") else a
                    b = b.to_local() if hasattr(b, "to_local") else b
                    assert torch.equal(a, b), (fqn, k)
            assert o2["param_groups"][0]["lr"] == 1e-2
        return body

    def gguf_to_four():
        from oarlock.checkpoint.formats.gguf import GgufFile
        from oarlock.models.smollm2 import gguf_path

        keys = {"model.layers.0.self_attn.q_proj.weight": [Shard(0)], "model.layers.3.self_attn.k_proj.weight":
                [Shard(1)], "model.layers.29.mlp.down_proj.weight": [Shard(0)]}
        ref = GgufFile(gguf_path())
        tgt = {k: distribute_tensor(torch.zeros_like(ref.read(k)), mesh, p) for k, p in keys.items()}
        load_state_dict(tgt, gguf_path(), strict=False)
        for k, p in keys.items():
            assert torch.equal(tgt[k].to_local(), distribute_tensor(ref.read(k), mesh, p).to_local()), k

    def several_chunks():
        from oarlock.checkpoint import ShardedWeight, save_state_dict

        save_state_dict({"multi.w": st}, root / "oar_multi")  # the ShardedTensor: two chunks per rank
        with open_checkpoint(root / "oar_multi") as r:
            shards = r.metadata.tensors["multi.w"].shards
            assert len(shards) == 8 and len({s.file for s in shards}) == 4, shards
        rows = [(4 * rank + 2, 2), (4 * rank, 2)]  # two chunks per rank again, other rows, reverse order
        tgt = {"w": [ShardedWeight("multi.w", torch.zeros(n, 8, 5), (n, 8, 5), (16, 8, 5), (a, 0, 0))
                     for a, n in rows]}
        load_state_dict(tgt, root / "oar_multi")
        for sw, (a, n) in zip(tgt["w"], rows):
            assert torch.equal(sw.local_tensor, full[a:a + n]), (a, n)
        tgt = {"w": [ShardedWeight("multi.w", torch.zeros(n, 8, 5), (n, 8, 5), (16, 8, 5), (a, 0, 0))
                     for a, n in rows]}
        load_state_dict(tgt, root / "multi")  # the DCP torch wrote from the same ShardedTensor
        for sw, (a, n) in zip(tgt["w"], rows):
            assert torch.equal(sw.local_tensor, full[a:a + n]), (a, n)

    scenario("1->4 DTensor 2x2 mesh from a 1-process DCP", one_to_four)
    scenario("several chunks of one key per rank: oarlock save + load, DCP load", several_chunks)
    scenario("GGUF file -> 4 ranks (Shard(0) / Shard(1) DTensors)", gguf_to_four)
    scenario("2->4 ShardedTensor of a 2-rank subgroup", two_to_four)
    for name in ("fsdp", "fsdp_st", "fsdp_zstd"):
        if (root / name).exists():
            scenario(f"4->4 FSDP2 model+AdamW from {name}", fsdp_into(name))
    (root / f"results_{rank}.json").write_text(json.dumps(results))
