"""Scenarios of tests/checkpoint/test_optim_dist.py: exact training resume across layouts on 4 gloo ranks, one
scenario per layout pair (``scenario_<A>_to_<B>``), run in one launch by the multirank harness.

Each scenario trains a small Llama (oarlock.models) for K steps in layout A, saves model + optimizer, trains M
more steps in A (the uninterrupted reference), then builds layout B from other weights, loads the checkpoint and
trains the same M steps. B's losses must equal A's step by step (1e-6 relative, fp32). Every layout sees the
same global batch of 4 sequences per step, split over its data-parallel ranks, so the runs are the same
computation up to float reduction order. Each scenario returns ``{"a": A's losses, "b": B's losses}`` (or
``{"idle": True}`` on a rank outside B).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from oarlock.checkpoint import load_sharded_optimizer_state_dict, save_state_dict, sharded_optimizer_state_dict
from oarlock.checkpoint import ShardedWeight, read_metadata, sharded_state_dict
from oarlock.models.llama import Llama, LlamaConfig, tp_relayout_aoa_config
from oarlock.models.parallel import forward_backward, parallelize_llama
from oarlock.models.zero import ZeroRedundancyAdamW

warnings.filterwarnings("ignore")

# hidden 30 and vocab 101: 19890 parameters, not a multiple of 4, so the DP4 ZeRO buffer is padded and most flat
# ranges start mid-row; 4 KV heads and MLP width 44 allow TP 1, 2 and 4.
CFG = LlamaConfig(vocab_size=101, hidden_size=30, intermediate_size=44, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=4)
# eps 1e-4 rather than 1e-8: AdamW divides by sqrt(v) + eps, which would blow float noise in near-zero gradients
# (different reduction orders of TP/DP layouts) up to visible loss differences.
# 3 KV heads and MLP width 42 for TP3 (the demo's resume layout), on ranks 0-2 of the 4.
CFG3 = LlamaConfig(**{**CFG.to_dict(), "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 42})
LR, WD, EPS = 1e-2, 0.1, 1e-4
K, M, SEQS, LEN = 2, 3, 4, 12


def batch(step: int, dp: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, CFG.vocab_size, (SEQS, LEN), generator=g)
    labels = torch.randint(0, CFG.vocab_size, (SEQS, LEN), generator=g)
    n = SEQS // dp
    return ids[dp_rank * n:(dp_rank + 1) * n], labels[dp_rank * n:(dp_rank + 1) * n]


class Layout:
    """A model + optimizer in one layout; ``dp``/``dp_rank``/``dp_group``: its data-parallel split."""

    def __init__(self, kind: str, seed: int, meshes: dict, groups: dict, cfg: LlamaConfig = CFG):
        torch.manual_seed(seed)
        model = Llama(cfg)
        rank = dist.get_rank()
        self.dp, self.dp_rank, self.dp_group, self.save_group, self.load_group = 1, 0, None, None, None
        kw = dict(lr=LR, weight_decay=WD, eps=EPS)
        if kind == "dp2_zero":  # ranks {0,1} and {2,3} are two independent DP2 runs
            self.dp, self.dp_rank, self.dp_group = 2, rank % 2, groups["pair"]
            self.save_group = self.dp_group
            opt = ZeroRedundancyAdamW(model.named_parameters(), group=self.dp_group, **kw)
        elif kind == "dp4_zero":
            self.dp, self.dp_rank, self.dp_group = 4, rank, dist.group.WORLD
            opt = ZeroRedundancyAdamW(model.named_parameters(), group=self.dp_group, **kw)
        elif kind == "tp2":  # both rows of the 2x2 mesh run the same TP2 model (replicas)
            parallelize_llama(model, meshes["dp_tp"], tp=2)
            opt = torch.optim.AdamW(model.parameters(), **kw)
        elif kind == "dp2tp2_zero":
            parallelize_llama(model, meshes["dp_tp"], tp=2, dp=2)
            self.dp, self.dp_group = 2, model.parallel_state.dp_group
            self.dp_rank = meshes["dp_tp"]["dp"].get_local_rank()
            opt = ZeroRedundancyAdamW(model.named_parameters(), group=self.dp_group, **kw)
        elif kind == "tp4":
            parallelize_llama(model, meshes["tp"], tp=4)
            opt = torch.optim.AdamW(model.parameters(), **kw)
        elif kind == "tp3":  # ranks 0-2 only; ZeRO-1 wrapper without a DP group: whole TP shards as flat ranges
            parallelize_llama(model, meshes["tp3"], tp=3)
            self.load_group = groups["first3"]
            opt = ZeroRedundancyAdamW(model.named_parameters(), **kw)
        elif kind == "plain":
            opt = torch.optim.AdamW(model.parameters(), **kw)
        elif kind == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in model.layers.values():
                fully_shard(layer, mesh=meshes["dp"])
            fully_shard(model, mesh=meshes["dp"])
            self.dp, self.dp_rank, self.dp_group = 4, rank, dist.group.WORLD
            opt = torch.optim.AdamW(model.parameters(), **kw)
        else:
            raise ValueError(kind)
        self.kind, self.model, self.opt = kind, model, opt

    def step(self, step: int) -> float:
        self.opt.zero_grad()
        ids, labels = batch(step, self.dp, self.dp_rank)
        loss = forward_backward(self.model, ids, labels).detach().clone()
        self.opt.step()
        if self.dp > 1:  # the global batch's mean loss (equal-sized micro-batches)
            dist.all_reduce(loss, group=self.dp_group)
            loss /= self.dp
        return float(loss)

    def save(self, path: Path) -> None:
        msd = sharded_state_dict(self.model)
        if self.kind == "dp2tp2_zero":
            # Stage-3 style: every DP rank writes only the flat range of each (TP-sharded) parameter whose optimizer
            # state it owns, as a flattened shard; the load reassembles the parameters from these 1-D pieces.
            for name, fs in self.opt.flat_shards().items():
                sw = msd[name]
                a, b = fs.flattened_range
                msd[name] = ShardedWeight(name, sw.local_tensor.reshape(-1)[a:b], sw.local_shape, sw.global_shape,
                                          sw.global_offset, (a, b))
        save_state_dict({**msd, **sharded_optimizer_state_dict(self.opt, msd)}, path, process_group=self.save_group)

    def load(self, path: Path, aoa) -> None:
        load_sharded_optimizer_state_dict(self.opt, sharded_state_dict(self.model), path, aoa_config=aoa,
                                          load_model=True, process_group=self.load_group)


SCENARIOS = [  # (layout A, layout B, AOA statements for the load, model config)
    ("dp2_zero", "dp4_zero", None, CFG),
    ("tp2", "plain", tp_relayout_aoa_config(CFG), CFG),
    ("dp2tp2_zero", "tp4", tp_relayout_aoa_config(CFG), CFG),  # parameters saved as flattened shards too
    ("plain", "fsdp2", None, CFG),
    ("dp2_zero", "tp3", tp_relayout_aoa_config(CFG3), CFG3),  # rank 3 only trains A
]


def train_save_resume(a_kind: str, b_kind: str, aoa, cfg: LlamaConfig, root: Path, meshes: dict,
                      groups: dict) -> dict:
    rank = dist.get_rank()
    a = Layout(a_kind, 0, meshes, groups, cfg)
    losses_a = [a.step(s) for s in range(K)]
    name = f"{a_kind}-{b_kind}"
    path = root / (f"{name}.{rank // 2}" if a.save_group is not None else name)
    a.save(path)
    dist.barrier()  # the DP2 pairs save separately; B reads the pair {0, 1}'s checkpoint on every rank
    if a_kind.endswith("zero"):  # ZeRO states (and stage-3 style parameters) are stored as flattened pieces
        meta = read_metadata(path)
        keys = ["norm.weight.exp_avg"] + (["layers.1.mlp.gate_up_proj.weight"] if a_kind == "dp2tp2_zero" else [])
        for k in keys:
            assert all(s.flattened_range is not None for s in meta.tensors[k].shards), (k, meta.tensors[k].shards)
    losses_a += [a.step(s) for s in range(K, K + M)]  # the uninterrupted run
    del a
    if b_kind == "tp3" and rank == 3:
        return {"idle": True}
    b = Layout(b_kind, 1, meshes, groups, cfg)
    b.load(root / (f"{name}.0" if a_kind == "dp2_zero" else name), aoa)  # the run of ranks 0 and 1
    losses_b = [b.step(s) for s in range(K, K + M)]
    return {"a": losses_a[K:], "b": losses_b}


_SETUP: dict = {}


def _meshes_and_groups() -> tuple[dict, dict]:
    """Meshes and groups shared by the scenarios, created once per rank process (creation is collective: every
    rank reaches this in the same scenario)."""
    if not _SETUP:
        rank = dist.get_rank()
        _SETUP["meshes"] = {"dp_tp": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
                            "tp": init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)),
                            "dp": init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)),
                            "tp3": DeviceMesh("cpu", [0, 1, 2], mesh_dim_names=("tp",))}
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        _SETUP["groups"] = {"pair": pairs[rank // 2], "first3": dist.new_group([0, 1, 2])}
    return _SETUP["meshes"], _SETUP["groups"]


def _make(a_kind: str, b_kind: str, aoa, cfg: LlamaConfig):
    def run(ctx) -> dict:
        meshes, groups = _meshes_and_groups()
        out = train_save_resume(a_kind, b_kind, aoa, cfg, ctx.root, meshes, groups)
        if out.get("idle"):
            return out
        assert len(out["a"]) == len(out["b"]) == M, out
        bad = [f"step {s}: resumed {b!r}, uninterrupted {a!r} (relative {abs(b - a) / abs(a):.2e})"
               for s, (a, b) in enumerate(zip(out["a"], out["b"]), start=K)
               if not math.isclose(b, a, rel_tol=1e-6, abs_tol=0.0)]
        assert not bad, f"{a_kind} -> {b_kind}: B's losses differ from the uninterrupted run in A (rel 1e-6): " \
                        + "; ".join(bad)
        return out

    run.__doc__ = f"{a_kind} trains {K} steps, saves, trains {M} more; {b_kind} loads and trains the same {M}."
    return run


for _a, _b, _aoa, _cfg in SCENARIOS:  # one scenario per layout pair, in this order
    globals()[f"scenario_{_a}_to_{_b}"] = _make(_a, _b, _aoa, _cfg)
