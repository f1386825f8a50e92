"""Optimizer state as sharded checkpoint entries, and exact training resume across layouts.

See ``docs/checkpoint-format.md`` (flattened shards, optimizer keys) and ``docs/aoa.md`` (AOA statements
apply to optimizer states). Every
optimizer state tensor of a parameter is saved under ``<model_key><suffix>`` with the box of the parameter's
shard in the model's sharded state dict, so it reshards like the weight itself and AOA statements written for
``<model_key>`` apply to it. States held as 1-D slices of flat buffers (ZeRO stage 1/2) are saved as
*flattened* shards exactly as they are, with no communication; the load planner reassembles them into any
requested layout (regular, TP, FSDP2, or flattened with another data-parallel degree).

Suffixes (torch state names; the Paddle names for reference):

============================  ====================  ==========================================================
suffix                        Paddle suffix         meaning
============================  ====================  ==========================================================
``.exp_avg``                  ``.moment1_0``        Adam/AdamW first moment, same box as the parameter
``.exp_avg_sq``               ``.moment2_0``        Adam/AdamW second moment
``.max_exp_avg_sq``           (none)                Adam/AdamW with ``amsgrad=True``
``.momentum_buffer``          ``.velocity_0``       SGD momentum
``.master_weight``            ``.w_0``              fp32 master copy of a low-precision parameter (ZeRO)
``.step``                     (``.beta{1,2}_pow_acc_0`` hold ``beta ** step``)  step counter, fp32 scalar
============================  ====================  ==========================================================

The optimizer's algorithm name is stored as the JSON object ``optimizer.algorithm`` and its hyper-parameters per
parameter group (with the group's model keys) as ``optimizer.param_groups``.

Supported optimizers: ``torch.optim.Adam``, ``torch.optim.AdamW``, ``torch.optim.SGD`` over plain parameters and
DTensor parameters (tensor parallel, FSDP2 ``fully_shard``), and ZeRO-1 style optimizers that expose
``flat_shards()`` (per parameter name: ``global_shape``, ``global_offset``, ``local_shape``,
``flattened_range``; optionally ``param_offset`` and ``partition_size``, see below), ``state`` (name -> {state
name: 1-D view of the flat buffers}) and ``param_groups`` with ``names`` and ``params``
(:class:`oarlock.models.zero.ZeroRedundancyAdamW`). When the flat shards also give ``param_offset`` (where the
parameter starts in its group's concatenated buffer) and ``partition_size`` (elements per data-parallel rank) and
the optimizer has a data-parallel ``group``, the states carry a
:class:`~oarlock.checkpoint.model.sharded.FlatPartition`: a save then records each state as one flat grid rule
decided on every rank alone, and its coordination does not grow with the number of ranks.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from oarlock.checkpoint.api import LoadReport, load_state_dict
from oarlock.checkpoint.errors import CheckpointError, CheckpointMismatchError
from oarlock.checkpoint.runtime.dist import DistWrapper
from oarlock.checkpoint.model.metadata import ALGORITHM_KEY, PARAM_GROUPS_KEY, STATE_SUFFIXES
from oarlock.checkpoint.model.sharded import FlatPartition, ShardedWeight, is_dtensor, to_sharded_weight
from oarlock.checkpoint.model.traversal import collect_leaves
from oarlock.checkpoint.runtime.view import gather_view
from oarlock.checkpoint.formats.opening import read_metadata

#: torch optimizer state name -> Paddle optimizer key suffix, for reference and conversions.
PADDLE_SUFFIXES = {"exp_avg": ".moment1_0", "exp_avg_sq": ".moment2_0", "momentum_buffer": ".velocity_0",
                   "master_weight": ".w_0"}

#: Hyper-parameters stored per parameter group and compared at load time (implementation switches such as
#: ``foreach``/``fused`` are not compared: they do not change the arithmetic's meaning).
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "momentum", "dampening",
                   "nesterov", "decoupled_weight_decay")


class OptimizerStateError(CheckpointError):
    """Optimizer state cannot be saved or restored: unsupported or different optimizer type, a parameter
    missing from the model's sharded state dict, or states missing for a parameter (the message names it)."""


class OptimizerHyperparameterWarning(UserWarning):
    """The checkpoint's optimizer hyper-parameters differ from the optimizer's (lists old and new values)."""


@dataclass
class _Entry:
    key: str  # model key
    group: int
    states: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class _Built:
    algorithm: str
    shards: dict[str, ShardedWeight]
    entries: list[_Entry]
    groups: list[dict[str, Any]]


# ---------------------------------------------------------------- optimizer kinds

def _flat_partition(optimizer: Any, fs: Any) -> FlatPartition | None:
    """Where a ZeRO flat shard lies in its group's evenly split buffer, when the wrapper tells (``param_offset``,
    ``partition_size`` on the flat shard, a data-parallel ``group`` on the optimizer): the save then records the
    state as one flat grid rule per key and coordinates without gathering every rank's ranges."""
    off, size, group = getattr(fs, "param_offset", None), getattr(fs, "partition_size", None), \
        getattr(optimizer, "group", None)
    if off is None or size is None or group is None:
        return None  # no data parallelism (every rank a whole copy) or a wrapper that does not say: listed
    import torch.distributed as tdist

    return FlatPartition(int(off), int(size), tdist.get_rank(group), group)


def _is_zero(optimizer: Any) -> bool:
    return callable(getattr(optimizer, "flat_shards", None)) and hasattr(optimizer, "state") \
        and hasattr(optimizer, "param_groups")


def optimizer_algorithm(optimizer: Any) -> str:
    """The algorithm name stored with the state: ``"AdamW"``, ``"Adam"`` or ``"SGD"`` (a ZeRO wrapper reports the
    algorithm it implements: its ``algorithm`` attribute, else the torch name contained in its class name).

    Raises:
        OptimizerStateError: an optimizer of another type (names it and the supported ones).
    """
    if isinstance(optimizer, torch.optim.AdamW):  # before Adam: AdamW subclasses Adam in torch >= 2.6
        return "AdamW"
    if isinstance(optimizer, torch.optim.Adam):
        return "Adam"
    if isinstance(optimizer, torch.optim.SGD):
        return "SGD"
    if _is_zero(optimizer):
        name = getattr(optimizer, "algorithm", None)
        if name:
            return str(name)
        cls = type(optimizer).__name__
        for n in ("AdamW", "Adam", "SGD"):
            if n in cls:
                return n
    raise OptimizerStateError(f"optimizer of type {type(optimizer).__name__} is not supported; supported: "
                              "torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, and ZeRO-1 wrappers with "
                              "flat_shards() (oarlock.models.zero.ZeroRedundancyAdamW)")


def _state_names(algorithm: str, group: Mapping[str, Any]) -> list[str]:
    """Tensor states (besides ``step``) a torch optimizer of ``algorithm`` keeps per parameter in ``group``."""
    if algorithm in ("Adam", "AdamW"):
        return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad") else [])
    if algorithm == "SGD":
        return ["momentum_buffer"] if group.get("momentum", 0) else []
    return []


def _has_step(algorithm: str) -> bool:
    return algorithm in ("Adam", "AdamW")


@torch.no_grad()
def _init_torch_state(algorithm: str, group: Mapping[str, Any], p: torch.Tensor, state: dict) -> None:
    """Create the lazy states torch would create at the first step (zeros; step 0), so a load has targets.

    Zero moments with step 0 are exactly a fresh Adam state. For SGD a zero momentum buffer differs from "no
    buffer" only when ``dampening != 0`` (torch seeds the buffer with the first gradient); a load overwrites it.
    """
    if _has_step(algorithm) and "step" not in state:
        fused_or_capt = group.get("fused") or group.get("capturable")
        state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if fused_or_capt
                         else torch.tensor(0.0, dtype=torch.float32))
    for name in _state_names(algorithm, group):
        if state.get(name) is None:
            state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)


# ---------------------------------------------------------------- parameter -> model key

def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if is_dtensor(t) else t


def _ident(t: torch.Tensor) -> tuple[int, tuple[int, ...]] | None:
    if t.numel() == 0:
        return None
    return (t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size(), tuple(t.shape))


def _key_index(model_sd: Mapping[str, Any]) -> dict[tuple, str]:
    """(data address, local shape) -> model key; the first key wins for tied parameters."""
    out: dict[tuple, str] = {}
    for key, sw in model_sd.items():
        t = sw.local_tensor if isinstance(sw, ShardedWeight) else _local(sw) if isinstance(sw, torch.Tensor) else None
        if t is None or (isinstance(sw, ShardedWeight) and sw.flattened_range is not None):
            continue
        ident = _ident(t)
        if ident is not None:
            out.setdefault(ident, key)
    return out


def _model_shard(model_sd: Mapping[str, Any], key: str) -> ShardedWeight:
    out = to_sharded_weight(key, model_sd[key])
    if out is None:
        raise OptimizerStateError(f"parameter {key!r}: this rank is outside the DTensor's mesh")
    return out


def _json_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    if isinstance(v, (tuple, list)):
        return [_json_value(x) for x in v]
    return v


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _json_value(group[k]) for k in HYPERPARAMETERS if k in group}


# ---------------------------------------------------------------- building the sharded state dict

def _build(optimizer: Any, model_sd: Mapping[str, Any]) -> _Built:
    algorithm = optimizer_algorithm(optimizer)
    index = _key_index(model_sd)
    shards: dict[str, ShardedWeight] = {}
    entries: list[_Entry] = []
    groups: list[dict[str, Any]] = []

    def key_of(p: torch.Tensor, where: str, name: str | None = None) -> str | None:
        ident = _ident(_local(p))
        if ident is not None and ident in index:
            return index[ident]
        if name is not None and name in model_sd:
            return name
        if ident is None:
            return None  # nothing local: this rank holds no elements of the parameter, so no state either
        raise OptimizerStateError(f"{where} (local shape {list(_local(p).shape)}) is not in model_sharded_state_dict; "
                                  "build both from the same model (oarlock.checkpoint.sharded_state_dict(model))")

    if _is_zero(optimizer):
        flat = optimizer.flat_shards()
        for gi, group in enumerate(optimizer.param_groups):
            keys = []
            for name, p in zip(group["names"], group["params"]):
                key = key_of(p, f"parameter {name!r} of param group {gi}", name) or name
                keys.append(key)
                fs = flat[name]
                sw = _model_shard(model_sd, key) if key in model_sd else None
                if sw is not None and (sw.global_shape, sw.global_offset, sw.local_shape) != \
                        (tuple(fs.global_shape), tuple(fs.global_offset), tuple(fs.local_shape)):
                    raise OptimizerStateError(f"parameter {key!r}: the optimizer's flat shard covers box offset "
                                              f"{list(fs.global_offset)} shape {list(fs.local_shape)} of "
                                              f"{list(fs.global_shape)}, the model's shard offset "
                                              f"{list(sw.global_offset)} shape {list(sw.local_shape)}")
                entry = _Entry(key, gi)
                partition = _flat_partition(optimizer, fs)
                for sname, t in optimizer.state[name].items():
                    if not isinstance(t, torch.Tensor):
                        continue
                    if t.dim() == 0:  # step counter: one replicated scalar
                        shards[f"{key}.{sname}"] = ShardedWeight.replicated(f"{key}.{sname}", t)
                    else:
                        shards[f"{key}.{sname}"] = ShardedWeight(f"{key}.{sname}", t, fs.local_shape, fs.global_shape,
                                                                 fs.global_offset, tuple(fs.flattened_range),
                                                                 flat_partition=partition)
                    entry.states[sname] = t
                entries.append(entry)
            groups.append({**_hyper(group), "params": keys})
        return _Built(algorithm, shards, entries, groups)

    for gi, group in enumerate(optimizer.param_groups):
        keys = []
        for pi, p in enumerate(group["params"]):
            key = key_of(p, f"parameter #{pi} of param group {gi}")
            if key is None:
                continue
            keys.append(key)
            sw = _model_shard(model_sd, key)
            state = optimizer.state[p]
            _init_torch_state(algorithm, group, p, state)
            entry = _Entry(key, gi)
            if _has_step(algorithm):
                step = state["step"]
                if not isinstance(step, torch.Tensor):  # old-style float step: make it loadable in place
                    step = state["step"] = torch.tensor(float(step), dtype=torch.float32)
                shards[f"{key}.step"] = ShardedWeight.replicated(f"{key}.step", step)
                entry.states["step"] = step
            for sname in _state_names(algorithm, group):
                t = state[sname]
                local = _local(t)
                if sw.flattened_range is not None or tuple(local.shape) != sw.local_shape:
                    raise OptimizerStateError(f"parameter {key!r}: optimizer state {sname!r} has local shape "
                                              f"{list(local.shape)}, the model's shard {list(sw.local_shape)}")
                shards[f"{key}.{sname}"] = ShardedWeight(f"{key}.{sname}", local, sw.local_shape, sw.global_shape,
                                                         sw.global_offset)
                entry.states[sname] = t
            entries.append(entry)
        groups.append({**_hyper(group), "params": keys})
    return _Built(algorithm, shards, entries, groups)


def sharded_optimizer_state_dict(optimizer: Any, model_sharded_state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The optimizer's state as a flat checkpoint state dict keyed by model keys plus suffixes.

    Args:
        optimizer: ``torch.optim.Adam``/``AdamW``/``SGD`` (plain or DTensor parameters: TP, FSDP2) or a ZeRO-1
            wrapper with ``flat_shards()`` (see the module docstring).
        model_sharded_state_dict: ``{key: ShardedWeight}`` of the model
            (:func:`oarlock.checkpoint.sharded_state_dict`); parameters are matched to keys by storage (tied
            parameters take the first key), ZeRO parameters by storage or by their name.

    Returns:
        ``{"<key>.exp_avg": ShardedWeight, ..., "<key>.step": ShardedWeight(0-d fp32), "optimizer.algorithm":
        str, "optimizer.param_groups": [{hyper-parameters..., "params": [model keys]}]}``. State tensors have
        the parameter's box (and dtype of the state); ZeRO states are flattened shards (1-D views of the flat
        buffers, padding excluded). The local tensors alias the optimizer's state, so
        :func:`~oarlock.checkpoint.load_state_dict` into this dict restores the optimizer in place. Lazy states
        (before the first step) are created as zeros with step 0, as torch would at the first step. Merge it
        with the model's dict and pass to :func:`~oarlock.checkpoint.save_state_dict`: no communication
        happens here.

    Raises:
        OptimizerStateError: unsupported optimizer, a parameter not in ``model_sharded_state_dict``, or a state
            whose shape disagrees with the parameter's shard (names the parameter).
    """
    b = _build(optimizer, model_sharded_state_dict)
    out: dict[str, Any] = dict(b.shards)
    out[ALGORITHM_KEY] = b.algorithm
    out[PARAM_GROUPS_KEY] = b.groups
    return out


# ---------------------------------------------------------------- load

def _owners(entries: list[_Entry]) -> dict[str, tuple[str, str]]:
    """State key -> (model key, state name)."""
    return {f"{e.key}.{s}": (e.key, s) for e in entries for s in e.states}


def _missing_message(missing: list[tuple[str, str]], algorithm: str, path: Any) -> str:
    by_param: dict[str, list[str]] = {}
    for param, state in missing:
        by_param.setdefault(param, []).append(state)
    first = ", ".join(f"{p!r} ({', '.join(s)})" for p, s in list(by_param.items())[:10])
    more = f" ... ({len(by_param) - 10} more parameters)" if len(by_param) > 10 else ""
    return (f"{path}: {algorithm} optimizer states missing for parameter {first}{more}; the checkpoint holds no "
            "such state (saved without the optimizer, by another optimizer, or for other parameters)")


def load_sharded_optimizer_state_dict(optimizer: Any, model_sharded_state_dict: Mapping[str, Any],
                                      path: str | os.PathLike, *, process_group: Any = None,
                                      aoa_config: Any = None, load_model: bool = False,
                                      restore_hyperparameters: bool = False, strict: bool = True) -> LoadReport:
    """Restore an optimizer (and, with ``load_model``, the model) from a checkpoint saved with
    :func:`sharded_optimizer_state_dict`, in whatever layout either side has. Collective over ``process_group``.

    Lazy states are created first (zeros, step 0), then every state tensor is loaded in place through
    :func:`~oarlock.checkpoint.load_state_dict` (resharding, flattened reassembly, AOA statements for model
    keys applied to their optimizer states, ``docs/aoa.md``), so the next ``optimizer.step()`` is the one the saved run
    would have taken.

    Args:
        optimizer: as for :func:`sharded_optimizer_state_dict`.
        model_sharded_state_dict: the model's ``{key: ShardedWeight}`` in the new layout.
        path: the checkpoint directory.
        aoa_config: AOA statements written for model keys (optional).
        load_model: also load the model's tensors from ``path`` in the same pass (then the model's keys must be
            in the checkpoint too).
        restore_hyperparameters: replace the optimizer's hyper-parameters (lr, betas, ...) with the saved ones;
            by default the optimizer's own values are kept. Either way a difference raises an
            :class:`OptimizerHyperparameterWarning` listing saved and current values.
        strict: raise when the checkpoint holds tensors this load does not take (over the union of every rank's
            request, as pipeline stages load together): with ``load_model``, any stored tensor not requested (a
            2-layer model never loads silently from a 30-layer checkpoint); without it, optimizer state tensors of
            parameters this optimizer does not have (the model's weights are ignored). JSON objects saved beside (a step counter) never count. Checked before anything is written
            when no ``aoa_config`` is given; with AOA, after the load.

    Returns:
        The :class:`~oarlock.checkpoint.LoadReport` (stored keys not requested, e.g. the model's when
        ``load_model`` is False, are in ``unexpected_keys``).

    Raises:
        OptimizerStateError: the checkpoint was written by another optimizer algorithm, or holds no state for
            some parameter (names the parameters and states). Checked on the stored keys before anything is
            written when no ``aoa_config`` is given; with AOA, after the load (targets may be partly written).
        CheckpointMismatchError: with ``load_model``, model keys missing from the checkpoint; under ``strict``,
            stored tensors not taken (naming them); and everything :func:`~oarlock.checkpoint.load_state_dict`
            raises.
    """
    dist = DistWrapper(process_group)
    b = _build(optimizer, model_sharded_state_dict)
    owners = _owners(b.entries)
    # the same view-aware open as model loads: with node-local disks a rank may lack metadata.json
    view = gather_view(path, dist) if dist.active else None

    def check() -> Any:
        meta = read_metadata(path, view=view, rank=dist.rank)
        saved_alg = meta.objects.get(ALGORITHM_KEY)
        if saved_alg is not None and saved_alg != b.algorithm:
            first = b.entries[0].key if b.entries else "?"
            raise OptimizerStateError(f"{path}: optimizer state was saved by {saved_alg}, this optimizer is "
                                      f"{b.algorithm}; parameter {first!r} (and every other) has no "
                                      f"{b.algorithm} state in the checkpoint")
        if aoa_config is None:
            missing = [owners[k] for k in b.shards if k not in meta.tensors]
            if missing:
                raise OptimizerStateError(_missing_message(missing, b.algorithm, path))
            if strict:
                _check_untaken([k for k in meta.tensors if k not in taken], meta, load_model, path)
        return meta

    taken: set[str] = set()
    if strict and aoa_config is None:  # judged over the union of the group's requests (pipeline stages...)
        def mine() -> list[str]:
            keys = set(b.shards)
            if load_model:
                keys.update(sw.key for sw in collect_leaves(model_sharded_state_dict).shards)
            return sorted(keys)

        taken = {k for keys in dist.gather(mine) for k in keys}
    meta = dist.run(check)
    saved_groups = meta.objects.get(PARAM_GROUPS_KEY)

    request: dict[str, Any] = dict(b.shards)
    request.update({ALGORITHM_KEY: None, PARAM_GROUPS_KEY: None})  # read, so they are not "unexpected"
    if load_model:
        for k in model_sharded_state_dict:
            if k in request:
                raise OptimizerStateError(f"model key {k!r} collides with an optimizer state key")
        request.update(model_sharded_state_dict)
    report = load_state_dict(request, path, process_group=process_group, aoa_config=aoa_config, strict=False)
    report.missing_keys = [k for k in report.missing_keys if k not in (ALGORITHM_KEY, PARAM_GROUPS_KEY)]
    missing_opt = [owners[k] for k in report.missing_keys if k in b.shards]
    if missing_opt:
        raise OptimizerStateError(_missing_message(missing_opt, b.algorithm, path))
    if load_model:
        missing_model = [k for k in report.missing_keys if k in model_sharded_state_dict]
        if missing_model:
            raise CheckpointMismatchError(f"{path}: model keys missing from the checkpoint: {missing_model[:20]}")
    if strict and aoa_config is not None:
        _check_untaken([k for k in report.unexpected_keys if k in meta.tensors], meta, load_model, path)
    _check_hyperparameters(optimizer, b, saved_groups, restore_hyperparameters, path, dist.rank)
    return report


def _check_untaken(unused: list[str], meta: Any, load_model: bool, path: Any) -> None:
    """The ``strict`` check of :func:`load_sharded_optimizer_state_dict` over ``unused`` (stored tensor keys the
    load does not take). An optimizer state counts only when no other state of its parameter was taken (AOA
    fusions take a fused parameter's moments from each part but its step counter from one)."""
    opt = meta.optimizer_state_keys()
    unused_set = set(unused)
    base_of = {k: next(k[:-len(s)] for s in STATE_SUFFIXES if k.endswith(s)) for k in opt}
    taken_bases = {base_of[k] for k in opt if k not in unused_set}
    extra = [k for k in unused if (k not in base_of and load_model) or (k in base_of and base_of[k] not in taken_bases)]
    if extra:
        what = ("tensors this model and optimizer do not take" if load_model else
                "optimizer states of parameters this optimizer does not have")
        more = f" ... ({len(extra) - 10} more)" if len(extra) > 10 else ""
        raise CheckpointMismatchError(f"{path}: the checkpoint holds {len(extra)} {what}: "
                                      f"{', '.join(repr(k) for k in extra[:10])}{more} (a different model? pass "
                                      "strict=False to load anyway)")


def _check_hyperparameters(optimizer: Any, b: _Built, saved: list[dict[str, Any]] | None, restore: bool,
                           path: Any, rank: int) -> None:
    if not saved:
        return
    diffs = []
    if len(saved) != len(b.groups):
        diffs.append(f"{len(saved)} parameter groups saved, the optimizer has {len(b.groups)}")
    for gi, (old, new) in enumerate(zip(saved, b.groups)):
        for k in HYPERPARAMETERS:
            if k in old and k in new and not _same(old[k], new[k]):
                diffs.append(f"group {gi} {k}: saved {old[k]!r}, current {new[k]!r}")
                if restore:
                    cur = optimizer.param_groups[gi][k]
                    val = tuple(old[k]) if isinstance(cur, tuple) else old[k]
                    if isinstance(cur, torch.Tensor):
                        cur.fill_(val)
                    else:
                        optimizer.param_groups[gi][k] = val
    if diffs and rank == 0:
        what = "restored the saved values" if restore else "kept the current values"
        warnings.warn(f"{path}: optimizer hyper-parameters differ from the checkpoint ({what}): " + "; ".join(diffs),
                      OptimizerHyperparameterWarning, stacklevel=3)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0) or float(a) == float(b)
        except (TypeError, ValueError):
            return False
    return a == b
