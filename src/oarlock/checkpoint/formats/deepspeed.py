"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3), read as the fp32 master weights and Adam moments of each
parameter, resharded to any layout without DeepSpeed.

On disk (DeepSpeed 0.x ``engine.save_checkpoint(dir, tag)``; see ``docs/foreign-formats.md``): ``dir/latest``
names the tag; ``dir/<tag>/`` holds

* ``mp_rank_00_model_states.pt`` (stages 1/2) or ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` (stage 3):
  ``param_shapes`` (one ordered ``{name: shape}`` per optimizer parameter group), ``buffer_names``, ``module``
  (buffers, and for stages 1/2 the full weights in training dtype), ``shared_params`` (tied names);
* ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt``: ``optimizer_state_dict`` with, per group ``g``, this rank's
  flat fp32 partition and the matching flat moments (``base_optimizer_state`` / ``optimizer_state_dict``
  ``["state"][g]``: ``exp_avg``, ``exp_avg_sq``, ``step``):

  - stages 1/2 (``single_partition_of_fp32_groups``): the group's parameters are flattened in ``param_shapes``
    order (each followed by ``param_alignment_paddings[g][i]`` pad elements) into one buffer padded at the end
    (``group_paddings``) to a multiple of the data-parallel degree; rank ``r`` holds elements
    ``[r * P, r * P + len)`` with ``P`` the partition size (rank 0's length);
  - stage 3 (``fp32_flat_groups``): every parameter is partitioned on its own: with ``n`` elements and degree
    ``W`` each rank holds ``ceil(n / W)`` slots (``[r * ps, min((r + 1) * ps, n))`` of the parameter, then
    padding); a rank's flat group buffer is the concatenation of its slots in ``param_shapes`` order.

Keys: ``<param name>`` (fp32 master weight), ``optim.state.<param name>.exp_avg`` / ``.exp_avg_sq`` (flattened
shards of the rank partitions) and ``.step`` (a float32 scalar: a tensor in the file, or a Python int, as
DeepSpeed's own ``FusedAdam`` keeps it); :func:`deepspeed_targets` builds load targets with these keys; buffers under their names; ``optim.param_groups`` and the engine's
scalars (``global_steps``, ``ds_version``, ...) as values. Each data-file shard is a *flattened* shard, so any
target layout (another data-parallel degree included) reads only the partition bytes it needs. The
``optim.state.*`` keys are marked as optimizer state (``metadata.optimizer_keys``: ``oarlock convert --to hf``
leaves them out unless asked to keep them) and the values as training-run records (``metadata.non_model_keys``);
a ``model_only`` load ignores both.

Safety: the ``.pt`` files are ``torch.save`` archives loaded with ``torch.load(weights_only=True, mmap=True)``;
DeepSpeed's own classes in them (``LossScaler``, ``ZeroStageEnum``, ``fragment_address``) are admitted as inert
local stand-ins, everything else is refused by torch's weights-only unpickler and nothing runs.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from oarlock.checkpoint.errors import CheckpointFormatError
from oarlock.checkpoint.model.metadata import CheckpointMetadata, ShardMeta, TensorMeta
from oarlock.checkpoint.formats.reader import (CheckpointReader, box_of_stored, checkpoint_file, load_weights_only,
                                               register_format)
from oarlock.checkpoint.storage import open_read
from oarlock.checkpoint.storage.files import list_names, local_path
from oarlock.utils import dtype_name

OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
MOMENTS = ("exp_avg", "exp_avg_sq")


class DeepSpeedRecord:
    """Inert stand-in for a pickled DeepSpeed object (``LossScaler``, ``DynamicLossScaler``): its attribute dict."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)


def _enum_value(value: Any) -> int:
    """Stand-in for ``ZeroStageEnum(value)``."""
    if type(value) is not int:
        raise CheckpointFormatError(f"ZeroStageEnum with a non-integer value {value!r}")
    return value


class DeepSpeedFragment(tuple):
    """Stand-in for the namedtuple ``fragment_address(numel, start)`` (pickled as ``cls.__new__(cls, *args)``)."""

    def __new__(cls, *args: Any) -> "DeepSpeedFragment":
        if not all(type(a) is int for a in args):
            raise CheckpointFormatError(f"fragment_address with non-integer fields {args!r}")
        return super().__new__(cls, args)


_SAFE = [(DeepSpeedRecord, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
         (DeepSpeedRecord, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
         (_enum_value, "deepspeed.runtime.zero.config.ZeroStageEnum"),
         (DeepSpeedFragment, "deepspeed.utils.tensor_fragment.fragment_address")]


def load_pt(path: Path) -> Any:
    """``torch.load(path, weights_only=True, mmap=True)`` with DeepSpeed's classes as inert stand-ins (memory-mapped
    where the store keeps local files; an object in a store is read whole through the storage layer).

    Raises:
        CheckpointFormatError: missing, truncated or refused file (naming it and torch's reason).
    """
    if not path.is_file():
        raise CheckpointFormatError(f"{path}: DeepSpeed checkpoint file is missing")
    what = "weights-only loadable DeepSpeed file"
    mapped = local_path(path)
    if mapped is not None:
        return load_weights_only(mapped, path, what, safe_globals=_SAFE, mmap=True)
    with open_read(path) as f:
        return load_weights_only(f, path, what, safe_globals=_SAFE)


def tag_directory(path: Path) -> Path | None:
    """The directory holding the ``*_states.pt`` files: ``path`` itself, or ``path/<tag>`` with the tag read from
    ``path/latest``; None when neither holds DeepSpeed files.

    Raises:
        CheckpointFormatError: ``latest`` names a tag directory outside ``path`` (an absolute path, a ``..``
            component or a symlink out): nothing in it is listed or opened.
    """
    def has_files(d: Path) -> bool:
        try:
            return any(OPTIM_FILE.match(n) or MODEL_FILE.match(n) for n in list_names(d))
        except OSError:
            return False

    if has_files(path):
        return path
    latest = path / "latest"
    if latest.is_file():
        try:
            tag = checkpoint_file(path, "latest", "latest").read_text().strip()
        except (OSError, UnicodeDecodeError, CheckpointFormatError):
            return None
        if tag:  # an absolute path, ".." or a symlink out is refused naming the file
            d = checkpoint_file(path, tag, f"{latest}: tag directory")
            if has_files(d):
                return d
    return None


def _shape(s: Any, where: str) -> tuple[int, ...]:
    """A parameter shape from ``param_shapes``: a sequence of non-negative ints (``torch.Size``), else an error."""
    if not isinstance(s, (tuple, list)) or not all(type(x) is int and x >= 0 for x in s):
        raise CheckpointFormatError(f"{where} has shape {s!r}; expected a list of non-negative integers")
    return tuple(s)


def _plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, DeepSpeedRecord):
        return _plain(v.__dict__)
    return v


def _zero_files(path: Path) -> tuple[Path, str, dict[int, str], str]:
    """``(tag, rel, optim, model_name)``: the tag directory, its name relative to ``path`` ("" when ``path`` is the
    tag directory, else ``"<tag>/"``), the optimizer state file of each rank and the model states file.

    Raises:
        CheckpointFormatError: no DeepSpeed files, model parallelism, no optimizer or model states file.
    """
    tag = tag_directory(path)
    if tag is None:
        raise CheckpointFormatError(f"{path}: no DeepSpeed ZeRO files (*_optim_states.pt) here or under 'latest'")
    rel = "" if tag == path else tag.name + "/"
    names = sorted(list_names(tag))
    optim = {int(m.group(1)): n for n in names if (m := OPTIM_FILE.match(n))}
    mps = {int(m.group(2)) for n in names if (m := OPTIM_FILE.match(n) or MODEL_FILE.match(n))}
    if mps != {0}:
        raise CheckpointFormatError(f"{tag}: DeepSpeed checkpoint with model parallelism (mp_rank {sorted(mps)}); "
                                    "oarlock reads ZeRO data parallelism with mp_rank 00 only")
    if not optim:
        raise CheckpointFormatError(f"{tag}: no zero_pp_rank_*_optim_states.pt files")
    model_name = next((n for n in names if (m := MODEL_FILE.match(n)) and m.group(1) in (None, "0")), None)
    if model_name is None:
        raise CheckpointFormatError(f"{tag}: no model states file (mp_rank_00_model_states.pt)")
    return tag, rel, optim, model_name


def _state_file(path: Path, rel: str, tag: Path, name: str) -> Any:
    """State file ``name`` of the tag directory, checked to stay inside the checkpoint before it is opened."""
    return load_pt(checkpoint_file(path, rel + name, f"{tag}: DeepSpeed state file"))


def _param_groups(model: dict, where: Path) -> list[list[tuple[str, tuple[int, ...]]]]:
    """``param_shapes`` of the model states file ``where``: per optimizer group, ``(name, shape)`` in order."""
    shapes = model.get("param_shapes")
    if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
        raise CheckpointFormatError(f"{where}: param_shapes is not a list of {{name: shape}} groups")
    return [[(str(n), _shape(s, f"{where}: parameter {n!r}")) for n, s in g.items()] for g in shapes]


def _saved_world_size(tag: Path, optim: dict[int, str], o0: dict, ngroups: int) -> int:
    """The data-parallel degree the checkpoint was saved with (``partition_count``), every rank's file present."""
    pc = o0.get("partition_count")
    counts = pc if isinstance(pc, list) else [pc] * ngroups
    if not counts or any(type(c) is not int or c != counts[0] for c in counts):
        raise CheckpointFormatError(f"{tag / optim[0]}: malformed partition_count {pc!r}")
    world = counts[0]
    missing = [r for r in range(world) if r not in optim]
    if missing or max(optim) >= world:
        raise CheckpointFormatError(f"{tag}: saved by {world} ranks, but optimizer state files of ranks "
                                    f"{missing or sorted(r for r in optim if r >= world)} are "
                                    f"{'missing' if missing else 'extra'} (zero_pp_rank_<r>_mp_rank_00_optim_states.pt)")
    return world


def _partition_lengths(path: Path, rel: str, tag: Path, optim: dict[int, str], o0: dict, stage: int,
                       ngroups: int, world: int) -> dict[tuple[int, int], int]:
    """``(rank, group)`` -> elements of that rank's flat fp32 group tensor (each rank's optimizer file loaded)."""
    lengths: dict[tuple[int, int], int] = {}
    for r in range(world):
        od = o0 if r == 0 else _state_file(path, rel, tag, optim[r])["optimizer_state_dict"]
        flat = od.get("single_partition_of_fp32_groups" if stage < 3 else "fp32_flat_groups")
        if not isinstance(flat, list) or len(flat) != ngroups:
            raise CheckpointFormatError(f"{tag / optim[r]}: expected {ngroups} flat fp32 groups")
        for g, t in enumerate(flat):
            lengths[(r, g)] = int(t.numel())
    return lengths


def _add_flat_group(meta: CheckpointMetadata, tag: Path, g: int, params: list[tuple[str, tuple[int, ...]]],
                    pads: list, lengths: dict[tuple[int, int], int], world: int, files: dict[int, str]) -> None:
    """Stages 1/2: group ``g``'s parameters flattened in order (each followed by its ``pads`` elements) into one
    buffer cut into equal rank partitions."""
    part = lengths[(0, g)]
    offset = 0
    for i, (name, shape) in enumerate(params):
        n = math.prod(shape)
        shards = []
        for r in range(world):
            lo, hi = max(offset, r * part), min(offset + n, r * part + lengths[(r, g)])
            if hi > lo:
                shards.append((r, lo - offset, hi - offset, lo - r * part))
        _add_param(meta, name, shape, g, shards, files, n)
        offset += n + int(pads[i] if i < len(pads) else 0)
    if offset > sum(lengths[(r, g)] for r in range(world)):
        raise CheckpointFormatError(f"{tag}: group {g} holds {offset} elements of parameters but the rank "
                                    f"partitions hold {sum(lengths[(r, g)] for r in range(world))}")


def _add_sliced_group(meta: CheckpointMetadata, tag: Path, optim: dict[int, str], g: int,
                      params: list[tuple[str, tuple[int, ...]]], lengths: dict[tuple[int, int], int], world: int,
                      files: dict[int, str]) -> None:
    """Stage 3: every parameter of group ``g`` partitioned on its own, ``ceil(n / world)`` slots per rank."""
    base = [0] * world
    for name, shape in params:
        n = math.prod(shape)
        ps = math.ceil(n / world)
        shards = []
        for r in range(world):
            lo, hi = r * ps, min((r + 1) * ps, n)
            if hi > lo:
                shards.append((r, lo, hi, base[r]))
            base[r] += ps
        _add_param(meta, name, shape, g, shards, files, n)
    for r in range(world):
        if base[r] > lengths[(r, g)]:
            raise CheckpointFormatError(f"{tag / optim[r]}: group {g} holds {lengths[(r, g)]} elements, the "
                                        f"parameter partitions need {base[r]}")


def _add_buffers(meta: CheckpointMetadata, model: dict, model_file: str) -> None:
    """The module's buffers (stored whole in the model states file ``model_file``) and the tied parameters'
    aliases."""
    module = model.get("module") or {}
    for bname in model.get("buffer_names") or []:
        t = module.get(bname)
        if isinstance(t, torch.Tensor):
            meta.tensors[bname] = TensorMeta(bname, tuple(t.shape), dtype_name(t.dtype),
                                             [ShardMeta((0,) * t.dim(), tuple(t.shape), model_file,
                                                        f"module:{bname}")])
    for alias, src in (model.get("shared_params") or {}).items():
        if src in meta.tensors and alias not in meta.tensors:
            t = meta.tensors[src]
            meta.tensors[alias] = TensorMeta(alias, t.global_shape, t.dtype, list(t.shards))


def _add_run_values(meta: CheckpointMetadata, model: dict, o0: dict) -> None:
    """``optim.param_groups`` and the engine's scalars as values, marked as records of the training run."""
    meta.objects["optim.param_groups"] = [{k: _plain(v) for k, v in pg.items() if k != "params"}
                                          for pg in (o0.get("base_optimizer_state") or o0.get("optimizer_state_dict")
                                                     or {}).get("param_groups", [])]
    for k in ("global_steps", "global_samples", "skipped_steps", "ds_version", "ds_config", "iteration"):
        if k in model and isinstance(model[k], (int, float, str, dict, list)):
            meta.objects[k] = _plain(model[k])
    # the engine's counters, config and param groups are records of the training run, not model weights
    meta.non_model_keys = list(meta.objects)


def read_deepspeed_metadata(path: Path) -> tuple[CheckpointMetadata, str]:
    """Metadata of the ZeRO checkpoint at ``path`` (a save directory with ``latest`` or a tag directory) and the
    tag directory's name relative to ``path`` ("" when ``path`` is the tag directory).

    Raises:
        CheckpointFormatError: no DeepSpeed files, model parallelism (several ``mp_rank``), missing ranks, or
            partitions that do not add up to the parameter shapes (naming the file and group).
    """
    tag, rel, optim, model_name = _zero_files(path)
    model = _state_file(path, rel, tag, model_name)
    osd0 = _state_file(path, rel, tag, optim[0])
    if not isinstance(model, dict) or not isinstance(osd0, dict) or "optimizer_state_dict" not in osd0:
        raise CheckpointFormatError(f"{tag}: model/optimizer state files lack the DeepSpeed layout")
    o0 = osd0["optimizer_state_dict"]
    stage = int(o0.get("zero_stage", 3 if "fp32_flat_groups" in o0 else 2))
    groups = _param_groups(model, tag / model_name)
    world = _saved_world_size(tag, optim, o0, len(groups))

    meta = CheckpointMetadata("deepspeed")
    files = {r: rel + optim[r] for r in range(world)}
    lengths = _partition_lengths(path, rel, tag, optim, o0, stage, len(groups), world)
    for g, params in enumerate(groups):
        if stage < 3:
            pads = (o0.get("param_alignment_paddings") or [[0] * len(params)] * len(groups))[g]
            _add_flat_group(meta, tag, g, params, pads, lengths, world, files)
        else:
            _add_sliced_group(meta, tag, optim, g, params, lengths, world, files)
    _add_buffers(meta, model, rel + model_name)
    _add_run_values(meta, model, o0)
    meta.extra["deepspeed"] = {"zero_stage": stage, "world_size": world, "tag": tag.name,
                               "groups": [len(g) for g in groups]}
    return meta, rel


def _add_param(meta: CheckpointMetadata, name: str, shape: tuple[int, ...], g: int,
               shards: list[tuple[int, int, int, int]], files: dict[int, str], n: int) -> None:
    """The fp32 weight, the two moments and the step of one parameter, as flattened shards of the rank files.
    ``shards``: ``(rank, start, stop, element offset in the rank's flat group tensor)``."""
    zero = (0,) * len(shape)
    if sum(b - a for _, a, b, _ in shards) != n:
        raise CheckpointFormatError(f"parameter {name!r} (group {g}): the rank partitions "
                                    f"({', '.join(files[r] for r in sorted(files))}) cover "
                                    f"{sum(b - a for _, a, b, _ in shards)} of its {n} elements: truncated?")
    for key, stored in ((name, "fp32"), *((f"optim.state.{name}.{m}", m) for m in MOMENTS)):
        meta.tensors[key] = TensorMeta(key, shape, "float32", [
            ShardMeta(zero, shape, files[r], f"{stored}:{g}:{base}", (a, b)) for r, a, b, base in shards])
    meta.tensors[f"optim.state.{name}.step"] = TensorMeta(f"optim.state.{name}.step", (), "float32",
                                                          [ShardMeta((), (), files[0], f"step:{g}:0")])
    # marked, so that an HF export leaves them out by default and a model_only load ignores them
    meta.optimizer_keys.extend(f"optim.state.{name}.{m}" for m in (*MOMENTS, "step"))


def deepspeed_targets(model: torch.nn.Module, *, optimizer_state: bool = True) -> dict[str, torch.Tensor]:
    """Load targets for a DeepSpeed ZeRO checkpoint of ``model``, keyed exactly as the reader (and
    ``oarlock inspect``) lists them: ``<param name>`` (fp32, the master weight's shape), and with
    ``optimizer_state`` also ``optim.state.<param name>.exp_avg`` / ``.exp_avg_sq`` (fp32, same shape) and
    ``.step`` (a float32 scalar; DeepSpeed may store it as a Python int, read as its value). The names are
    ``model.named_parameters()``' (DeepSpeed's ``param_shapes`` use them); tied parameters appear once. Fresh
    zero tensors: ``load_state_dict(targets, dir, strict=False)`` fills them (the engine's counters and
    ``optim.param_groups`` are values, in ``LoadReport.unexpected_keys``).

    Torch's natural targets (``{"model": model.state_dict(), "optim": opt.state_dict()}``) do not match these
    keys: the ``model.`` wrapper and torch's integer parameter ids are not in a DeepSpeed checkpoint."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[name] = torch.zeros(p.shape, dtype=torch.float32)
        if optimizer_state:
            for m in MOMENTS:
                out[f"optim.state.{name}.{m}"] = torch.zeros(p.shape, dtype=torch.float32)
            out[f"optim.state.{name}.step"] = torch.zeros((), dtype=torch.float32)
    return out


@register_format
class DeepSpeedReader(CheckpointReader):
    """Reader of DeepSpeed ZeRO 1/2/3 checkpoints (a save directory with ``latest``, or one tag directory).

    Each ``*_states.pt`` file is loaded once, memory-mapped (``torch.load(mmap=True, weights_only=True)``), so
    reading a box touches only the pages of the partition bytes it needs."""

    format = "deepspeed"
    priority = 2
    hint = "latest + global_step*/zero_pp_rank_*_optim_states.pt (DeepSpeed)"

    def __init__(self, root: Path, metadata: CheckpointMetadata):
        super().__init__(root, metadata)
        self._files: dict[str, Any] = {}

    @classmethod
    def claim(cls, path: Path, names: set[str] | None) -> int:
        if names is None:
            return 0
        if any(OPTIM_FILE.match(n) for n in names):
            return 2
        if "latest" not in names:
            return 0
        try:
            return 2 if tag_directory(path) is not None else 0
        except CheckpointFormatError:
            return 2  # a tag directory linked from outside: open() names it

    @classmethod
    def open(cls, path: Path, *, shipped: dict[str, bytes] | None = None, partial: bool = False
             ) -> "DeepSpeedReader":
        meta, _ = read_deepspeed_metadata(path)
        return cls(path, meta)

    def close(self) -> None:
        self._files.clear()
        super().close()

    def _file(self, file: str) -> Any:
        f = self._files.get(file)
        if f is None:
            f = self._files[file] = load_pt(self.path_of(file))
            self.files_opened.append(file)
        return f

    def _stored(self, file: str, name: str) -> tuple[torch.Tensor, int]:
        """The stored tensor behind shard ``name`` (``kind:group:offset``) and the element offset into it."""
        kind, g, base = name.split(":", 2)
        data = self._file(file)
        where = self.path_of(file)
        if kind == "module":
            t = (data.get("module") or {}).get(base)
            if not isinstance(t, torch.Tensor):
                raise CheckpointFormatError(f"{where}: buffer {base!r} is missing")
            return t, 0
        od = data.get("optimizer_state_dict", {})
        gi = int(g)
        if kind == "fp32":
            flat = od.get("single_partition_of_fp32_groups", od.get("fp32_flat_groups"))
            t = flat[gi] if isinstance(flat, list) and gi < len(flat) else None
        else:
            inner = od.get("base_optimizer_state") or od.get("optimizer_state_dict") or {}
            state = inner.get("state", {}).get(gi, {})
            t = state.get(kind)
            if kind == "step" and type(t) in (int, float):
                # DeepSpeed's FusedAdam (and optimizers like it) keep the step as a Python number, not a tensor
                t = torch.tensor(float(t), dtype=torch.float32)
        if not isinstance(t, torch.Tensor):
            raise CheckpointFormatError(f"{where}: no {kind} tensor{' or number' if kind == 'step' else ''} "
                                        f"for parameter group {gi}")
        return t.reshape(-1) if kind != "step" else t.reshape(()), int(base)

    def read_box(self, key: str, file: str, name: str, flat_start: int, shape: tuple[int, ...],
                 box: tuple[tuple[int, int], ...], out: torch.Tensor | None = None) -> torch.Tensor:
        t, base = self._stored(file, name)
        n = math.prod(shape)
        if t.dim() == 0:  # the step: one value, whatever the offset says
            if n != 1:
                raise CheckpointFormatError(f"{self.path_of(file)}: {key!r}: stored scalar read as shape {list(shape)}")
            t, base, flat_start = t.to(torch.float32), 0, 0
        elif base + flat_start + n > t.numel():
            raise CheckpointFormatError(f"{self.path_of(file)}: {key!r} needs elements [{base + flat_start}, "
                                        f"{base + flat_start + n}) of a partition of {t.numel()}: truncated?")
        tm = self.metadata.tensors.get(key)
        return box_of_stored(t, base + flat_start, shape, box, out,
                             torch.float32 if tm is not None and tm.dtype == "float32" else None)

    def byte_run(self, key: str, file: str, name: str, flat_start: int, shape: tuple[int, ...],
                 box: tuple[tuple[int, int], ...]) -> tuple[int, int, int] | None:
        return None
