"""Conversion planning: the tensor-parallel split rules (built in, from a preset or a JSON file), the target layouts (TP x PP x DP/ZeRO), the selection of keys, and :func:`plan_conversion`, what a conversion will write, computed from the source's metadata without reading a tensor."""

from __future__ import annotations

import fnmatch
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence


from oarlock.checkpoint.errors import CheckpointError
from oarlock.checkpoint.formats.huggingface_writer import (HF_INDEX, hf_shard_names, parse_size,
                                                           reserved_hf_key_message)
from oarlock.checkpoint.model.mapping import IdentityProgram, MappingProgram, TensorSpec
from oarlock.checkpoint.model.metadata import (ALGORITHM_KEY, METADATA_FILE, PARAM_GROUPS_KEY, CheckpointMetadata,
                                               key_selected, parse_json)
from oarlock.checkpoint.planning.load import source_specs
from oarlock.checkpoint.formats.reader import checkpoint_file
from oarlock.checkpoint.storage.safetensors import RESERVED_NAME
from oarlock.checkpoint.runtime.save import assign_writes
from oarlock.checkpoint.storage import location, storage_key
from oarlock.checkpoint.formats.opening import open_checkpoint
from oarlock.utils import dtype_itemsize, numel, stage_of_layer


_COLUMN = ["*q_proj.weight", "*k_proj.weight", "*v_proj.weight", "*qkv_proj.weight", "*gate_proj.weight",
           "*up_proj.weight", "*gate_up_proj.weight", "*up_gate_proj.weight", "*.query.weight", "*.key.weight",
           "*.value.weight", "*.qkv.weight", "*intermediate.dense.weight"]


_COLUMN_BIAS = [p[:-len("weight")] + "bias" for p in _COLUMN]


_ROW = ["*o_proj.weight", "*down_proj.weight", "*attention.output.dense.weight", "*output.dense.weight",
        "*dense_4h_to_h.weight"]


_VOCAB = ["*embed_tokens.weight", "*word_embeddings.weight", "lm_head.weight", "*.lm_head.weight"]


def _rule_set(column_axis: int, row_axis: int) -> list[tuple[str, int | None]]:
    return ([(p, 0) for p in _VOCAB] + [(p, column_axis) for p in _COLUMN] + [(p, 0) for p in _COLUMN_BIAS]
            + [(p, row_axis) for p in _ROW])


def resolve_tp_rules(rules: str | Path | Mapping[str, int | None] | Sequence[tuple[str, int | None]] | None
                     ) -> list[tuple[str, int | None]]:
    """TP rules from a rule-set name (``"megatron"``, ``"paddle"``, ``"none"``), a JSON file holding
    ``{glob: axis or null}`` (in priority order), a mapping, or a list of pairs. None = ``"megatron"``.

    Raises:
        CheckpointError: unknown name, unreadable file, or an axis that is not an int or null.
    """
    if rules is None:
        return list(TP_RULES["megatron"])
    origin = ""
    if isinstance(rules, (str, Path)):
        if str(rules) in TP_RULES:
            return list(TP_RULES[str(rules)])
        p = Path(rules)
        if not p.is_file():
            raise CheckpointError(f"TP rules {str(rules)!r}: neither a rule-set name ({', '.join(TP_RULES)}) nor a "
                                  "JSON file")
        try:
            rules = parse_json(p.read_bytes(), f"{p}: TP rules", CheckpointError)
        except OSError as e:
            raise CheckpointError(f"{p}: cannot read the TP rules: {e.strerror or e}") from None
        if not isinstance(rules, dict):
            raise CheckpointError(f"{p}: TP rules must be a JSON object {{glob: axis or null}}")
        origin = f"{p}: "
    pairs = list(rules.items()) if isinstance(rules, Mapping) else [tuple(r) for r in rules]
    for pat, axis in pairs:
        if axis is not None and (isinstance(axis, bool) or not isinstance(axis, int)):
            raise CheckpointError(f"{origin}TP rule {pat!r}: axis must be an int or null, got {axis!r}")
    return [(str(p), a) for p, a in pairs]


def tp_axis(key: str, shape: Sequence[int], rules: Sequence[tuple[str, int | None]]) -> int | None:
    """The axis ``key`` is split on under ``rules`` (first matching glob), or None when replicated.

    Raises:
        CheckpointError: the matching rule's axis does not exist for ``shape``.
    """
    for pat, axis in rules:
        if fnmatch.fnmatchcase(key, pat):
            if axis is None:
                return None
            if not -len(shape) <= axis < len(shape):
                raise CheckpointError(f"TP rule {pat!r} splits {key!r} on axis {axis}, but its shape is "
                                      f"{list(shape)}")
            return axis % len(shape)
    return None


def chunk_sizes(n: int, parts: int) -> list[int]:
    """Extents of ``torch.chunk``-style pieces: ``ceil(n / parts)`` each, the tail smaller or empty."""
    step = -(-n // parts) if n else 0
    return [max(0, min(step, n - i * step)) for i in range(parts)]


_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)\.")


def pp_stages(keys: Sequence[str], pp: int) -> dict[str, int]:
    """Pipeline stage of every key: contiguous blocks of layers split as ``parallelize_llama`` splits them
    (:func:`oarlock.utils.stage_of_layer`); non-layer keys go to stage 0 when they name an embedding, else to the
    last stage."""
    ids = {k: int(m.group(1)) for k in keys if (m := _LAYER.search(k))}
    n = max(ids.values()) + 1 if ids else 1
    out = {}
    for k in keys:
        if k in ids:
            out[k] = stage_of_layer(ids[k], n, pp)
        else:
            out[k] = 0 if "embed" in k else pp - 1
    return out


@dataclass(frozen=True)
class ConversionLayout:
    """The job a conversion simulates: ``tp * dp * pp`` ranks, ranks ordered ``tp`` fastest, then ``dp``, then
    ``pp``, and the TP split ``rules``. (Training layouts are :class:`oarlock.models.ParallelLayout`.)"""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    rules: tuple[tuple[str, int | None], ...] = ()

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            if int(getattr(self, name)) < 1:
                raise CheckpointError(f"--{name} must be at least 1, got {getattr(self, name)}")

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp

    def rank(self, tp_i: int, dp_i: int, pp_i: int) -> int:
        return tp_i + self.tp * (dp_i + self.dp * pp_i)


@dataclass
class KeyPlan:
    """One destination key: global shape, dtype, bytes, TP axis (None = replicated) and pipeline stage."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    axis: int | None = None
    stage: int = 0


@dataclass
class ConversionPlan:
    """What a conversion will write (``oarlock convert --dry-run`` prints it).

    Attributes:
        source: the source path; ``source_format`` its format.
        to: ``"hf"`` or ``"oarlock"``.
        keys: the destination keys in write order.
        files: output file -> (keys, bytes).
        metadata: for ``to="oarlock"``, the metadata the checkpoint will have.
    """

    source: str
    source_format: str
    to: str
    keys: list[KeyPlan] = field(default_factory=list)
    files: dict[str, tuple[list[str], int]] = field(default_factory=dict)
    metadata: CheckpointMetadata | None = None
    layout: ConversionLayout | None = None
    dropped_optimizer_keys: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(k.nbytes for k in self.keys)

    def render(self) -> str:
        lines = [f"{self.source} ({self.source_format}) -> {self.to}: {len(self.keys)} tensors, "
                 f"{self.total_bytes} bytes in {len(self.files)} file(s)"]
        if self.layout is not None and self.to == "oarlock":
            lines[0] += f"; tp={self.layout.tp} pp={self.layout.pp} dp={self.layout.dp}"
        w = max([len(k.key) for k in self.keys] + [3])
        split = self.to == "oarlock"
        lines.append(f"{'key':<{w}}  {'shape':<18} {'dtype':<9} {'bytes':>11}" + ("  split" if split else ""))
        for k in self.keys:
            extra = ""
            if split:
                extra = f"  {'axis ' + str(k.axis) if k.axis is not None else 'replicated'}"
                extra += f" stage {k.stage}" if self.layout is not None and self.layout.pp > 1 else ""
            lines.append(f"{k.key:<{w}}  {str(list(k.shape)):<18} {k.dtype:<9} {k.nbytes:>11}{extra}")
        for f, (keys, n) in sorted(self.files.items()):
            lines.append(f"# {f}: {len(keys)} tensor(s), {n} bytes")
        if self.dropped_optimizer_keys:
            lines.append(f"# left out {len(self.dropped_optimizer_keys)} optimizer state tensor(s)")
        return "\n".join(lines)


def compile_program(metadata: CheckpointMetadata, aoa_config: Any = None, *,
                    destination_shards: Mapping[str, int] | None = None) -> MappingProgram:
    """The mapping program of a conversion: identity, or ``aoa_config`` compiled against the source's keys
    with the program's sinks as destinations (source TP shard counts from the metadata, destination ones given).

    Raises:
        AOAError / AOASyntaxError (subclasses of CheckpointError): a bad config.
    """
    from oarlock.checkpoint.aoa.layout import recorded_layouts, relayout_config

    recorded = recorded_layouts(metadata)
    if recorded:  # TP-blocked tensors of the source: written for the output's degree (1 unless split)
        destination_shards = {**{k: 1 for k in recorded}, **(destination_shards or {})}
        aoa_config = relayout_config([] if aoa_config is None else aoa_config, metadata, destination_shards)
    if aoa_config is None:
        return IdentityProgram(source_specs(metadata))
    from oarlock.checkpoint.aoa import compile_aoa, shard_counts

    return compile_aoa(aoa_config, source_specs(metadata), None, source_shards=shard_counts(metadata),
                       destination_shards=destination_shards)


class SelectedKeys:
    """A mapping program restricted to some of its destination keys (same specs and mappings)."""

    def __init__(self, program: MappingProgram, keys: Sequence[str]):
        self.program = program
        self.keys = list(keys)
        self.deleted_keys = getattr(program, "deleted_keys", ())

    def destination_keys(self) -> list[str]:
        return list(self.keys)

    def destination_spec(self, key: str) -> TensorSpec:
        return self.program.destination_spec(key)

    def mappings_for(self, key: str):
        return self.program.mappings_for(key)


def select_keys(program: MappingProgram, metadata: CheckpointMetadata, *, include: Sequence[str] | None = None,
                exclude: Sequence[str] | None = None, optimizer_state: bool = True
                ) -> tuple[MappingProgram, list[str]]:
    """Restrict ``program`` to the destination keys that pass the ``include``/``exclude`` globs
    (:func:`~oarlock.checkpoint.model.metadata.key_selected`) and, unless ``optimizer_state``, are not optimizer state:
    a destination key is optimizer state when every source key it reads is one
    (:meth:`~oarlock.checkpoint.model.metadata.CheckpointMetadata.optimizer_state_keys`, and tensors among the run's
    records, :attr:`~oarlock.checkpoint.model.metadata.CheckpointMetadata.non_model_keys`). Returns ``(program, dropped
    optimizer keys)``; ``program`` itself when nothing is filtered."""
    opt = set() if optimizer_state else (set(metadata.optimizer_state_keys())
                                         | (set(metadata.non_model_keys) & set(metadata.tensors)))
    if not opt and not include and not exclude:
        return program, []
    keep, dropped = [], []
    for k in program.destination_keys():
        if opt and all(m.src_key in opt for m in program.mappings_for(k)):
            dropped.append(k)
        elif key_selected(k, include, exclude):
            keep.append(k)
    return SelectedKeys(program, keep), dropped


def carried_objects(metadata: CheckpointMetadata, *, include: Sequence[str] | None = None,
                    exclude: Sequence[str] | None = None, optimizer_state: bool = True) -> dict[str, Any]:
    """The source's non-tensor values a conversion to oarlock keeps, under their stored keys (an AOA mapping
    names tensors only): those the ``include``/``exclude`` globs keep, without the optimizer's records
    (``param_groups`` and the like, :attr:`~oarlock.checkpoint.model.metadata.CheckpointMetadata.non_model_keys`)
    unless ``optimizer_state``, and only JSON values (what an oarlock checkpoint stores; a foreign format's other
    objects are left out)."""
    out: dict[str, Any] = {}
    skip = set() if optimizer_state else set(metadata.non_model_keys) | {PARAM_GROUPS_KEY, ALGORITHM_KEY}
    for k, v in metadata.objects.items():
        if k in skip or not key_selected(k, include, exclude):
            continue
        try:
            json.dumps(v, allow_nan=True)  # the rule a save applies to its values (a NaN loss is kept)
        except (TypeError, ValueError):
            continue
        out[k] = v
    return out


def program_for_layout(metadata: CheckpointMetadata, aoa_config: Any, layout: ConversionLayout
                        ) -> tuple[MappingProgram, dict[str, int | None]]:
    program = compile_program(metadata, aoa_config)
    axes = {k: tp_axis(k, program.destination_spec(k).shape, layout.rules) for k in program.destination_keys()}
    if layout.tp > 1 and (aoa_config is not None or metadata.extra.get("tp_layouts")):
        # fused_ffn / fused_qkv_old layouts depend on the destination TP degree: compile again knowing it
        counts = {k: layout.tp for k, a in axes.items() if a is not None}
        program = compile_program(metadata, aoa_config, destination_shards=counts)
        axes = {k: tp_axis(k, program.destination_spec(k).shape, layout.rules) for k in program.destination_keys()}
    return program, axes


_HEAD_KEYS = (("q_proj.weight", "num_attention_heads"), ("k_proj.weight", "num_key_value_heads"),
              ("v_proj.weight", "num_key_value_heads"))


def warn_split_heads(source: str | os.PathLike, axes: Mapping[str, int | None], tp: int) -> list[str]:
    """Warn (``UserWarning``) when a TP split cuts attention heads apart: the ``config.json`` beside a source
    directory gives the heads of ``q_proj`` and the key/value heads of ``k_proj``/``v_proj``, and ``tp`` must divide
    them for each rank to hold whole heads (a model with 3 KV heads at TP=2 splits its 96-row ``k_proj`` 48/48,
    half a head each). Returns the warnings given (nothing to check without a config or at ``tp`` 1)."""
    import warnings

    cfg_path = side_files(source).get("config.json") if tp > 1 else None
    if cfg_path is None:
        return []
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError):
        return []
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}
    out = []
    for suffix, field_ in _HEAD_KEYS:
        n = cfg.get(field_, cfg.get("num_attention_heads"))
        keys = [k for k, a in axes.items() if a is not None and k.endswith(suffix)]
        if keys and isinstance(n, int) and n % tp:
            more = f" (and {len(keys) - 1} more keys)" if len(keys) > 1 else ""
            out.append(f"{keys[0]}{more} holds {n} heads ({field_} in {cfg_path.name}): split "
                       f"{tp} ways, each rank gets part of a head; use a TP degree that divides {n}")
            warnings.warn(out[-1], UserWarning, stacklevel=3)
    return out


def rank_descriptions(program: MappingProgram, axes: Mapping[str, int | None], layout: ConversionLayout
                      ) -> list[list[tuple]]:
    """Per simulated rank, its shard descriptions in the form ``save_state_dict`` all-gathers:
    ``(key, global_shape, dtype, offset, local_shape, flattened_range, nbytes)``, in destination key order."""
    keys = program.destination_keys()
    stages = pp_stages(keys, layout.pp)
    per_rank: list[list[tuple]] = [[] for _ in range(layout.world)]
    for k in keys:
        spec = program.destination_spec(k)
        shape = tuple(spec.shape)
        axis = axes.get(k)
        sizes = chunk_sizes(shape[axis], layout.tp) if axis is not None else None
        for tp_i in range(layout.tp):
            off = [0] * len(shape)
            local = list(shape)
            if sizes is not None:
                off[axis] = sum(sizes[:tp_i])
                local[axis] = sizes[tp_i]
            nbytes = numel(local) * dtype_itemsize(spec.dtype)
            for dp_i in range(layout.dp):
                r = layout.rank(tp_i, dp_i, stages[k])
                per_rank[r].append((k, shape, spec.dtype, tuple(off), tuple(local), None, nbytes))
    return per_rank


def strip_model_prefix(metadata: CheckpointMetadata, aoa_config: Any = None, model_prefix: str | None = None
                       ) -> Any:
    """The AOA config of an HF export: ``aoa_config`` when given; else, when the model weights sit under a wrapper
    prefix, a config dropping it (``"<prefix>** -> **"``; other keys keep their names). ``model_prefix`` None
    takes the prefix :func:`~oarlock.checkpoint.model.metadata.mark_training_layout` found (``"model."`` for torch's
    ``{"model": ..., "optim": ...}`` training state, torchtitan's too), ``""`` keeps every key as stored, any
    other string is stripped from the keys that start with it.

    Raises:
        CheckpointError: ``model_prefix`` given together with ``aoa_config``, or a prefix no tensor key starts
            with (naming it)."""
    if aoa_config is not None:
        if model_prefix:
            raise CheckpointError("--model-prefix and an AOA config/preset do not combine: put the renaming in the "
                                  "AOA config")
        return aoa_config
    prefix = metadata.model_prefix if model_prefix is None else model_prefix
    if not prefix:
        return None
    if not any(k.startswith(prefix) for k in metadata.tensors):
        raise CheckpointError(f"model prefix {prefix!r}: no tensor key of the checkpoint starts with it "
                              f"(keys such as {next(iter(metadata.tensors), '')!r})")
    return {"aoa_statements": [f"{prefix}** -> **"]}


def plan_conversion(source: str | os.PathLike, *, to: str = "oarlock", aoa_config: Any = None,
                    layout: ConversionLayout | None = None, max_shard_size: int | str = "5GB",
                    include: Sequence[str] | None = None, exclude: Sequence[str] | None = None,
                    optimizer_state: bool | None = None, model_prefix: str | None = None) -> ConversionPlan:
    """Describe a conversion without writing anything (see :func:`convert_checkpoint`, :func:`export_hf`).
    ``include``/``exclude``/``optimizer_state``: see :func:`select_keys`; ``optimizer_state`` None means False
    for ``to="hf"`` (model weights only) and True for ``to="oarlock"``. ``model_prefix`` (``to="hf"`` only): see
    :func:`strip_model_prefix`.

    Raises:
        CheckpointError: unreadable source, bad AOA config or TP rules, unknown ``to``.
    """
    if to not in ("hf", "oarlock"):
        raise CheckpointError(f"unknown output format {to!r} (use 'hf' or 'oarlock')")
    layout = layout or ConversionLayout(rules=tuple(resolve_tp_rules(None)))
    with open_checkpoint(source) as reader:
        meta = reader.metadata
        plan = ConversionPlan(str(source), meta.format, to, layout=layout)
        keep_opt = (to == "oarlock") if optimizer_state is None else optimizer_state
        if to == "oarlock":
            program, axes = program_for_layout(meta, aoa_config, layout)
            program, plan.dropped_optimizer_keys = select_keys(program, meta, include=include, exclude=exclude,
                                                               optimizer_state=keep_opt)
            tensors, _ = assign_writes(rank_descriptions(program, axes, layout))
            stages = pp_stages(program.destination_keys(), layout.pp)
            plan.metadata = CheckpointMetadata("oarlock", tensors=tensors)
            for k in program.destination_keys():
                spec = program.destination_spec(k)
                plan.keys.append(KeyPlan(k, tuple(spec.shape), spec.dtype,
                                         numel(spec.shape) * dtype_itemsize(spec.dtype), axes[k], stages[k]))
            per_file: dict[str, list] = {}
            for t in tensors.values():
                for s in t.shards:
                    entry = per_file.setdefault(s.file, [[], 0])
                    entry[0].append(t.key)
                    entry[1] += numel(s.local_shape) * dtype_itemsize(t.dtype)
            plan.files = {f: (keys, n) for f, (keys, n) in per_file.items()}
        else:
            aoa_config = strip_model_prefix(meta, aoa_config, model_prefix)
            program, plan.dropped_optimizer_keys = select_keys(compile_program(meta, aoa_config), meta,
                                                               include=include, exclude=exclude,
                                                               optimizer_state=keep_opt)
            if RESERVED_NAME in program.destination_keys():
                raise CheckpointError(reserved_hf_key_message())
            limit = parse_size(max_shard_size)
            shards: list[list] = []  # [keys, bytes] per output file, packed greedily like save_hf_checkpoint
            for k in program.destination_keys():
                spec = program.destination_spec(k)
                n = numel(spec.shape) * dtype_itemsize(spec.dtype)
                plan.keys.append(KeyPlan(k, tuple(spec.shape), spec.dtype, n))
                if not shards or (shards[-1][0] and shards[-1][1] + n > limit):
                    shards.append([[], 0])
                shards[-1][0].append(k)
                shards[-1][1] += n
            names = hf_shard_names(len(shards))
            plan.files = {name: (keys, n) for name, (keys, n) in zip(names, shards)}
    return plan


class ParallelLayout(ConversionLayout):
    """Deprecated name of :class:`ConversionLayout` (one concept per name: ``ParallelLayout`` is the training
    layout of :mod:`oarlock.models.parallel`)."""

    def __post_init__(self) -> None:
        import warnings

        warnings.warn("oarlock.checkpoint.ParallelLayout is deprecated: use oarlock.checkpoint.ConversionLayout",
                      DeprecationWarning, stacklevel=3)
        super().__post_init__()


TP_RULES: dict[str, list[tuple[str, int | None]]] = {
    "megatron": _rule_set(0, 1),
    "paddle": _rule_set(1, 0),
    "none": [],
}


_SIDE_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".md", ".py", ".tiktoken")


def side_files(source: str | os.PathLike) -> dict[str, Any]:
    """Non-checkpoint files next to a checkpoint that a model directory needs (``config.json``, tokenizer
    files, ...): top-level regular files with a text-like suffix, except checkpoint indexes and metadata. Returns
    name -> location (a path, or an object in a store)."""
    p = location(source)
    if not p.is_dir():
        return {}
    st, key = storage_key(p)
    skip = {HF_INDEX, METADATA_FILE}
    out = {}
    for name, size in sorted(st.list(key).items()):
        if size >= 0 and Path(name).suffix in _SIDE_SUFFIXES and name not in skip and not name.endswith(".metadata"):
            out[name] = checkpoint_file(p, name, f"{p}: side file")  # a symlink out of the source is refused
    return out
