"""Checkpoint metadata: what is stored, where, in which box.

One model serves every source format (oarlock, HuggingFace, PaddlePaddle FlexCheckpoint, a lone safetensors
file): readers turn each into a :class:`CheckpointMetadata`, and the load planner only ever sees that.

Terms (``docs/checkpoint-format.md``): a tensor *key* has a *global shape*; a *shard* is an axis-aligned box
given by its *global offset* and *local shape*. A *flattened* shard holds only elements
``[flattened_range[0], flattened_range[1])`` of the row-major flattening of its box (ZeRO flat buffers).
oarlock's own on-disk metadata is JSON (``metadata.json``), never pickle.
"""

from __future__ import annotations

import fnmatch
import functools
import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from oarlock.checkpoint.errors import CheckpointFormatError
from oarlock.checkpoint.model.boxes import numel, stored_numel
from oarlock.checkpoint.model.flatgrid import FlatGrid, compress_flat
from oarlock.checkpoint.model.grid import GridLayout, compress_shards
from oarlock.checkpoint.model.names import METADATA_FILE, SAVE_ID_HEADER, data_file_name
from oarlock.checkpoint.model.packed import PackedLayout
from oarlock.utils import dtype_itemsize, dtype_name

__all__ = ["ALGORITHM_KEY", "CheckpointMetadata", "FORMAT_NAME", "FORMAT_VERSION", "METADATA_FILE", "MODEL_WRAPPERS",
           "OPTIMIZER_KEYS_EXTRA", "OPTIMIZER_WRAPPERS", "PARAM_GROUPS_KEY", "READABLE_VERSIONS",
           "RUN_RECORD_WRAPPERS", "SAVE_ID_HEADER", "STATE_SUFFIXES", "ShardMeta", "TensorMeta", "WRAPPED_FORMATS",
           "grid_cell_count", "key_selected", "mark_training_layout", "parse_json"]

FORMAT_NAME = "oarlock.flexcheckpoint"
FORMAT_VERSION = 4  # 2: grid records; 3: packed data files; 4: block checksums in digests files
# (docs/checkpoint-format.md); 1 to 3 are still read
READABLE_VERSIONS = (1, 2, 3, 4)
#: JSON objects an optimizer checkpoint holds (see :mod:`oarlock.checkpoint.lifecycle.optim`).
ALGORITHM_KEY = "optimizer.algorithm"
PARAM_GROUPS_KEY = "optimizer.param_groups"
#: Suffixes of optimizer state keys: torch state names and Paddle's (see :mod:`oarlock.checkpoint.lifecycle.optim`).
STATE_SUFFIXES = (".exp_avg", ".exp_avg_sq", ".max_exp_avg_sq", ".momentum_buffer", ".master_weight", ".step",
                  ".moment1_0", ".moment2_0", ".velocity_0", ".w_0", ".beta1_pow_acc_0", ".beta2_pow_acc_0")


def parse_json(data: bytes | str, source: str, error: type[Exception] = CheckpointFormatError) -> Any:
    """Parse the JSON text ``data`` read from ``source`` (a file name, for messages); any failure -- not UTF-8,
    invalid JSON, nesting deeper than the parser handles -- raises ``error`` with one line naming ``source``."""
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise error(f"{source}: invalid JSON: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    except RecursionError:
        raise error(f"{source}: invalid JSON: nested too deeply") from None


@dataclass(frozen=True)
class ShardMeta:
    """One stored shard of a tensor.

    Attributes:
        global_offset: start of the box in each dimension of the global tensor (``()`` for scalars).
        local_shape: extent of the box in each dimension.
        file: data file, relative to the checkpoint directory.
        name: name of the tensor inside that file.
        flattened_range: ``(start, stop)`` element range of the box's row-major flattening that the stored
            1-D tensor holds, or ``None`` for a regular (whole-box) shard.
        replica_id: ``None`` or ``0`` for the primary copy; ``>= 1`` for extra copies kept for warm restart.
    """

    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    file: str
    name: str
    flattened_range: tuple[int, int] | None = None
    replica_id: int | None = None

    @property
    def numel(self) -> int:
        """Elements actually stored (the flat range's length for flattened shards)."""
        return stored_numel(self.local_shape, self.flattened_range)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"global_offset": list(self.global_offset), "local_shape": list(self.local_shape),
                             "file": self.file, "name": self.name}
        if self.flattened_range is not None:
            d["flattened_range"] = list(self.flattened_range)
        if self.replica_id is not None:
            d["replica_id"] = self.replica_id
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ShardMeta":
        fr = d.get("flattened_range")
        if not isinstance(d["file"], str) or not isinstance(d["name"], str):
            raise TypeError("\"file\" and \"name\" must be strings")
        rid = d.get("replica_id")
        return cls(tuple(int(x) for x in d["global_offset"]), tuple(int(x) for x in d["local_shape"]), d["file"],
                   d["name"], tuple(int(x) for x in fr) if fr is not None else None,
                   int(rid) if rid is not None else None)


class TensorMeta:
    """A stored tensor: global shape, dtype (canonical name, see :func:`oarlock.utils.dtype_name`), shards.

    The shards are either listed (``shards``, one :class:`ShardMeta` each) or given by a grid rule (``grid``, a
    :class:`~oarlock.checkpoint.model.grid.GridLayout`: one record whatever the number of shards). ``shards`` of a grid
    tensor materialises the list on first use (for tools and small checkpoints); the planner and the file listing
    use the rule directly.
    """

    __slots__ = ("key", "global_shape", "dtype", "_shards", "grid")

    def __init__(self, key: str, global_shape: Sequence[int], dtype: str, shards: list[ShardMeta] | None = None,
                 grid: Any = None):
        self.key = key
        self.global_shape = tuple(global_shape)
        self.dtype = dtype
        self.grid = grid
        self._shards = list(shards) if shards is not None else (None if grid is not None else [])

    def __repr__(self) -> str:
        what = f"grid={self.grid!r}" if self.grid is not None else f"{len(self._shards or [])} shards"
        return f"TensorMeta({self.key!r}, {list(self.global_shape)}, {self.dtype!r}, {what})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorMeta):
            return NotImplemented
        return (self.key, self.global_shape, self.dtype) == (other.key, other.global_shape, other.dtype) \
            and self.shards == other.shards

    @property
    def shards(self) -> list[ShardMeta]:
        """Every stored shard (a grid's non-empty cells, materialised once)."""
        if self._shards is None:
            if isinstance(self.grid, FlatGrid):
                n = numel(self.global_shape)
                zeros = (0,) * len(self.global_shape)
                self._shards = [ShardMeta(zeros, self.global_shape, data_file_name(self.grid.writer(i)), self.key,
                                          self.grid.shard(n, i)) for i in range(self.grid.count(n) if n else 0)]
            else:
                self._shards = [ShardMeta(off, shape, data_file_name(self.grid.writer(cell)), self.key)
                                for cell, off, shape in self.grid.cells(self.global_shape)]
        return self._shards

    @shards.setter
    def shards(self, value: list[ShardMeta]) -> None:
        self._shards = list(value)
        self.grid = None

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (global) tensor."""
        return numel(self.global_shape) * dtype_itemsize(self.dtype)

    def primary_shards(self) -> list[ShardMeta]:
        """Shards that are not extra replicas (``replica_id`` None or 0)."""
        return [s for s in self.shards if not s.replica_id]

    def shard_count(self) -> int:
        """Number of distinct primary shard boxes (a grid's non-empty cells: counted, not materialised)."""
        if self.grid is not None and self._shards is None:
            return 1 if isinstance(self.grid, FlatGrid) else grid_cell_count(self.global_shape, self.grid)
        return len({s.global_offset for s in self.primary_shards()})

    def files(self) -> set[str]:
        """Data files holding any shard of this tensor."""
        if self.grid is not None and self._shards is None:
            return _grid_files(self.global_shape, self.grid)
        return {s.file for s in self.shards}

    def to_json(self, compact: bool = True) -> dict[str, Any]:
        """The ``metadata.json`` entry: a grid record when the shards form a grid (``compact``), else the list."""
        d: dict[str, Any] = {"global_shape": list(self.global_shape), "dtype": self.dtype}
        grid = None
        if compact:
            grid = self.grid if self._shards is None else (
                compress_shards(self.global_shape, self._shards, self.key)
                or compress_flat(self.global_shape, self._shards, self.key))
        if isinstance(grid, FlatGrid):
            d["flat"] = grid.to_json()
        elif grid is not None:
            d["grid"] = grid.to_json()
        else:
            d["shards"] = [s.to_json() for s in self.shards]
        return d


@functools.lru_cache(maxsize=65536)
def _grid_files(global_shape: tuple[int, ...], grid: Any) -> frozenset:
    return frozenset(grid.files(global_shape))


@functools.lru_cache(maxsize=65536)
def grid_cell_count(global_shape: tuple[int, ...], grid: Any) -> int:
    return sum(1 for _ in grid.cells(global_shape))


@dataclass
class CheckpointMetadata:
    """Everything a loader needs to plan reads: per key its global shape, dtype and shards.

    Attributes:
        format: ``"oarlock"``, ``"huggingface"``, ``"paddle"`` or ``"safetensors"``.
        tensors: key -> :class:`TensorMeta`, in save order.
        objects: small non-tensor values (ints, floats, strings, lists) saved as JSON.
        nested: flat key -> path (list of str/int) to rebuild nested state dicts.
        extra: format-specific information (for example the HF index's ``metadata`` block).
        save_id: the unique id of the save that wrote the checkpoint (oarlock format; None for other formats
            and older checkpoints); every data file's header carries it (:data:`SAVE_ID_HEADER`) and readers
            refuse a data file of another save.
        optimizer_keys: tensor keys the reader of a foreign format knows hold optimizer state although they are
            not named ``<model key><suffix>`` (DeepSpeed's ``optim.state.<param>.exp_avg``, Megatron-Core's
            ``optimizer.state.<state>.<param>``); :meth:`optimizer_state_keys` includes them. oarlock's own keys
            follow the suffix rule instead; a conversion of a foreign checkpoint to oarlock keeps the marking in
            ``metadata.json`` under ``extra.optimizer_keys`` (:data:`OPTIMIZER_KEYS_EXTRA`).
        non_model_keys: keys of entries (tensors or objects) the reader knows are neither model weights nor
            optimizer state, but records of the training run (Megatron-Core's ``common.*`` values and layers'
            ``*._extra_state*``, DeepSpeed's engine counters and ``optim.param_groups``). A ``model_only`` load
            does not count them as unexpected. Not written to ``metadata.json``.
        model_prefix: the wrapper prefix every model weight of a training-state checkpoint is stored under
            (``"model."`` for torch's ``{"model": ..., "optim": ...}`` from ``get_state_dict`` and torchtitan's
            ``model``), found by :func:`mark_training_layout`; ``oarlock convert --to hf`` strips it (``inspect``
            shows it). None when there is none. Not written to ``metadata.json``.
    """

    format: str
    tensors: dict[str, TensorMeta] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    nested: dict[str, list] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    save_id: str | None = None
    optimizer_keys: list[str] = field(default_factory=list)
    non_model_keys: list[str] = field(default_factory=list)
    model_prefix: str | None = None

    @property
    def files(self) -> list[str]:
        """Data files referenced by any shard, sorted."""
        out: set[str] = set()
        for t in self.tensors.values():
            out |= t.files()
        return sorted(out)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def packed_layout(self) -> PackedLayout:
        """Where the grid- and flat-recorded tensors lie in packed data files (:class:`PackedLayout`; built once
        and cached: edits of ``tensors`` after the first call are not seen)."""
        layout = self.__dict__.get("_packed")
        if layout is None:
            layout = self.__dict__["_packed"] = PackedLayout(
                [(k, t.global_shape, t.dtype, t.grid) for k, t in self.tensors.items() if t.grid is not None])
        return layout

    def to_json(self, compact: bool = True) -> dict[str, Any]:
        """The ``metadata.json`` object; ``compact=False`` lists every shard (the version 1 form, which every
        reader still accepts)."""
        d = {"format": FORMAT_NAME, "version": FORMAT_VERSION if compact else 1}
        if self.save_id is not None:
            d["save_id"] = self.save_id
        return {**d, "tensors": {k: t.to_json(compact) for k, t in self.tensors.items()},
                "objects": self.objects, "nested": self.nested, "extra": self.extra}

    def optimizer_state_keys(self) -> list[str]:
        """Tensor keys holding optimizer state rather than model weights, in stored order: ``<model key><suffix>``
        for a suffix of :data:`STATE_SUFFIXES` where ``<model key>`` is itself a stored tensor or a parameter listed
        in the saved ``optimizer.param_groups``, and the keys a foreign format's reader marked
        (:attr:`optimizer_keys`). A model key that merely ends like a suffix is not included (its base key is
        neither stored nor a listed parameter)."""
        marked = set(self.optimizer_keys)
        params: set[str] = set(self.tensors)
        groups = self.objects.get(PARAM_GROUPS_KEY)
        if isinstance(groups, list):
            for g in groups:
                if isinstance(g, dict) and isinstance(g.get("params"), list):
                    params.update(str(p) for p in g["params"])
        out = []
        for k in self.tensors:
            if k in marked or any(k.endswith(suf) and k[:-len(suf)] in params for suf in STATE_SUFFIXES):
                out.append(k)
        return out

    def filtered(self, include: Sequence[str] | None = None, exclude: Sequence[str] | None = None
                 ) -> "CheckpointMetadata":
        """A copy holding only the tensors and objects whose keys :func:`key_selected` keeps."""
        keep = {k: t for k, t in self.tensors.items() if key_selected(k, include, exclude)}
        objects = {k: v for k, v in self.objects.items() if key_selected(k, include, exclude)}
        return CheckpointMetadata(self.format, keep, objects, dict(self.nested), dict(self.extra),
                                  optimizer_keys=[k for k in self.optimizer_keys if k in keep],
                                  non_model_keys=[k for k in self.non_model_keys if k in keep or k in objects],
                                  model_prefix=self.model_prefix)

    def dumps(self, compact: bool = True) -> str:
        """``metadata.json`` text (see :meth:`to_json`): one line per tensor record and per data file's checksums,
        so the file stays readable and its size follows the number of tensors and files, not indentation."""
        d = self.to_json(compact)

        def one(v: Any) -> str:
            return json.dumps(v, separators=(",", ":"))

        def lines(mapping: dict, indent: str) -> str:
            if not mapping:
                return "{}"
            body = ",\n".join(f"{indent} {json.dumps(k)}: {one(v)}" for k, v in mapping.items())
            return "{\n" + body + "\n" + indent + "}"

        parts = []
        for k, v in d.items():
            if k == "tensors":
                text = lines(v, " ")
            elif k == "extra" and isinstance(v, dict) and isinstance(v.get("checksums"), dict) \
                    and isinstance(v["checksums"].get("files"), dict):
                sums = dict(v["checksums"])
                files = sums.pop("files")
                rest = {x: y for x, y in v.items() if x != "checksums"}
                head = ", ".join(f"{json.dumps(x)}: {one(y)}" for x, y in sums.items())
                text = ("{" + "".join(f"{json.dumps(x)}: {one(y)}, " for x, y in rest.items())
                        + '"checksums": {' + head + (", " if head else "") + '"files": ' + lines(files, "  ") + "}}")
            else:
                text = one(v)
            parts.append(f" {json.dumps(k)}: {text}")
        return "{\n" + ",\n".join(parts) + "\n}\n"

    @classmethod
    def from_json(cls, d: dict[str, Any], *, source: str = METADATA_FILE) -> "CheckpointMetadata":
        """Parse oarlock's ``metadata.json`` content; raises :class:`CheckpointFormatError` naming ``source``
        and the key at fault on any malformed entry."""
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            raise CheckpointFormatError(f"{source}: not an oarlock checkpoint metadata file "
                                        f"(expected \"format\": \"{FORMAT_NAME}\")")
        if d.get("version") not in READABLE_VERSIONS:
            raise CheckpointFormatError(f"{source}: unsupported metadata version {d.get('version')!r} "
                                        f"(this oarlock reads versions {', '.join(map(str, READABLE_VERSIONS))})")
        save_id = d.get("save_id")
        if save_id is not None and not isinstance(save_id, str):
            raise CheckpointFormatError(f"{source}: \"save_id\" must be a string, found {save_id!r}")
        try:
            meta = cls("oarlock", objects=dict(d.get("objects", {})), nested=dict(d.get("nested", {})),
                       extra=dict(d.get("extra", {})), save_id=save_id)
            tensors = dict(d.get("tensors", {}))
        except (TypeError, ValueError) as e:
            raise CheckpointFormatError(f"{source}: malformed metadata: {e}") from None
        for key, t in tensors.items():
            try:
                gshape = tuple(int(x) for x in t["global_shape"])
                if any(n < 0 for n in gshape):
                    raise ValueError(f"negative global shape {list(gshape)}")
                if sum(f in t for f in ("grid", "flat", "shards")) != 1:
                    raise ValueError("an entry needs exactly one of \"grid\", \"flat\" and \"shards\"")
                if "flat" in t:
                    tm = TensorMeta(key, gshape, dtype_name(t["dtype"]),
                                    grid=FlatGrid.from_json(t["flat"], gshape, f"{source}: key {key!r}"))
                elif "grid" in t:
                    grid = GridLayout.from_json(t["grid"], len(gshape), f"{source}: key {key!r}")
                    tm = TensorMeta(key, gshape, dtype_name(t["dtype"]), grid=grid)
                else:
                    tm = TensorMeta(key, gshape, dtype_name(t["dtype"]), [ShardMeta.from_json(s) for s in t["shards"]])
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise CheckpointFormatError(f"{source}: malformed entry for key {key!r}: {e}") from None
            meta.tensors[key] = tm
        marked = meta.extra.get(OPTIMIZER_KEYS_EXTRA)  # written by a conversion from a foreign training checkpoint
        if isinstance(marked, list):
            meta.optimizer_keys = [str(k) for k in marked if str(k) in meta.tensors]
        return meta


#: ``extra`` entry of an oarlock checkpoint converted from a foreign training checkpoint: the tensor keys its
#: reader marked as optimizer state (:attr:`CheckpointMetadata.optimizer_keys`), so that a later ``--to hf``
#: leaves them out too.
OPTIMIZER_KEYS_EXTRA = "optimizer_keys"


def key_selected(key: str, include: Sequence[str] | str | None = None, exclude: Sequence[str] | str | None = None
                 ) -> bool:
    """Whether ``key`` passes the filters: it matches one of the ``include`` glob patterns (``fnmatch`` syntax,
    case-sensitive; None or empty = every key) and none of the ``exclude`` patterns. A single pattern may be
    given as a string. Used by ``oarlock inspect/convert/diff --include/--exclude``."""
    inc = [include] if isinstance(include, str) else list(include or ())
    exc = [exclude] if isinstance(exclude, str) else list(exclude or ())
    if inc and not any(fnmatch.fnmatchcase(key, p) for p in inc):
        return False
    return not any(fnmatch.fnmatchcase(key, p) for p in exc)


#: Top-level entries of a training-state checkpoint holding optimizer state: torch's ``get_state_dict`` /
#: ``optim.state_dict()`` saved under ``optim`` (the ``Stateful`` convention) or ``optimizer`` (torchtitan).
OPTIMIZER_WRAPPERS = ("optim", "optimizer")
#: Top-level entries of torchtitan's checkpoint that are records of the run, not weights.
RUN_RECORD_WRAPPERS = ("lr_scheduler", "dataloader", "train_state")
#: Formats whose keys are a nested state dict flattened with dots: the only ones given a model prefix.
WRAPPED_FORMATS = ("oarlock", "dcp")
#: Top-level entry names tried, in this order, as the wrapper of the model weights.
MODEL_WRAPPERS = ("model",)


def _under(key: str, wrapper: str) -> bool:
    return key == wrapper or key.startswith(wrapper + ".")


def mark_training_layout(meta: CheckpointMetadata) -> CheckpointMetadata:
    """Recognise torch's training-state layout in ``meta`` (any format) and mark it, in place:

    * tensors under ``optim.state.`` / ``optimizer.state.`` (torch ``{"state": {fqn: {"exp_avg", ...}}}``
      flattened) join :attr:`~CheckpointMetadata.optimizer_keys`;
    * entries (tensors or objects) under ``optim.param_groups`` / ``optimizer.param_groups`` and torchtitan's
      ``lr_scheduler``, ``dataloader`` and ``train_state`` join :attr:`~CheckpointMetadata.non_model_keys`;
    * torch's flattened optimizer state merged with the model's keys (``state.<fqn>.<state>`` where ``<fqn>`` is a
      stored tensor, beside ``param_groups``) is marked the same way (no prefix: the model's keys are its own);
    * in a checkpoint saved from a nested state dict (oarlock's own and torch DCP: :data:`WRAPPED_FORMATS`) that
      holds torch's optimizer entries (``optim.state.*``, ``optim.param_groups``, ``optimizer.state.*``) or
      torchtitan's, when every remaining tensor key starts with ``model.``,
      :attr:`~CheckpointMetadata.model_prefix` becomes ``"model."`` (an HF export strips it);
    * the same without such entries when the recorded nesting (:attr:`~CheckpointMetadata.nested`) shows every
      tensor saved inside a ``"model"`` dict: ``{"model": model.state_dict(), "step": 100}``.

    A checkpoint without any such entry or nesting keeps its keys (a flat state dict whose every key starts with
    ``model.``, e.g. an HF Llama with tied embeddings; oarlock's own optimizer checkpoint, whose
    ``optimizer.param_groups`` alone is marked); DeepSpeed's and Megatron-Core's names are the model's own and get
    no prefix. Returns ``meta``."""
    marked_opt = set(meta.optimizer_keys)
    marked = set(meta.non_model_keys)
    found = False
    for k in meta.tensors:
        if k in marked_opt or k in marked:
            continue
        if any(k.startswith(w + ".state.") for w in OPTIMIZER_WRAPPERS):
            meta.optimizer_keys.append(k)
            marked_opt.add(k)
            found = True
    for k in (*meta.tensors, *meta.objects):
        if k in marked_opt or k in marked:
            continue
        if any(_under(k, w + ".param_groups") for w in OPTIMIZER_WRAPPERS) \
                or any(_under(k, w) for w in RUN_RECORD_WRAPPERS):
            meta.non_model_keys.append(k)
            marked.add(k)
            # oarlock's own optimizer checkpoint stores optimizer.param_groups beside <model key>.exp_avg tensors
            found = found or not _under(k, PARAM_GROUPS_KEY)
    # torch's flattened optimizer state (StateDictOptions(flatten_optimizer_state_dict=True)) merged with the
    # model's keys at the top level: state.<fqn>.<state> for a stored <fqn>, and its param_groups records
    flat_state = [k for k in meta.tensors if k.startswith("state.") and k not in marked_opt and k not in marked
                  and any(k.endswith(s) and k[len("state."):-len(s)] in meta.tensors for s in STATE_SUFFIXES)]
    if flat_state:
        meta.optimizer_keys += flat_state
        marked_opt.update(flat_state)
        groups = [k for k in (*meta.tensors, *meta.objects) if _under(k, "param_groups") and k not in marked]
        meta.non_model_keys += groups
        marked.update(groups)
    if meta.model_prefix is None and meta.format in WRAPPED_FORMATS:
        rest = [k for k in meta.tensors if k not in marked_opt and k not in marked]
        for w in MODEL_WRAPPERS:
            if not rest or not all(k.startswith(w + ".") for k in rest):
                continue
            # without training entries beside, only when the recorded nesting shows ``w`` was a dict of the saved
            # state ({"model": model.state_dict(), "step": 100}), not the first part of the model's own names
            if found or all(_nested_under(meta.nested.get(k), w) for k in rest):
                meta.model_prefix = w + "."
                break
    return meta


def _nested_under(path: Any, wrapper: str) -> bool:
    """Whether a recorded nesting ``path`` (:attr:`CheckpointMetadata.nested`) starts inside dict ``wrapper``."""
    return isinstance(path, (list, tuple)) and len(path) > 1 and path[0] == wrapper
