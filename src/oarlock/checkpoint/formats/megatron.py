"""Megatron-Core distributed checkpoints (``megatron.core.dist_checkpointing``) with the ``torch_dist`` backend.

On disk (Megatron-Core 0.x, see ``docs/foreign-formats.md``):

* ``metadata.json``: ``{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
  ...}``: what identifies the format;
* ``.metadata`` + ``__{rank}_{i}.distcp``: a torch DCP checkpoint (read by :mod:`oarlock.checkpoint.formats.dcp`)
  of the tensors under their Megatron keys. Per-layer tensors are stacked on a leading layer axis
  (``decoder.layers.self_attention.linear_qkv.weight`` has global shape ``[num_layers, ...]``, one chunk per
  layer and tensor-parallel rank), ``linear_fc1`` is saved as separate gate and up chunks of one key, and the
  vocabulary of ``embedding.word_embeddings.weight`` / ``output_layer.weight`` is padded to a multiple of the
  TP degree times ``make_vocab_size_divisible_by``. Megatron also pickles its save plans into ``.metadata``
  (``all_local_plans``); they are admitted as inert records and ignored;
* ``common.pt``: the non-sharded values (``iteration``, ``checkpoint_version``, ``args`` as an
  ``argparse.Namespace``, ...), a ``torch.save`` archive loaded with ``torch.load(weights_only=True)``, where
  ``argparse.Namespace`` is admitted as plain data (its attribute dict). Its top-level values become
  ``metadata.objects`` under ``common.<name>``; a ``common.pt`` a weights-only load refuses is reported in
  ``metadata.extra["megatron"]["common_error"]`` and nothing in it runs.

A training checkpoint also holds the optimizer state (``optimizer.state.<state>.<param key>`` tensors) and
records of the run (``common.*`` values, the layers' ``*._extra_state*`` objects): the reader marks them
(``metadata.optimizer_keys`` / ``metadata.non_model_keys``, see :func:`mark_entries`), so an HF export holds the
model weights only by default and a strict ``model_only=True`` load needs no ``ignore_unexpected`` globs.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import Any

import torch

from oarlock.checkpoint.errors import CheckpointFormatError
from oarlock.checkpoint.formats.dcp import MEGATRON_METADATA, DcpReader, is_dcp_dir
from oarlock.checkpoint.model.metadata import CheckpointMetadata
from oarlock.checkpoint.formats.reader import checkpoint_file, load_weights_only, register_format
from oarlock.checkpoint.storage import open_read

COMMON_FILE = "common.pt"


class MegatronNamespace:
    """Inert stand-in for ``argparse.Namespace`` in ``common.pt``: its pickled attribute dict, nothing else."""

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise CheckpointFormatError(f"argparse.Namespace with state of type {type(state).__name__}")
        self.__dict__.update(state)


def _plain(v: Any) -> Any:
    """Namespaces -> dicts, tuples -> lists, dtypes -> names, recursively (JSON-like values for metadata)."""
    if isinstance(v, MegatronNamespace):
        v = dict(v.__dict__)
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    return v


def read_common(path: Path) -> tuple[dict[str, Any], str | None]:
    """The values of ``common.pt`` (``{name: value}``, JSON-like) and None, or ``({}, reason)`` when the file is
    absent or refused by a weights-only load (never unpickled with anything else)."""
    if not path.is_file():
        return {}, None
    try:
        with open_read(path) as f:  # through the storage layer
            raw = load_weights_only(f, path, "weights-only loadable common.pt",
                                    safe_globals=[(MegatronNamespace, "argparse.Namespace")])
    except OSError as e:
        return {}, f"{path}: cannot read: {e.strerror or e}"
    except CheckpointFormatError as e:
        return {}, str(e)
    if not isinstance(raw, dict):
        return {}, f"{path}: holds a {type(raw).__name__}, expected a dict"
    out = {}
    for k, v in raw.items():
        if isinstance(v, torch.Tensor):
            continue  # tensors in common.pt (rng states) are not model weights
        out[str(k)] = _plain(v)
    return out, None


def megatron_backend(path: Path) -> dict[str, Any] | None:
    """The parsed ``metadata.json`` of a Megatron-Core checkpoint directory, or None if it is not one."""
    try:
        raw = json.loads(checkpoint_file(path, MEGATRON_METADATA, MEGATRON_METADATA).read_text())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError, CheckpointFormatError):
        return None
    return raw if isinstance(raw, dict) and "sharded_backend" in raw else None


@register_format
class MegatronReader(DcpReader):
    """Reader of Megatron-Core ``torch_dist`` checkpoints: the DCP reader under format name ``"megatron"``,
    plus ``common.pt`` values and the backend record in ``metadata.extra["megatron"]``."""

    format = "megatron"
    priority = 1
    hint = "metadata.json with sharded_backend (Megatron-Core)"
    metadata_files = (".metadata", MEGATRON_METADATA)

    @classmethod
    def claim(cls, path: Path, names: set[str] | None) -> int:
        return 2 if names is not None and MEGATRON_METADATA in names and megatron_backend(path) else 0

    @classmethod
    def open(cls, path: Path, *, shipped: dict[str, bytes] | None = None, partial: bool = False
             ) -> "MegatronReader":
        backend = megatron_backend(path)
        if backend is None and shipped and MEGATRON_METADATA in shipped:
            backend = json.loads(shipped[MEGATRON_METADATA])
        if backend is None:
            raise CheckpointFormatError(f"{path / MEGATRON_METADATA}: not a Megatron-Core metadata file")
        if backend.get("sharded_backend") != "torch_dist":
            raise CheckpointFormatError(f"{path}: Megatron-Core sharded_backend {backend.get('sharded_backend')!r} "
                                        "is not supported (oarlock reads 'torch_dist')")
        if not (shipped and ".metadata" in shipped) and not is_dcp_dir(_listing(path)):
            raise CheckpointFormatError(f"{path}: Megatron-Core torch_dist checkpoint without its DCP .metadata file")
        reader = cls.open_as(path, shipped=shipped, partial=partial, fmt=cls.format)
        common, err = read_common(checkpoint_file(path, COMMON_FILE, f"{path}: Megatron-Core common values"))
        for k, v in common.items():
            reader.metadata.objects[f"common.{k}"] = v
        reader.metadata.extra["megatron"] = {"backend": backend, "common_error": err}
        mark_entries(reader.metadata)
        return reader


#: Key prefix of Megatron-Core's optimizer tensors: ``optimizer.state.<state>.<param key>`` (``exp_avg``,
#: ``exp_avg_sq``, ``fp32_param``, ...) and the distributed optimizer's ``optimizer.distributed.*`` buffers.
OPTIMIZER_PREFIX = "optimizer."
#: Entries that are records of the training run, not model weights: the ``common.pt`` values, the layers'
#: ``_extra_state`` objects (``<module>._extra_state/shard_<i>_<n>``, e.g. FP8 scaling records) and RNG states.
NON_MODEL_GLOBS = ("common.*", "*._extra_state*", "rng_state*")


def mark_entries(meta: CheckpointMetadata) -> None:
    """Mark ``meta``'s optimizer tensors (``meta.optimizer_keys``, :data:`OPTIMIZER_PREFIX`) and training-run
    records (``meta.non_model_keys``, :data:`NON_MODEL_GLOBS`), so that ``oarlock convert --to hf`` exports model
    weights only by default and ``load_state_dict(..., strict=True, model_only=True)`` loads a model from the
    checkpoint without listing them."""
    meta.optimizer_keys = [k for k in meta.tensors if k.startswith(OPTIMIZER_PREFIX)]
    opt = set(meta.optimizer_keys)
    meta.non_model_keys = [k for k in (*meta.tensors, *meta.objects)
                           if k not in opt and (k.startswith(OPTIMIZER_PREFIX)
                                                or any(fnmatch.fnmatchcase(k, g) for g in NON_MODEL_GLOBS))]


def _listing(path: Path) -> set[str]:
    try:
        return {p.name for p in path.iterdir()}
    except OSError:
        return set()
