"""Scenarios that write real torch.distributed.checkpoint (DCP) fixtures on 4 gloo ranks and load them with
oarlock (test_dcp.py launches them once, through the multirank harness; one test per scenario).

Every checkpoint here is written by torch's own ``dcp.save``; the reference values are the writer's full
tensors (``DTensor.full_tensor()`` / ``get_state_dict(full_state_dict=True)``), saved by rank 0 next to it.

* ``fsdp``: a tiny HF ``LlamaForCausalLM`` under FSDP2 (``fully_shard``) on 4 ranks plus AdamW after one step,
  ``{"model": ..., "optim": ...}`` from ``get_state_dict`` (default ``torch.save`` serialisation).
* ``fsdp_st``: the same state dict with ``SerializationFormat.SAFETENSORS``; ``fsdp_zstd``: with the zstd
  stream transform; ``hf_model``: the model state dict alone (HF key names, for ``convert --to hf``).
* ``mesh``: DTensors on a 2x2 mesh (Shard(0)/Shard(1), Shard(1)/Replicate, 3-D) and a bf16 key.
* ``multi``: a ShardedTensor with two chunks of one key on every rank (interleaved rows).
* ``two``: saved by a 2-rank subgroup (ranks 0 and 1) only.

The ``write_*`` scenarios write these into ``ctx.shared`` (the parent's tests read them too). Then every rank
loads with oarlock's ``load_state_dict``: the 1-process DCP ``single`` the parent saved into 2x2-mesh DTensors
(1 -> 4 ranks), ``two`` into 4 ranks (2 -> 4), a GGUF file into Shard(0)/Shard(1) DTensors, and ``fsdp`` /
``fsdp_st`` / ``fsdp_zstd`` into a fresh FSDP2 model + optimizer from ``get_state_dict`` (4 -> 4), each compared
bit for bit with the writer's local tensors (kept in the rank process by the write scenarios).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
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

from multirank import needs
from oarlock.checkpoint import ShardedWeight, load_state_dict, open_checkpoint, save_state_dict

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


# What the write scenarios leave for the load scenarios of the same rank process: the writer's own tensors.
STATE: dict = {}


def _mesh():
    if "mesh" not in STATE:  # collective: every rank creates it in the same scenario
        STATE["mesh"] = init_device_mesh("cpu", (dist.get_world_size(),))
    return STATE["mesh"]


def _mesh22():
    if "mesh22" not in STATE:
        STATE["mesh22"] = init_device_mesh("cpu", (2, 2))
    return STATE["mesh22"]


def _fsdp2_llama(seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config())
    for layer in model.model.layers:
        fully_shard(layer, mesh=_mesh())
    fully_shard(model, mesh=_mesh())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def scenario_write_fsdp2_model_and_adamw(ctx):
    """FSDP2 HF Llama + AdamW after one step, saved by dcp.save in the three serialisations (and the model alone);
    rank 0 saves the full reference next to it."""
    root, rank = ctx.shared, ctx.rank
    model, opt = _fsdp2_llama(0)
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
    STATE.update(msd=msd, osd=osd, ids=ids)


def scenario_write_dtensors_on_2x2_mesh(ctx):
    placements = {"mesh.a": [Shard(0), Shard(1)], "mesh.b": [Shard(1), Replicate()],
                  "mesh.c": [Shard(2), Shard(0)], "mesh.d": [Replicate(), Shard(0)]}
    dsd = {k: distribute_tensor(mesh_full(k), _mesh22(), placements[k]) for k in MESH_SHAPES}
    dsd["step"] = 11
    dsd["note"] = {"text": "hello", "values": [1, 2.5]}
    dcp.save(dsd, checkpoint_id=str(ctx.shared / "mesh"))


def scenario_write_two_chunks_of_one_key_per_rank(ctx):
    """A ShardedTensor: rows [8*j + 2*rank, 8*j + 2*rank + 2) for j in 0, 1 on every rank."""
    full, world = multi_full(), ctx.world
    shards, metas = [], []
    for j in range(2):
        for r in range(world):
            md = ShardMetadata([8 * j + 2 * r, 0, 0], [2, 8, 5], f"rank:{r}/cpu")
            metas.append(md)
            if r == ctx.rank:
                shards.append(STShard(full[8 * j + 2 * r: 8 * j + 2 * r + 2].clone(), md))
    st = init_from_local_shards(shards, 16, 8, 5)
    dcp.save({"multi.w": st}, checkpoint_id=str(ctx.shared / "multi"))
    STATE["multi_st"] = st


def scenario_write_from_a_2_rank_subgroup(ctx):
    sub = dist.new_group([0, 1])
    if ctx.rank < 2:
        two_full = mesh_full("mesh.a")
        md = [ShardMetadata([8 * r, 0], [8, 12], f"rank:{r}/cpu") for r in range(2)]
        st2 = init_from_local_shards([STShard(two_full[8 * ctx.rank: 8 * ctx.rank + 8].clone(), md[ctx.rank])],
                                     16, 12, process_group=sub)
        dcp.save({"two.w": st2, "two.step": 3}, checkpoint_id=str(ctx.shared / "two"), process_group=sub)


def scenario_one_to_four_dtensor_2x2_mesh_from_a_1_process_dcp(ctx):
    """The 1-process DCP ``single`` (saved by the parent) into 2x2-mesh DTensors of other placements; each rank
    reads less than the whole checkpoint."""
    mesh2 = _mesh22()
    place = {"mesh.a": [Shard(1), Shard(0)], "mesh.b": [Shard(0), Shard(1)], "mesh.c": [Replicate(), Shard(1)],
             "mesh.d": [Shard(0), Replicate()]}
    tgt = {k: distribute_tensor(torch.zeros_like(mesh_full(k)), mesh2, place[k]) for k in MESH_SHAPES}
    tgt["epoch"] = 0
    rep = load_state_dict(tgt, ctx.shared / "single")
    for k in MESH_SHAPES:
        ref = distribute_tensor(mesh_full(k), mesh2, place[k]).to_local()
        assert torch.equal(tgt[k].to_local(), ref), k
    assert tgt["epoch"] == 5, tgt["epoch"]
    assert rep.bytes_read < sum(mesh_full(k).nbytes for k in MESH_SHAPES), rep.bytes_read


@needs("write_two_chunks_of_one_key_per_rank")
def scenario_several_chunks_of_one_key_per_rank(ctx):
    """oarlock saves the two-chunks-per-rank ShardedTensor and loads two other chunks per rank (reverse order);
    the same load from the DCP torch wrote from the same ShardedTensor."""
    root, rank, full = ctx.shared, ctx.rank, multi_full()
    save_state_dict({"multi.w": STATE["multi_st"]}, ctx.root / "oar_multi")
    with open_checkpoint(ctx.root / "oar_multi") as r:
        shards = r.metadata.tensors["multi.w"].shards
        assert len(shards) == 8 and len({s.file for s in shards}) == 4, shards
    rows = [(4 * rank + 2, 2), (4 * rank, 2)]  # two chunks per rank again, other rows, reverse order
    for src in (ctx.root / "oar_multi", root / "multi"):
        tgt = {"w": [ShardedWeight("multi.w", torch.zeros(n, 8, 5), (n, 8, 5), (16, 8, 5), (a, 0, 0))
                     for a, n in rows]}
        load_state_dict(tgt, src)
        for sw, (a, n) in zip(tgt["w"], rows):
            assert torch.equal(sw.local_tensor, full[a:a + n]), (src.name, a, n)


def scenario_gguf_file_to_four_ranks(ctx):
    """SmolLM2's GGUF file into Shard(0) / Shard(1) DTensors; reference: the GGUF reader's whole tensors,
    distributed by torch."""
    from oarlock.checkpoint.formats.gguf import GgufFile
    from oarlock.models.smollm2 import gguf_path

    mesh = _mesh()
    keys = {"model.layers.0.self_attn.q_proj.weight": [Shard(0)], "model.layers.3.self_attn.k_proj.weight":
            [Shard(1)], "model.layers.29.mlp.down_proj.weight": [Shard(0)]}
    ref = GgufFile(gguf_path())
    tgt = {k: distribute_tensor(torch.zeros_like(ref.read(k)), mesh, p) for k, p in keys.items()}
    load_state_dict(tgt, gguf_path(), strict=False)
    for k, p in keys.items():
        assert torch.equal(tgt[k].to_local(), distribute_tensor(ref.read(k), mesh, p).to_local()), k


@needs("write_from_a_2_rank_subgroup")
def scenario_two_to_four_sharded_tensor_of_a_2_rank_subgroup(ctx):
    tgt = {"two.w": distribute_tensor(torch.zeros(16, 12), _mesh(), [Shard(1)]), "two.step": 0}
    load_state_dict(tgt, ctx.shared / "two")
    assert torch.equal(tgt["two.w"].to_local(), mesh_full("mesh.a")[:, 3 * ctx.rank:3 * ctx.rank + 3])
    assert tgt["two.step"] == 3, tgt["two.step"]


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _fsdp_into(ctx, name: str) -> None:
    """A fresh FSDP2 model + AdamW (other seed, one step so the optimizer state exists) loads ``name``: every
    local model and optimizer tensor equals the writer's, the learning rate comes back."""
    if not (ctx.shared / name).exists():
        import pytest

        pytest.skip("zstandard not installed: torch wrote no zstd checkpoint")
    fresh, fopt = _fsdp2_llama(1)
    ids = STATE["ids"]
    fresh(input_ids=ids, labels=ids).loss.backward()  # creates the optimizer state to load into
    fopt.step()
    m2, o2 = get_state_dict(fresh, fopt)
    load_state_dict({"model": m2, "optim": o2}, ctx.shared / name)
    for k, v in STATE["msd"].items():
        assert torch.equal(_local(m2[k]), _local(v)), k
    for fqn, st in STATE["osd"]["state"].items():
        for k, v in st.items():
            assert torch.equal(_local(o2["state"][fqn][k]), _local(v)), (fqn, k)
    assert o2["param_groups"][0]["lr"] == 1e-2


@needs("write_fsdp2_model_and_adamw")
def scenario_four_to_four_fsdp2_model_and_adamw_from_fsdp(ctx):
    _fsdp_into(ctx, "fsdp")


@needs("write_fsdp2_model_and_adamw")
def scenario_four_to_four_fsdp2_model_and_adamw_from_fsdp_st(ctx):
    _fsdp_into(ctx, "fsdp_st")


@needs("write_fsdp2_model_and_adamw")
def scenario_four_to_four_fsdp2_model_and_adamw_from_fsdp_zstd(ctx):
    _fsdp_into(ctx, "fsdp_zstd")
