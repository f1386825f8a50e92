"""Scenarios of test_vllm_preset.py on 4 gloo ranks: MoE trainers into vLLM-shaped MoE workers through WeightSync,
without vLLM. Ranks 0 and 1 are the trainer, ranks 2 and 3 the engine's workers, each describing its stacked expert
tensors with the back end's own layout functions (``fused_moe_layout`` + ``layout_boxes``, what
``describe_targets`` builds from a vLLM ``RoutedExperts`` layer). Each worker must receive exactly its experts'
slices (values against the trainer's full tensors cut by hand, ``bytes_received`` equal to its buffers), and the
trainer ranks send no more than the workers' bytes, shared between them.

* an expert-parallel trainer (rank r holds experts 4r..4r+3, one module per expert; the rest replicated) into a
  TP=2 engine (each worker: half of every expert's gate/up rows and down columns), for Qwen3-MoE;
* an FSDP2 trainer (transformers 5's stacked ``gate_up_proj`` / ``down_proj``; every parameter in row shards on
  dim 0 over the trainer ranks, as FSDP2 holds it, the experts' on the expert axis) into an expert-parallel
  engine (each worker: 4 whole experts; the engine's EP layout, which vLLM runs on GPUs only), for Qwen3-MoE;
* and the other two pairings (EP trainer into EP workers, FSDP2 trainer into TP workers), for Mixtral.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from oarlock.checkpoint import ShardedWeight, WeightSync
from oarlock.checkpoint.aoa.presets import preset
from oarlock.integrations.vllm import fused_moe_layout, layout_boxes

E, LAYERS = 8, 2


def model(arch):
    """A tiny MoE model's config and its parameters as transformers 5 holds them (stacked experts), random."""
    H, I, D = 32, 16, 8
    cfg = {"model_type": arch, "vocab_size": 64, "hidden_size": H, "num_hidden_layers": LAYERS,
           "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}
    cfg.update({"num_experts": E, "moe_intermediate_size": I, "intermediate_size": 40, "head_dim": D}
               if arch == "qwen3_moe" else {"num_local_experts": E, "intermediate_size": I})
    g = torch.Generator().manual_seed(11)
    full = {"model.embed_tokens.weight": torch.randn(64, H, generator=g)}
    for i in range(LAYERS):
        a = f"model.layers.{i}."
        full.update({a + "self_attn.q_proj.weight": torch.randn(4 * D, H, generator=g),
                     a + "self_attn.k_proj.weight": torch.randn(2 * D, H, generator=g),
                     a + "self_attn.v_proj.weight": torch.randn(2 * D, H, generator=g),
                     a + "mlp.gate.weight": torch.randn(E, H, generator=g),
                     a + "mlp.experts.gate_up_proj": torch.randn(E, 2 * I, H, generator=g),
                     a + "mlp.experts.down_proj": torch.randn(E, H, I, generator=g)})
    return cfg, full


def worker_targets(arch, full, experts, tp_rank, tp_size):
    """A vLLM worker's expert tensors (buffers) and their targets; and the values it must end with."""
    block = "mlp" if arch == "qwen3_moe" else "block_sparse_moe"
    bufs, targets, want = {}, {}, {}
    for i in range(LAYERS):
        gate_up = full[f"model.layers.{i}.mlp.experts.gate_up_proj"][experts]
        down = full[f"model.layers.{i}.mlp.experts.down_proj"][experts]
        gate, up = gate_up.chunk(2, 1)
        base = f"model.layers.{i}.{block}.experts.routed_experts."
        want[base + "w13_weight"] = torch.cat([gate.chunk(tp_size, 1)[tp_rank], up.chunk(tp_size, 1)[tp_rank]], 1)
        want[base + "w2_weight"] = down.chunk(tp_size, 2)[tp_rank]
        for pname in ("w13_weight", "w2_weight"):
            k = base + pname
            buf = bufs[k] = torch.full_like(want[k], float("nan"))
            layout = fused_moe_layout(pname, tuple(buf.shape), experts, E, tp_rank, tp_size)
            targets[k] = [ShardedWeight(k, buf[idx], tuple(buf[idx].shape), gs, off)
                          for idx, gs, off in layout_boxes(tuple(buf.shape), layout)]
    return bufs, targets, want


def run(ctx, arch, trainer, engine):
    config, full = model(arch)
    experts_keys = [k for k in full if ".experts." in k]
    if trainer == "ep":  # one module per expert, each trainer rank holding its 4 experts; the rest replicated
        sources = {k: v for k, v in full.items() if ".experts." not in k} if ctx.rank < 2 else {}
        if ctx.rank < 2:
            mine = range(4 * ctx.rank, 4 * ctx.rank + 4)
            for k in experts_keys:
                v = full[k]
                for e in mine:
                    if k.endswith("gate_up_proj"):
                        g, u = v[e].chunk(2)
                        gname, uname = (("gate_proj", "up_proj") if arch == "qwen3_moe" else ("w1", "w3"))
                        sources[_module_key(arch, k, e, gname)] = g.clone()
                        sources[_module_key(arch, k, e, uname)] = u.clone()
                    else:
                        sources[_module_key(arch, k, e, "down_proj" if arch == "qwen3_moe" else "w2")] = v[e].clone()
        keys = sorted(_all_module_keys(arch, full))
    else:  # FSDP2: every parameter in row shards on dim 0 over the trainer ranks
        keys = sorted(full)
        sources = {k: _fsdp_shard(k, v, ctx.rank) for k, v in full.items()} if ctx.rank < 2 else {}
    cfg = preset("vllm", config, source=keys)
    workers = {"tp2": [(list(range(E)), r, 2) for r in range(2)],
               "ep2": [(list(range(4 * r, 4 * r + 4)), 0, 1) for r in range(2)]}[engine]
    targets, bufs, want = {}, {}, {}
    if ctx.rank >= 2:
        bufs, targets, want = worker_targets(arch, full, *workers[ctx.rank - 2])
    rep = WeightSync(sources, targets, aoa_config=cfg, strict=False).run()
    for k, w in want.items():
        assert torch.equal(bufs[k], w), k
    mine = sum(w.numel() * w.element_size() for w in want.values())
    assert rep.bytes_received == mine, (rep.bytes_received, mine)
    sent = [None] * ctx.world
    dist.all_gather_object(sent, [rep.bytes_sent, mine])
    assert sum(s for s, _ in sent) == sum(m for _, m in sent)  # nothing beyond the workers' slices moved
    assert all(s > 0 for s, _ in sent[:2]) and all(s == 0 for s, _ in sent[2:])  # both trainer ranks sent


def _module_key(arch, stacked_key, e, name):
    """The per-expert (checkpoint) name of expert ``e``'s ``name`` tensor of the layer of ``stacked_key``."""
    layer = stacked_key.split(".")[2]
    if arch == "qwen3_moe":
        return f"model.layers.{layer}.mlp.experts.{e}.{name}.weight"
    return f"model.layers.{layer}.block_sparse_moe.experts.{e}.{name}.weight"


def _all_module_keys(arch, full):
    """Every key of an expert-parallel trainer (all ranks together): per-expert modules and the rest."""
    out = [k for k in full if ".experts." not in k]
    for k in full:
        if k.endswith("gate_up_proj"):
            names = ("gate_proj", "up_proj") if arch == "qwen3_moe" else ("w1", "w3")
            out += [_module_key(arch, k, e, n) for e in range(E) for n in names]
        elif k.endswith("down_proj"):
            out += [_module_key(arch, k, e, "down_proj" if arch == "qwen3_moe" else "w2") for e in range(E)]
    return out


def _fsdp_shard(k, v, rank):
    """``v`` as FSDP2 holds it on trainer rank ``rank`` of 2: its rows ``[rank * ceil(n / 2), ...)``."""
    rows = -(-v.shape[0] // 2)
    lo, hi = min(rank * rows, v.shape[0]), min((rank + 1) * rows, v.shape[0])
    part = v[lo:hi].clone()
    return ShardedWeight(k, part, tuple(part.shape), tuple(v.shape), (lo,) + (0,) * (v.dim() - 1))


def scenario_qwen3_moe_ep_trainer_into_tp2_engine(ctx):
    run(ctx, "qwen3_moe", "ep", "tp2")


def scenario_qwen3_moe_fsdp2_trainer_into_ep2_engine(ctx):
    run(ctx, "qwen3_moe", "fsdp2", "ep2")


def scenario_mixtral_ep_trainer_into_ep2_engine(ctx):
    run(ctx, "mixtral", "ep", "ep2")


def scenario_mixtral_fsdp2_trainer_into_tp2_engine(ctx):
    run(ctx, "mixtral", "fsdp2", "tp2")
