"""Parallel layouts of :class:`oarlock.models.llama.Llama`, applied from outside the model (torchtitan style).

A layout is five degrees over a device mesh with dimensions ``("pp", "dp", "cp", "ep", "tp")`` (outermost first;
a mesh lists only the dimensions whose degree exceeds 1):

* **tp** (tensor parallel, Megatron-LM, Shoeybi et al. 2019, arXiv 1909.08053): ``torch.distributed.tensor.parallel``
  column-wise on ``qkv_proj`` / ``gate_up_proj`` and row-wise on ``o_proj`` / ``down_proj``; vocabulary-parallel
  embedding (row-wise on ``embed_tokens``) and a column-wise ``lm_head`` whose logits are gathered. Parameters
  become DTensors sharded on the ``tp`` mesh dimension; norms and routers stay replicated. ``tp`` must divide the
  KV-head count (each rank holds whole KV groups of the fused ``qkv_proj``) and the MLP widths. The vocabulary
  need not be divisible (DTensor's uneven ``torch.chunk`` shards). The fused gate/up weight is re-laid out to
  the degree-``tp`` ``fused_ffn`` layout (see :mod:`oarlock.models.llama`), and the weight carries that record as
  its ``tp_layout`` attribute, so that a checkpoint saved from the model (``sharded_state_dict``) records it in
  ``extra["tp_layouts"]`` like ``oarlock convert --tp``, and a load at another degree re-lays it out. The fused
  ``qkv_proj`` rows are grouped per KV head, a layout every degree dividing the KV heads cuts alike.
* **pp** (pipeline parallel): stage ``s`` keeps a contiguous range of layers (:func:`stage_layer_range`), the first
  stage the embedding, the last the final norm and ``lm_head``; keys keep their single-device names
  (``layers.17.mlp...``). :func:`forward_backward` runs one micro-batch through the stages (send/recv).
* **ep** (expert parallel): rank ``r`` of the ``ep`` group keeps a contiguous range of experts
  (:func:`expert_range`); expert keys keep their global index. Ranks of an EP group see the same tokens and sum
  their experts' partial outputs (see :class:`oarlock.models.llama.MoE`).
* **cp** (context parallel): the sequence is split over the ``cp`` ranks by the mask-aware plan of
  :func:`oarlock.attention.plan_context_parallel` and attention runs with
  :func:`oarlock.attention.context_parallel_flashmask_attention`; parameters are replicated (CP shards no weight,
  so checkpoints move between CP and any other layout like DP ones). :func:`forward_backward` shards the batch,
  weights each rank's loss by its share of the label tokens and sums the gradients over the ``cp`` group. How
  K/V move between the ``cp`` ranks (``"ring"``, the default, or ``"allgather"``) is ``parallelize_llama``'s
  ``cp_method``, kept in ``model.parallel_state.cp_method``; it is not part of the layout notation (it changes
  no placement, and both give the same results).
* **dp** (data parallel): parameters replicated; pass ``model.parallel_state.dp_group`` to
  :class:`oarlock.models.zero.ZeroRedundancyAdamW` (ZeRO-1), which averages gradients over it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from oarlock.models.errors import ParallelLayoutError
from oarlock.utils import balanced_range
from oarlock.attention import CP_METHODS, DEFAULT_CP_METHOD, causal_document_mask_from_ids
from oarlock.models.llama import MLP, Llama, LlamaConfig, MoE, causal_lm_loss, ffn_fused_permutation

MESH_DIMS = ("pp", "dp", "cp", "ep", "tp")
_LETTERS = {"d": "dp", "t": "tp", "p": "pp", "e": "ep", "c": "cp"}


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of data (``dp``), tensor (``tp``), pipeline (``pp``), expert (``ep``) and context (``cp``)
    parallelism.

    ``str(layout)`` and :meth:`parse` use the strategy-matrix notation: ``"d2t2"``, ``"p4"``, ``"t2c2"``,
    ``"single"``.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for n in ("dp", "tp", "pp", "ep", "cp"):
            v = getattr(self, n)
            if not isinstance(v, int) or v < 1:
                raise ParallelLayoutError(f"layout degree {n}={v!r} must be a positive integer")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.ep * self.cp

    @property
    def mesh_dims(self) -> tuple[tuple[str, int], ...]:
        """``(name, degree)`` of the mesh dimensions with degree > 1, outermost first."""
        return tuple((n, getattr(self, n)) for n in MESH_DIMS if getattr(self, n) > 1)

    def __str__(self) -> str:
        s = "".join(f"{c}{getattr(self, n)}" for c, n in _LETTERS.items() if getattr(self, n) > 1)
        return s or "single"

    @classmethod
    def parse(cls, text: str) -> "ParallelLayout":
        """``"d2t2"`` -> ``ParallelLayout(dp=2, tp=2)``; ``"single"``/``"1"`` -> all ones. Letters: d, t, p, e, c."""
        t = text.strip().lower()
        if t in ("single", "1", ""):
            return cls()
        parts = re.fullmatch(r"(?:[dtpec]\d+)+", t)
        if not parts:
            raise ParallelLayoutError(f"unknown layout {text!r}: write degrees as letter+number, e.g. 'd2', 't3', "
                                      "'d2t2', 'p2e2', 't2c2' (d=data, t=tensor, p=pipeline, e=expert, c=context "
                                      "parallel) or 'single'")
        degrees: dict[str, int] = {}
        for c, n in re.findall(r"([dtpec])(\d+)", t):
            if _LETTERS[c] in degrees:
                raise ParallelLayoutError(f"layout {text!r} gives '{c}' twice")
            degrees[_LETTERS[c]] = int(n)
        return cls(**degrees)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_tp_degrees(config: LlamaConfig) -> list[int]:
    """Tensor-parallel degrees that divide the KV heads and every MLP width of ``config``."""
    widths = [config.intermediate_size]
    if config.is_moe:
        widths = [config.moe_intermediate_size] + ([config.shared_expert_intermediate_size]
                                                   if config.shared_expert_intermediate_size else [])
    return [t for t in _divisors(config.num_key_value_heads) if all(w % t == 0 for w in widths)]


def check_layout(config: LlamaConfig, layout: ParallelLayout) -> None:
    """Raise :class:`ParallelLayoutError` (naming the degree and the ones that work) if ``layout`` cannot hold
    a model of ``config``. Pure; no communication."""
    if layout.tp > 1 and layout.tp not in valid_tp_degrees(config):
        ok = ", ".join(map(str, valid_tp_degrees(config)))
        why = (f"it does not divide the {config.num_key_value_heads} KV heads (the fused qkv_proj gives each "
               "tensor-parallel rank whole KV groups: its query heads with their key and value head)"
               if config.num_key_value_heads % layout.tp else "it does not divide the MLP width")
        raise ParallelLayoutError(f"tensor-parallel degree tp={layout.tp} is impossible: {why}; degrees that work: "
                                  f"{ok}")
    if layout.pp > config.num_hidden_layers:
        raise ParallelLayoutError(f"pipeline degree pp={layout.pp} exceeds the {config.num_hidden_layers} layers; "
                                  f"degrees that work: 1..{config.num_hidden_layers}")
    if layout.pp > 1 and config.tie_word_embeddings:
        raise ParallelLayoutError(f"pipeline degree pp={layout.pp} with tied embeddings is not supported (the "
                                  "first and last stage would share embed_tokens.weight); use "
                                  "tie_word_embeddings=False or pp=1")
    if layout.ep > 1 and not config.is_moe:
        raise ParallelLayoutError(f"expert-parallel degree ep={layout.ep} needs an MoE config (num_experts > 0); "
                                  "degrees that work: 1")
    if config.is_moe and layout.ep > config.num_experts:
        raise ParallelLayoutError(f"expert-parallel degree ep={layout.ep} exceeds the {config.num_experts} experts "
                                  f"(a rank would hold none); degrees that work: 1..{config.num_experts}")


def stage_layer_range(num_layers: int, pp: int, stage: int) -> range:
    """Layers held by pipeline ``stage`` of ``pp``: contiguous, sizes differ by at most one, earlier stages larger
    (:func:`oarlock.utils.balanced_range`; ``oarlock convert --pp`` places layers by the same rule)."""
    return balanced_range(num_layers, pp, stage)


def expert_range(num_experts: int, ep: int, rank: int) -> range:
    """Global expert indices held by expert-parallel ``rank`` of ``ep``: contiguous, sizes differ by at most one
    (an expert count not divisible by ``ep`` is allowed)."""
    return balanced_range(num_experts, ep, rank)


@dataclass
class ParallelState:
    """What :func:`parallelize_llama` did to a model (``model.parallel_state``)."""

    layout: ParallelLayout
    mesh: Any = None
    pp_stage: int = 0
    layers: range = field(default_factory=lambda: range(0))
    experts: range | None = None
    groups: dict[str, Any] = field(default_factory=dict)  # process group per mesh dimension with degree > 1
    cp_method: str = DEFAULT_CP_METHOD  # "ring" or "allgather": context-parallel attention's K/V exchange

    @property
    def dp_group(self) -> Any:
        return self.groups.get("dp")

    @property
    def cp_group(self) -> Any:
        return self.groups.get("cp")


def build_mesh(layout: ParallelLayout, device_type: str | None = None, *, ranks: Sequence[int] | None = None):
    """A ``DeviceMesh`` with the layout's dimensions (degree > 1) named as in :data:`MESH_DIMS`.

    ``ranks``: the global ranks forming the mesh, in row-major mesh order (default: the whole world, which must
    then have ``layout.world_size`` ranks). A subset lets one launch run layouts of different sizes; every rank
    of the world must still call this (creating process groups is collective), and ranks outside the mesh must
    not use it. ``device_type`` defaults to ``"cuda"`` when available, else ``"cpu"``. Returns ``None`` for a
    single-device layout.
    """
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    dims = layout.mesh_dims
    if not dims:
        return None
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    shape, names = tuple(d for _, d in dims), tuple(n for n, _ in dims)
    if ranks is None:
        if dist.get_world_size() != layout.world_size:
            raise ParallelLayoutError(f"layout {layout} needs {layout.world_size} ranks, the process group has "
                                      f"{dist.get_world_size()}; pass ranks=[...] to use a subset")
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    ranks = list(ranks)
    if len(ranks) != layout.world_size or len(set(ranks)) != len(ranks):
        raise ParallelLayoutError(f"layout {layout} needs {layout.world_size} distinct ranks, got ranks={ranks}")
    return DeviceMesh(device_type, torch.tensor(ranks).view(shape), mesh_dim_names=names)


def _mlps(model: Llama) -> list[tuple[str, MLP]]:
    """(qualified name, module) of every SwiGLU block: dense MLPs, experts, shared experts."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MLP)]


def parallelize_llama(model: Llama, mesh: Any = None, *, tp: int = 1, dp: int = 1, pp: int = 1,
                      ep: int = 1, cp: int = 1, cp_method: str | None = None) -> Llama:
    """Apply a parallel layout to ``model`` in place and return it (with ``model.parallel_state`` set).

    ``mesh``: a ``DeviceMesh`` whose dimension names include every degree > 1 (``"pp"``, ``"dp"``, ``"cp"``,
    ``"ep"``, ``"tp"``; :func:`build_mesh`), each of that size. ``cp`` changes no parameter (it records the
    context-parallel group that :func:`forward_backward` splits the sequence over). ``cp_method``: how
    context-parallel attention moves K/V, ``"ring"`` or ``"allgather"`` (None: the attention's default,
    :data:`oarlock.attention.DEFAULT_CP_METHOD`, the ring; see ``docs/flashmask.md``, "Context parallelism");
    kept in ``model.parallel_state.cp_method``, which :meth:`Llama.forward` uses. Every rank must start from the
    same single-device weights (same seed or the same loaded state dict); they are then pruned (pp, ep) and sharded
    (tp). Create the optimizer afterwards. Raises :class:`ParallelLayoutError` for impossible degrees (listing those
    that work), an unknown ``cp_method``, or a mesh that does not match them.
    """
    layout = ParallelLayout(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp)
    cfg = model.config
    check_layout(cfg, layout)
    cp_method = DEFAULT_CP_METHOD if cp_method is None else cp_method
    if cp_method not in CP_METHODS:
        raise ParallelLayoutError(f"cp_method={cp_method!r} is unknown; use one of {', '.join(CP_METHODS)}")
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if mesh is not None and mesh.get_coordinate() is None:
        raise ParallelLayoutError(f"rank {dist.get_rank()} is not in the mesh {mesh.mesh.tolist()} given to "
                                  "parallelize_llama")
    groups: dict[str, Any] = {}
    sub: dict[str, Any] = {}
    for n, degree in layout.mesh_dims:
        if n not in names:
            raise ParallelLayoutError(f"layout {layout} needs a mesh dimension named {n!r}; the mesh has "
                                      f"{list(names) or 'none'} (build it with oarlock.models.parallel.build_mesh)")
        if mesh[n].size() != degree:
            raise ParallelLayoutError(f"mesh dimension {n!r} has size {mesh[n].size()}, the layout asks {n}={degree}")
        sub[n] = mesh[n]
        groups[n] = mesh[n].get_group()
    local = {n: (sub[n].get_local_rank() if n in sub else 0) for n in MESH_DIMS}

    # Pipeline: keep this stage's layers; embedding on the first stage, norm and head on the last.
    stage = local["pp"]
    layers = stage_layer_range(cfg.num_hidden_layers, pp, stage)
    for key in list(model.layers.keys()):
        if int(key) not in layers:
            model.layers.pop(key)
    if stage > 0:
        model.embed_tokens = None
    if stage < pp - 1:
        model.norm = None
        model.lm_head = None

    # Expert parallel: keep this rank's experts (global indices), sum partial outputs over the EP group.
    experts = None
    if cfg.is_moe:
        experts = expert_range(cfg.num_experts, ep, local["ep"])
        for layer in model.layers.values():
            moe: MoE = layer.mlp
            for key in list(moe.experts.keys()):
                if int(key) not in experts:
                    moe.experts.pop(key)
            moe.ep_group = groups.get("ep")

    if tp > 1:
        _apply_tensor_parallel(model, sub["tp"])
    model.parallel_state = ParallelState(layout=layout, mesh=mesh, pp_stage=stage, layers=layers, experts=experts,
                                         groups=groups, cp_method=cp_method)
    return model


def _apply_tensor_parallel(model: Llama, tp_mesh: Any) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from oarlock.checkpoint.model.sharded import TP_LAYOUT_ATTR

    tp = tp_mesh.size()
    with torch.no_grad():  # degree-tp fused_ffn layout so each rank's contiguous shard is [gate_r | up_r]
        for _, mlp in _mlps(model):
            w = mlp.gate_up_proj.weight
            w.copy_(w[ffn_fused_permutation(w.shape[0] // 2, tp).to(w.device)])
    plan: dict[str, Any] = {}
    if model.embed_tokens is not None:
        plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if model.lm_head is not None:
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    for key in model.layers:
        plan[f"layers.{key}.self_attn.qkv_proj"] = ColwiseParallel()
        plan[f"layers.{key}.self_attn.o_proj"] = RowwiseParallel()
    for name, _ in _mlps(model):
        plan[f"{name}.gate_up_proj"] = ColwiseParallel()
        plan[f"{name}.down_proj"] = RowwiseParallel()
    parallelize_module(model, tp_mesh, plan)
    for _, mlp in _mlps(model):  # saves record it (metadata extra["tp_layouts"]): a load at another TP re-lays out
        setattr(mlp.gate_up_proj.weight, TP_LAYOUT_ATTR, {"statement": "fused_ffn", "tp": tp, "axis": 0})
    if model.config.tie_word_embeddings and model.embed_tokens is not None and model.lm_head is not None:
        model.lm_head.weight = model.embed_tokens.weight  # both Shard(0) over the vocabulary: re-tie


# ----------------------------------------------------------------------------------------------------------------
# Moving between the single-device layout and a parallel model (tests, strategy harness, demo).
def _tp_degree(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(t, DTensor) and any(isinstance(p, Shard) for p in t.placements):
        return t.device_mesh.size()
    return 1


def _is_gate_up(name: str) -> bool:
    return name.endswith("gate_up_proj.weight")


def single_device_tensor(name: str, t: torch.Tensor) -> torch.Tensor:
    """The single-device value of parameter (or gradient) ``name`` from this rank's ``t``: a DTensor is gathered
    (collective over its mesh) and a tensor-parallel ``gate_up_proj`` goes back to the ``[gate | up]`` layout."""
    from torch.distributed.tensor import DTensor

    tp = _tp_degree(t)
    full = t.full_tensor() if isinstance(t, DTensor) else t
    if tp > 1 and _is_gate_up(name):
        perm = ffn_fused_permutation(full.shape[0] // 2, tp).to(full.device)
        full = full[torch.argsort(perm)]
    return full.detach()


def single_device_state_dict(model: Llama) -> dict[str, torch.Tensor]:
    """This rank's keys (its stage's layers, its experts) as single-device tensors. Collective over ``tp``."""
    return {k: single_device_tensor(k, v) for k, v in model.state_dict().items()}


def single_device_grads(model: Llama) -> dict[str, torch.Tensor]:
    """This rank's parameter gradients in the single-device layout (``None`` grads omitted). Collective over tp."""
    return {n: single_device_tensor(n, p.grad) for n, p in model.named_parameters() if p.grad is not None}


@torch.no_grad()
def load_single_device_state_dict(model: Llama, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy single-device tensors into a (possibly parallel) model: each rank takes the keys it holds and, for
    DTensors, its shard (after the degree-``tp`` ``fused_ffn`` re-layout). Raises :class:`ParallelLayoutError`
    naming a missing key or a shape mismatch. No communication."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for name, t in model.state_dict(keep_vars=True).items():
        if name not in state_dict:
            raise ParallelLayoutError(f"load_single_device_state_dict: key {name!r} is missing from the state dict")
        full = state_dict[name]
        if tuple(full.shape) != tuple(t.shape):
            raise ParallelLayoutError(f"load_single_device_state_dict: {name!r} has shape {tuple(full.shape)}, "
                                      f"the model expects {tuple(t.shape)}")
        tp = _tp_degree(t)
        if tp > 1 and _is_gate_up(name):
            full = full[ffn_fused_permutation(full.shape[0] // 2, tp)]
        if isinstance(t, DTensor):
            shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            box = tuple(slice(o, o + s) for o, s in zip(offset, shape))
            t._local_tensor.copy_(full[box])
        else:
            t.copy_(full)


# ----------------------------------------------------------------------------------------------------------------
# Running a layout.
def context_parallel_plan(model: Llama, input_ids: torch.Tensor, *,
                          document_ids: torch.Tensor | None = None) -> Any:
    """The mask-aware context-parallel plan of a global ``[B, S]`` batch for ``model``'s ``cp`` degree (None when
    ``cp == 1``): causal document mask from ``document_ids`` (plain causal without), ``2 * cp`` chunks when ``S``
    allows it (else ``cp``), balanced by live tiles. Raises :class:`ParallelLayoutError` if ``S`` is not a
    multiple of ``cp``."""
    from oarlock.attention import plan_context_parallel

    state: ParallelState | None = getattr(model, "parallel_state", None)
    if state is None or state.layout.cp == 1:
        return None
    cp = state.layout.cp
    s = input_ids.shape[1]
    if s % cp:
        raise ParallelLayoutError(f"context-parallel degree cp={cp} needs a sequence length divisible by it, got {s}")
    chunks = 2 * cp if s % (2 * cp) == 0 else cp
    size = s // chunks
    idx = causal_document_mask_from_ids(document_ids) if document_ids is not None else None
    return plan_context_parallel(idx, causal=True, world_size=cp, chunk_size=size, block_size=size, seqlen_q=s)


def sum_gradients(model: Llama, group: Any) -> None:
    """All-reduce (sum) every parameter gradient over ``group`` in one collective per dtype (DTensor gradients:
    their local shards, which the ranks of a context-parallel group hold alike)."""
    from torch.distributed.tensor import DTensor

    local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
             for p in model.parameters() if p.grad is not None]
    for dtype in sorted({g.dtype for g in local}, key=str):
        part = [g for g in local if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in part])
        dist.all_reduce(flat, group=group)
        off = 0
        for g in part:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()


def forward_backward(model: Llama, input_ids: torch.Tensor, labels: torch.Tensor, *,
                     document_ids: torch.Tensor | None = None,
                     loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = causal_lm_loss) -> torch.Tensor:
    """Forward and backward of one micro-batch in any layout; returns the loss (fp32 scalar, detached) on every
    rank of the pipeline group.

    ``input_ids``/``labels``/``document_ids``: ``[B, S]``, the same on every rank of a tp/pp/ep/cp group (each dp
    rank its own). Pipeline stages exchange activations ``[B, S, hidden]`` and their gradients with point-to-point
    send/recv (one micro-batch, no interleaving: a correctness schedule, not a fast one). With ``cp > 1`` each
    rank runs its tokens of the plan (:func:`context_parallel_plan`), its loss is weighted by its share of the
    label tokens (``labels != -100``; ``loss_fn`` must be a mean over those) and gradients and loss are summed
    over the ``cp`` group, so the result equals the single-process step (with either ``cp_method``).
    """
    state: ParallelState | None = getattr(model, "parallel_state", None)
    plan = context_parallel_plan(model, input_ids, document_ids=document_ids)
    kwargs: dict[str, Any] = {"document_ids": document_ids}
    weight = 1.0
    if plan is not None:
        cp_group = state.cp_group
        rank = dist.get_rank(cp_group)
        kwargs.update(cp_plan=plan, cp_group=cp_group, cp_method=state.cp_method)
        total = int((labels != -100).sum())
        input_ids = plan.shard(input_ids, rank)
        labels = plan.shard(labels, rank)
        weight = int((labels != -100).sum()) / max(total, 1)

    def local_loss(logits: torch.Tensor) -> torch.Tensor:
        if weight == 0.0:  # no label token here: a zero that keeps the graph (and the collectives) intact
            return logits.sum() * 0.0
        return loss_fn(logits, labels) * weight

    def finish(result: torch.Tensor) -> torch.Tensor:
        if plan is not None:
            sum_gradients(model, state.cp_group)
            dist.all_reduce(result, group=state.cp_group)
        return result

    if state is None or state.layout.pp == 1:
        loss = local_loss(model(input_ids, **kwargs))
        loss.backward()
        return finish(loss.detach().to(torch.float32).clone())
    group, stage, last = state.groups["pp"], state.pp_stage, state.layout.pp - 1
    param = next(model.parameters())
    b, s = input_ids.shape
    if stage == 0:
        x = input_ids
    else:
        x = torch.empty(b, s, model.config.hidden_size, dtype=param.dtype, device=param.device)
        dist.recv(x, src=dist.get_global_rank(group, stage - 1), group=group)
        x.requires_grad_(True)
    out = model(x, **kwargs)
    if stage == last:
        loss = local_loss(out)
        loss.backward()
        result = loss.detach().to(torch.float32)
    else:
        dist.send(out.detach().contiguous(), dst=dist.get_global_rank(group, stage + 1), group=group)
        grad = torch.empty_like(out)
        dist.recv(grad, src=dist.get_global_rank(group, stage + 1), group=group)
        out.backward(grad)
        result = torch.zeros((), dtype=torch.float32, device=param.device)
    if stage > 0:
        dist.send(x.grad.contiguous(), dst=dist.get_global_rank(group, stage - 1), group=group)
    result = finish(result.clone())
    dist.broadcast(result, src=dist.get_global_rank(group, last), group=group)
    return result
