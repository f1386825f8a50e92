"""Scenarios of tests/checkpoint/test_matrix.py: the FlexCheckpoint strategy-conversion matrix on 4 gloo ranks, one
scenario per pair (``scenario_<A>_to_<B>``), all in one launch of the multirank harness.

For every pair ``A->B`` of :data:`PAIRS` (docs/flexcheckpoint.md's strategy matrix; d/t/p/e/c = data, tensor,
pipeline, expert, context parallel degrees) the scenario does, on the first ``world_size`` ranks each layout needs:

1. layout A: a Llama (:data:`DENSE`, or :data:`MOE` when either side uses EP) from the reference's initial
   weights trains :data:`K` steps (ZeRO-1 AdamW over DP when ``d > 1``, else ``torch.optim.AdamW``); its losses
   must equal the single-process reference's;
2. HF export from A: ``full_state_dict`` with ``hf_export_aoa_config`` must equal ``to_hf_state_dict`` of A's
   gathered single-device weights exactly, which must equal the reference's weights (fp32 noise);
3. A saves model + optimizer (``save_state_dict`` of ``sharded_state_dict`` + ``sharded_optimizer_state_dict``);
4. layout B: a model from other weights first imports the HF directory written by ``transformers``
   (``hf_aoa_config``, strict): every parameter must equal ``convert_hf_state_dict`` of the file exactly;
5. B loads A's checkpoint (``load_sharded_optimizer_state_dict(load_model=True)``, with
   ``tp_relayout_aoa_config`` when the TP degrees differ): every parameter must equal A's exactly, and the
   next :data:`M` training steps must give the reference's losses and final weights (which they only do if
   the optimizer state came across too).

The reference is a plain single-process ``Llama`` + ``torch.optim.AdamW`` on the same global batches. Every layout
sees the same global batch of :data:`SEQS` sequences per step, split over its DP ranks.

Every rank of B must have read part of the checkpoint and of the HF files (no rank left without its keys). The
parent writes the HF directories (``hf_dense``, ``hf_moe``, by ``transformers``) into ``ctx.shared`` before the
launch; ``pytest -k d2_to_d4`` runs one pair.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from multirank import needs
from oarlock.checkpoint import (CheckpointMismatchError, full_state_dict, load_sharded_optimizer_state_dict,
                                load_state_dict, save_state_dict, sharded_optimizer_state_dict, sharded_state_dict)
from oarlock.models.llama import (Llama, LlamaConfig, causal_lm_loss, convert_hf_state_dict, hf_aoa_config,
                                  hf_export_aoa_config, to_hf_state_dict, tp_relayout_aoa_config)
from oarlock.models.parallel import (ParallelLayout, build_mesh, forward_backward, load_single_device_state_dict,
                                     parallelize_llama, single_device_state_dict)
from oarlock.models.zero import ZeroRedundancyAdamW
from testkit import st_tensors

warnings.filterwarnings("ignore")

PAIRS = ["d2->d4", "t2->t4", "p2->p4", "e2->e4", "p2->t4", "t2->p2", "d4->t2d2", "d2->p2", "d2->e2", "e2->t2",
         "t2->e2", "d2t2->t4", "d2t2->p4", "d2p2->t4", "t2p2->d4", "t2p2->d2t2", "d2e2->d4", "t2e2->t4",
         "d2t2->p2", "d2e2->t2e2",
         "c2->t2", "t2->c2", "d2c2->t2c2"]  # context parallel shards no weight: its checkpoints move like DP ones

# Vocabulary 101 (prime): TP2 and TP4 shard the embedding and lm_head unevenly (51/50, 26/25/25/25 rows).
# 4 KV heads and MLP widths 48 / 16 / 24 allow TP 1, 2, 4; 4 layers allow PP up to 4; untied embeddings (PP).
DENSE = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=4, rms_norm_eps=1e-5)
# 5 experts (not divisible by EP 2 or 4: ranks hold 3/2 and 2/1/1/1), top-2 routing, a shared expert, qkv biases:
# the Qwen2-MoE layout the test writes with transformers.
MOE = LlamaConfig(**{**DENSE.to_dict(), "qkv_bias": True, "num_experts": 5, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "norm_topk_prob": False})
# eps 1e-4: AdamW's g / (sqrt(v) + eps) would blow reduction-order noise in near-zero gradients up otherwise.
LR, WD, EPS = 1e-2, 0.1, 1e-4
K, M, SEQS, LEN = 2, 2, 4, 12  # steps before the save, steps after the load, global batch, sequence length
RTOL_LOSS, RTOL_W, ATOL_W = 1e-5, 1e-5, 1e-5  # parallel vs single-process fp32: reduction order only


def config_for(pair: str) -> tuple[str, LlamaConfig]:
    a, b = (ParallelLayout.parse(s) for s in pair.split("->"))
    return ("moe", MOE) if a.ep > 1 or b.ep > 1 else ("dense", DENSE)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: token ids, labels, document ids, each int64 ``[SEQS, LEN]`` (packed documents
    in the first row)."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, DENSE.vocab_size, (SEQS, LEN), generator=g)
    labels = torch.randint(0, DENSE.vocab_size, (SEQS, LEN), generator=g)
    cut = int(torch.randint(1, LEN - 1, (1,), generator=g))
    doc = torch.zeros(SEQS, LEN, dtype=torch.long)
    doc[0, cut:] = 1
    return ids, labels, doc


class Reference:
    """Single-process run: initial weights, per-step losses, and the weights after ``K`` and ``K + M`` steps."""

    def __init__(self, cfg: LlamaConfig):
        torch.manual_seed(0)
        model = Llama(cfg)
        self.init = {k: v.detach().clone() for k, v in model.state_dict().items()}
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS, foreach=False)
        self.losses: list[float] = []
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        for step in range(K + M):
            if step == K:
                self.weights[K] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            opt.zero_grad()
            ids, labels, doc = batch(step)
            loss = causal_lm_loss(model(ids, document_ids=doc), labels)
            loss.backward()
            opt.step()
            self.losses.append(float(loss))
        self.weights[K + M] = {k: v.detach().clone() for k, v in model.state_dict().items()}


    @staticmethod
    def keys(cfg: LlamaConfig) -> list[str]:
        with torch.device("meta"):
            return list(Llama(cfg).state_dict())


class Run:
    """A model + optimizer in ``layout`` on the ranks of ``mesh`` (this rank must be one of them)."""

    def __init__(self, layout: ParallelLayout, cfg: LlamaConfig, mesh: Any, init: dict | None, seed: int = 0):
        torch.manual_seed(seed)
        model = Llama(cfg)
        parallelize_llama(model, mesh, tp=layout.tp, dp=layout.dp, pp=layout.pp, ep=layout.ep, cp=layout.cp)
        if init is not None:
            load_single_device_state_dict(model, init)
        self.layout, self.model = layout, model
        self.dp_group = model.parallel_state.dp_group
        self.dp_rank = mesh["dp"].get_local_rank() if layout.dp > 1 else 0
        if layout.dp > 1:
            self.opt = ZeroRedundancyAdamW(model.named_parameters(), lr=LR, weight_decay=WD, eps=EPS,
                                           group=self.dp_group)
        else:
            self.opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS, foreach=False)

    def step(self, step: int) -> float:
        """One training step on this DP rank's share of the global batch; returns the global mean loss."""
        self.opt.zero_grad()
        ids, labels, doc = batch(step)
        n = SEQS // self.layout.dp
        part = slice(self.dp_rank * n, (self.dp_rank + 1) * n)
        loss = forward_backward(self.model, ids[part], labels[part], document_ids=doc[part]).clone()
        self.opt.step()
        if self.layout.dp > 1:  # equal-sized micro-batches: the global mean is the mean of the DP means
            dist.all_reduce(loss, group=self.dp_group)
            loss /= self.layout.dp
        return float(loss)

    def sharded(self) -> dict:
        return sharded_state_dict(self.model)

    def save(self, path: Path, group: Any) -> None:
        msd = self.sharded()
        save_state_dict({**msd, **sharded_optimizer_state_dict(self.opt, msd)}, path, process_group=group)

    def load(self, path: Path, group: Any, aoa: Any = None):
        return load_sharded_optimizer_state_dict(self.opt, self.sharded(), path, aoa_config=aoa, load_model=True,
                                                 process_group=group)


class Cluster:
    """Meshes and process groups for layouts on the first ``n`` ranks, created once (creation is collective)."""

    def __init__(self):
        self.world = dist.get_world_size()
        self._meshes: dict[str, Any] = {}
        self._groups = {n: (None if n == self.world else dist.new_group(list(range(n))))
                        for n in (1, 2, self.world)}

    def mesh(self, layout: ParallelLayout) -> Any:
        key = str(layout)
        if key not in self._meshes:
            self._meshes[key] = build_mesh(layout, "cpu", ranks=list(range(layout.world_size)))
        return self._meshes[key]

    def group(self, layout: ParallelLayout) -> Any:
        return self._groups[layout.world_size]

    @staticmethod
    def member(layout: ParallelLayout) -> bool:
        return dist.get_rank() < layout.world_size


# Failed checks of the current pair: collected rather than raised, so a rank that sees a wrong value still takes
# part in the remaining collectives and the launch does not hang.
FAILED: list[str] = []


def close(got: float, want: float, what: str) -> None:
    if abs(got - want) > RTOL_LOSS * abs(want):
        FAILED.append(f"{what}: {got!r}, reference {want!r} (relative {abs(got - want) / abs(want):.2e})")


def gather_weights(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Union over the world of every rank's single-device tensors (ranks outside the layout pass ``{}``)."""
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    out: dict[str, torch.Tensor] = {}
    for p in parts:
        for k, v in p.items():
            if k in out and not torch.equal(out[k], v):
                FAILED.append(f"{k}: two ranks hold different values of a replicated/gathered tensor")
            out[k] = v
    return out


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    for k, v in got.items():
        if k not in want:
            FAILED.append(f"{what}: unexpected key {k!r}")
        elif not torch.equal(v, want[k]):
            diff = (v - want[k]).abs().max() if v.shape == want[k].shape else f"shape {tuple(v.shape)}"
            FAILED.append(f"{what}: {k!r} differs (max abs {diff})")


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    if set(got) != set(want):
        FAILED.append(f"{what}: keys differ: missing {sorted(set(want) - set(got))[:5]}, extra "
                      f"{sorted(set(got) - set(want))[:5]}")
    for k in set(got) & set(want):
        try:
            torch.testing.assert_close(got[k], want[k], rtol=RTOL_W, atol=ATOL_W)
        except AssertionError as e:
            FAILED.append(f"{what} {k}: {str(e).splitlines()[-2:]}")


def convert(pair: str, root: Path, cluster: Cluster, refs: dict, hf: dict) -> dict:
    """One conversion; returns this rank's byte counts. Raises AssertionError (or the library's error)."""
    sa, sb = pair.split("->")
    la, lb = ParallelLayout.parse(sa), ParallelLayout.parse(sb)
    name, cfg = config_for(pair)
    ref: Reference = refs[name]
    mesh_a, mesh_b = cluster.mesh(la), cluster.mesh(lb)  # every rank: mesh creation is collective
    ckpt = root / pair.replace("->", "_to_")
    local: dict[str, torch.Tensor] = {}
    exported = None
    if cluster.member(la):
        a = Run(la, cfg, mesh_a, ref.init)
        for s in range(K):
            close(a.step(s), ref.losses[s], f"{sa} loss at step {s}")
        local = single_device_state_dict(a.model)
        exported = dict(full_state_dict(a.sharded(), hf_export_aoa_config(cfg), process_group=cluster.group(la)))
        a.save(ckpt, cluster.group(la))
        del a
    full_a = gather_weights(local)
    assert_close(full_a, ref.weights[K], f"{sa} weights after {K} steps vs reference")
    if exported is not None:
        want = to_hf_state_dict(full_a, cfg)
        if set(exported) != set(want):
            FAILED.append(f"HF export from {sa}: keys {sorted(set(exported) ^ set(want))[:5]} differ")
        assert_equal(exported, want, f"HF export from {sa}")
    dist.barrier()
    out = {}
    if cluster.member(lb):
        b = Run(lb, cfg, mesh_b, None, seed=1)
        g = cluster.group(lb)
        # HF import (strict: the union of the group's requests must cover every stored key)
        rep = load_state_dict(b.sharded(), hf[name]["dir"], aoa_config={"aoa_statements": hf_aoa_config(cfg)},
                              process_group=g)
        assert_equal(single_device_state_dict(b.model), hf[name]["weights"], f"HF import into {sb}")
        aoa = {"aoa_statements": tp_relayout_aoa_config(cfg)} if la.tp != lb.tp else None
        rep_ckpt = b.load(ckpt, g, aoa)
        if rep_ckpt.unexpected_keys or rep_ckpt.missing_keys:
            FAILED.append(f"{pair}: missing {rep_ckpt.missing_keys[:5]}, unexpected "
                                 f"{rep_ckpt.unexpected_keys[:5]}")
        assert_equal(single_device_state_dict(b.model), full_a, f"{sb} weights loaded from {sa}")
        for s in range(K, K + M):
            close(b.step(s), ref.losses[s], f"{sb} (resumed from {sa}) loss at step {s}")
        local = single_device_state_dict(b.model)
        out = {"ckpt_bytes_read": rep_ckpt.bytes_read, "hf_bytes_read": rep.bytes_read}
        if not (rep_ckpt.bytes_read > 0 and rep.bytes_read > 0):
            FAILED.append(f"{sb} rank {dist.get_rank()} read nothing of the checkpoint or the HF files: {out}")
    else:
        local = {}
    assert_close(gather_weights(local), ref.weights[K + M], f"{sb} weights after {K + M} steps vs reference")
    if FAILED:
        raise AssertionError("\n".join(FAILED[:20]))
    return out


def strictness(root: Path, cluster: Cluster) -> None:
    """Pipeline stage 0 of the p2 checkpoint loading *alone* (a one-rank group): strict loading refuses the
    other stage's keys as unexpected; strict=False loads its own keys and reports the rest. Strictness is
    judged over the union of the group's requests, so the same load succeeds when both stages load together."""
    ckpt = root / "p2->p4".replace("->", "_to_")
    if dist.get_rank() != 0:
        return
    assert (ckpt / "metadata.json").is_file(), f"{ckpt}: the p2->p4 scenario saved no checkpoint"
    model = Llama(DENSE)
    # stage 0's keys without a pipeline mesh: drop what stage 1 holds, as parallelize_llama would
    for key in ("2", "3"):
        model.layers.pop(key)
    model.norm = model.lm_head = None
    sd = sharded_state_dict(model)
    try:
        load_state_dict(sd, ckpt, process_group=cluster._groups[1])
    except CheckpointMismatchError as e:
        if "unexpected keys (in the checkpoint, not requested)" not in str(e) or "strict=False" not in str(e):
            raise AssertionError(f"strict stage-0 load: unclear error {e}") from None
    else:
        raise AssertionError("a strict load of stage 0 alone did not flag stage 1's keys as unexpected")
    rep = load_state_dict(sd, ckpt, process_group=cluster._groups[1], strict=False)
    assert not rep.missing_keys, rep.missing_keys
    model_keys = {k for k in rep.unexpected_keys if not k.endswith((".exp_avg", ".exp_avg_sq", ".step"))
                  and not k.startswith("optimizer.")}
    want = set(Reference.keys(DENSE)) - set(sd)  # stage 1's weights
    assert model_keys == want, (sorted(model_keys ^ want)[:5])


def hf_reference(hf_dirs: dict[str, str]) -> dict:
    out = {}
    for name, cfg in (("dense", DENSE), ("moe", MOE)):
        d = Path(hf_dirs[name])
        out[name] = {"dir": str(d), "weights": convert_hf_state_dict(st_tensors(d), cfg)}
    return out


_SETUP: dict = {}


def _setup(shared: Path) -> tuple[Cluster, dict, dict]:
    """Groups (collective: every rank builds them in the same scenario), the single-process references and the HF
    files' tensors, once per rank process."""
    if not _SETUP:
        _SETUP["cluster"] = Cluster()
        _SETUP["refs"] = {"dense": Reference(DENSE), "moe": Reference(MOE)}
        _SETUP["hf"] = hf_reference({n: str(shared / f"hf_{n}") for n in ("dense", "moe")})
    return _SETUP["cluster"], _SETUP["refs"], _SETUP["hf"]


def pair_name(pair: str) -> str:
    """``d2t2->p4`` -> ``d2t2_to_p4`` (the scenario name without ``scenario_``)."""
    return pair.replace("->", "_to_")


def _make(pair: str):
    def run(ctx) -> dict:
        cluster, refs, hf = _setup(ctx.shared)
        FAILED.clear()
        return convert(pair, ctx.shared, cluster, refs, hf)

    run.__doc__ = f"{pair}: train, export to HF, save, import HF, load, train on; against the references."
    return run


for _pair in PAIRS:
    globals()[f"scenario_{pair_name(_pair)}"] = _make(_pair)


@needs("p2_to_p4")
def scenario_strictness_is_judged_over_the_load_group(ctx):
    """Pipeline stage 0 of the p2 checkpoint loading alone: see :func:`strictness`."""
    cluster, _, _ = _setup(ctx.shared)
    strictness(ctx.shared, cluster)
