"""A minimal ZeRO stage-1 AdamW: parameters replicated, optimizer states partitioned over data-parallel ranks.

ZeRO stage 1 (Rajbhandari et al. 2020, arXiv 1910.02054): every data-parallel (DP) rank holds all parameters
and computes gradients on its own micro-batch; gradients are averaged over the DP group; the AdamW states (fp32
master weights, first and second moments) are partitioned: all parameters of a parameter group are concatenated
into one flat fp32 buffer, padded to a multiple of the DP degree, and rank ``r`` owns the ``r``-th equal slice.
Each rank updates its slice and the slices are all-gathered back into the parameters. The update is AdamW
(Loshchilov & Hutter 2019, arXiv 1711.05101) exactly as ``torch.optim.AdamW`` documents it.

For checkpoints, each parameter's owned part is a *flattened shard* (``docs/checkpoint-format.md``):
:meth:`ZeroRedundancyAdamW.flat_shards` gives, per parameter name, the box the rank's local tensor covers
(``global_offset``, ``local_shape``; the whole parameter for a plain tensor, the tensor-parallel shard for a
DTensor) and the ``flattened_range`` ``(start, stop)`` of the row-major flattening of that box that the rank's
state holds. :attr:`ZeroRedundancyAdamW.state` maps each name to 1-D views of the flat buffers, so a checkpoint
load can write into them in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist

from oarlock.models.errors import ModelError


@dataclass(frozen=True)
class FlatShard:
    """The part of one parameter's optimizer state that a DP rank owns.

    ``global_shape``/``global_offset``/``local_shape``: the box of the rank's local parameter tensor inside the
    global parameter (``global_offset`` all zeros and ``local_shape == global_shape`` unless tensor parallel).
    ``flattened_range``: ``(start, stop)`` in the row-major flattening of ``local_shape`` (``start == stop`` when the
    rank owns nothing of it). ``buffer_offset``: where that range starts in the rank's flat state buffers.
    ``param_offset``: where the box's flattening starts in the group's concatenated (unpartitioned) buffer;
    ``partition_size``: elements each DP rank owns of that buffer (rank ``r`` owns ``[r * size, (r + 1) * size)``).
    """

    name: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    flattened_range: tuple[int, int]
    buffer_offset: int
    param_offset: int | None = None
    partition_size: int | None = None

    @property
    def numel(self) -> int:
        return self.flattened_range[1] - self.flattened_range[0]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a DTensor (an alias, so in-place writes reach the parameter), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _like_param(grad: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient in its parameter's placements (a vocabulary-parallel embedding's gradient can come back
    replicated or partial)."""
    from torch.distributed.tensor import DTensor

    if isinstance(grad, DTensor) and isinstance(p, DTensor) and grad.placements != p.placements:
        return grad.redistribute(p.device_mesh, p.placements)
    return grad


def _box(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(global_shape, global_offset, local_shape) of a parameter (DTensor or plain)."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return tuple(p.shape), tuple(offset), tuple(shape)
    return tuple(p.shape), (0,) * p.dim(), tuple(p.shape)


class ZeroRedundancyAdamW:
    """AdamW with ZeRO-1 state partitioning over a data-parallel process group.

    Args:
        params: ``(name, parameter)`` pairs (``model.named_parameters()``), or a list of dicts ``{"params":
            [(name, p), ...], "lr": ..., "weight_decay": ...}`` as parameter groups. Bare tensors
            (``model.parameters()``) are accepted and named by their position (``"0"``, ``"1"``, ...); checkpoint
            keys still come from the model's state dict, matched by storage. DTensor parameters (tensor
            parallel) are handled through their local shards.
        lr, betas, eps, weight_decay: AdamW hyper-parameters (defaults of ``torch.optim.AdamW``).
        group: the data-parallel process group (``model.parallel_state.dp_group``, or ``dist.group.WORLD``);
            ``None`` means no data parallelism (degree 1, no communication).

    Call ``step()`` after ``backward()`` on every DP rank: it averages the gradients over ``group`` (one
    ``all_reduce`` per parameter group), updates this rank's slice, and all-gathers the parameters.
    Raises :class:`ModelError` on duplicate names or bad hyper-parameters.
    """

    def __init__(self, params: Iterable[Any], *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, group: Any = None):
        if not 0.0 <= lr or not 0.0 <= eps or not all(0.0 <= b < 1.0 for b in betas) or weight_decay < 0:
            raise ModelError(f"ZeroRedundancyAdamW: invalid hyper-parameters lr={lr} betas={betas} eps={eps} "
                             f"weight_decay={weight_decay}")
        self.group = group
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        items = list(params)
        raw_groups = items if items and isinstance(items[0], Mapping) else [{"params": items}]
        self.param_groups: list[dict[str, Any]] = []
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self._shards: dict[str, FlatShard] = {}
        seen: set[str] = set()
        for gi, raw in enumerate(raw_groups):
            named = [(str(i), x) if isinstance(x, torch.Tensor) else tuple(x) for i, x in enumerate(raw["params"])]
            for name, _ in named:
                if name in seen:
                    raise ModelError(f"ZeroRedundancyAdamW: parameter {name!r} appears twice")
                seen.add(name)
            g = {**defaults, **{k: v for k, v in raw.items() if k != "params"}}
            g["names"] = [n for n, _ in named]
            g["params"] = [p for _, p in named]
            self.param_groups.append(g)
            self._build_group(g)

    # ---- layout -------------------------------------------------------------------------------------------
    def _build_group(self, g: dict[str, Any]) -> None:
        for name, p in zip(g["names"], g["params"]):
            if (p.dtype, p.device) != (g["params"][0].dtype, g["params"][0].device):
                raise ModelError(f"ZeroRedundancyAdamW: parameter {name!r} is {p.dtype} on {p.device}, the group's "
                                 f"first is {g['params'][0].dtype} on {g['params'][0].device}; use one parameter "
                                 "group per dtype/device")
        sizes = [_local(p).numel() for p in g["params"]]
        total = sum(sizes)
        per_rank = max(1, math.ceil(total / self.world_size))  # padded length owned by every rank
        lo, hi = self.rank * per_rank, (self.rank + 1) * per_rank
        device = g["params"][0].device if g["params"] else torch.device("cpu")
        master = torch.zeros(per_rank, dtype=torch.float32, device=device)
        g.update(offsets=[], numel=total, per_rank=per_rank, master=master,
                 exp_avg=torch.zeros_like(master), exp_avg_sq=torch.zeros_like(master),
                 step=torch.zeros((), dtype=torch.float32))
        off = 0
        for name, p, n in zip(g["names"], g["params"], sizes):
            g["offsets"].append(off)
            start, stop = min(max(lo - off, 0), n), min(max(hi - off, 0), n)
            buf = off + start - lo if stop > start else 0
            gshape, goff, lshape = _box(p)
            self._shards[name] = FlatShard(name, gshape, goff, lshape, (start, stop), buf, off, per_rank)
            if stop > start:
                master[buf:buf + stop - start] = _local(p).detach().reshape(-1)[start:stop].to(torch.float32)
            sl = slice(buf, buf + stop - start)
            self.state[name] = {"step": g["step"], "exp_avg": g["exp_avg"][sl], "exp_avg_sq": g["exp_avg_sq"][sl]}
            if p.dtype != torch.float32:  # the fp32 master copy is state only when it carries extra precision
                self.state[name]["master_weight"] = master[sl]
            off += n

    def flat_shards(self) -> dict[str, FlatShard]:
        """Per parameter name, the flattened range of its optimizer state this rank owns (see :class:`FlatShard`)."""
        return dict(self._shards)

    # ---- training -----------------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW step on this rank's slice, then all-gather the parameters (collective over ``group``)."""
        for g in self.param_groups:
            if not g["params"]:
                continue
            per_rank, world = g["per_rank"], self.world_size
            flat = torch.zeros(per_rank * world, dtype=torch.float32, device=g["master"].device)
            for name, p, off in zip(g["names"], g["params"], g["offsets"]):
                if p.grad is not None:
                    grad = _local(_like_param(p.grad, p))
                    if grad.shape != _local(p).shape:
                        raise ModelError(f"ZeroRedundancyAdamW: gradient of {name!r} has local shape "
                                         f"{tuple(grad.shape)}, the parameter {tuple(_local(p).shape)}")
                    flat[off:off + grad.numel()] = grad.reshape(-1)
            if world > 1:
                dist.all_reduce(flat, group=self.group)
            grad = flat[self.rank * per_rank:(self.rank + 1) * per_rank]
            if world > 1:
                grad /= world  # the average, on this rank's slice only
            if g["params"][0].dtype == torch.float32:
                self._refresh_master(g)  # fp32 parameters are the master copy (they may have been loaded since)
            self._adamw(g, grad)
            # All-gather the updated slices in the parameters' dtype and copy them back.
            dtype = g["params"][0].dtype
            full = torch.empty(per_rank * world, dtype=dtype, device=flat.device)
            if world > 1:
                dist.all_gather(list(full.chunk(world)), g["master"].to(dtype), group=self.group)
            else:
                full.copy_(g["master"])
            for p, off in zip(g["params"], g["offsets"]):
                local = _local(p)
                local.copy_(full[off:off + local.numel()].view_as(local))

    def _refresh_master(self, g: dict[str, Any]) -> None:
        for name, p in zip(g["names"], g["params"]):
            sh = self._shards[name]
            if sh.numel:
                g["master"][sh.buffer_offset:sh.buffer_offset + sh.numel] = \
                    _local(p).reshape(-1)[sh.flattened_range[0]:sh.flattened_range[1]]

    @staticmethod
    def _adamw(g: dict[str, Any], grad: torch.Tensor) -> None:
        # torch.optim.AdamW's documented update, in the same operation order as its single-tensor path.
        lr, (beta1, beta2), eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
        g["step"] += 1
        step = g["step"].item()
        param, exp_avg, exp_avg_sq = g["master"], g["exp_avg"], g["exp_avg_sq"]
        param.mul_(1 - lr * wd)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)

    # ---- local (per-rank) persistence -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's flat buffers, steps and hyper-parameters (a per-rank snapshot; FlexCheckpoint uses
        :attr:`state` and :meth:`flat_shards` instead)."""
        return {"world_size": self.world_size, "rank": self.rank, "param_groups": [
            {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items()
             if k in ("lr", "betas", "eps", "weight_decay", "names", "numel", "per_rank", "master", "exp_avg",
                      "exp_avg_sq", "step")} for g in self.param_groups]}

    @torch.no_grad()
    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` of the same rank and layout; raises :class:`ModelError` on a mismatch."""
        if sd.get("world_size") != self.world_size or len(sd["param_groups"]) != len(self.param_groups):
            raise ModelError(f"ZeroRedundancyAdamW.load_state_dict: saved for DP degree {sd.get('world_size')} with "
                             f"{len(sd['param_groups'])} groups, this optimizer has {self.world_size} and "
                             f"{len(self.param_groups)}")
        for g, s in zip(self.param_groups, sd["param_groups"]):
            if s["names"] != g["names"] or s["per_rank"] != g["per_rank"]:
                raise ModelError("ZeroRedundancyAdamW.load_state_dict: parameter names or sizes differ from the "
                                 "saved ones")
            for k in ("master", "exp_avg", "exp_avg_sq", "step"):
                g[k].copy_(s[k])
            for k in ("lr", "betas", "eps", "weight_decay"):
                g[k] = s[k]
