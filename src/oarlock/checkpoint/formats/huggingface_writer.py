"""Writing HuggingFace-layout checkpoints: ``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``.

The index format (HF convention, ``docs/checkpoint-format.md``): ``{"metadata": {"total_size": bytes},
"weight_map": {key: file}}``. A single-shard export is written as ``model.safetensors`` without an index, as
``save_pretrained`` does. Tensors arrive one at a time from an iterator and leave memory as soon as their shard
is written, so peak memory is bounded by ``max_shard_size`` plus the largest tensor, never the model size.
The directory appears only when complete: everything is written into a hidden temporary sibling, fsynced, and
renamed into place.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from oarlock.checkpoint.errors import CheckpointError
from oarlock.checkpoint.formats.huggingface import HF_INDEX, HF_SINGLE
from oarlock.checkpoint.storage.safetensors import RESERVED_NAME, write_safetensors
from oarlock.checkpoint.storage import (check_destination, copy_file, location, publish_directory, rename_within,
                                        staged_directory)
from oarlock.utils import progress

__all__ = ["HF_INDEX", "HF_SINGLE", "hf_config_text", "hf_shard_names", "parse_size", "reserved_hf_key_message", "save_hf_checkpoint",
           "write_hf_index"]

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like ``"5GB"``, ``"500MiB"`` (HF's decimal/binary unit names)."""
    if isinstance(size, int):
        if size <= 0:
            raise CheckpointError(f"max_shard_size must be positive, got {size}")
        return size
    s = str(size).strip().upper().replace(" ", "")
    for unit in sorted(_UNITS, key=len, reverse=True):
        if s.endswith(unit):
            try:
                return parse_size(int(float(s[: -len(unit)]) * _UNITS[unit]))
            except ValueError:
                break
    raise CheckpointError(f"cannot parse max_shard_size {size!r} (use bytes or e.g. '5GB', '500MiB')")


def hf_shard_names(n: int) -> list[str]:
    """File names of an export in ``n`` files: ``model.safetensors`` alone, else ``model-0000i-of-0000N``."""
    return [HF_SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_hf_index(directory: Path, weight_map: Mapping[str, str], total_size: int) -> None:
    """Write ``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {key: file}}``)."""
    (directory / HF_INDEX).write_text(json.dumps({"metadata": {"total_size": total_size},
                                                  "weight_map": dict(weight_map)}, indent=2))


def reserved_hf_key_message() -> str:
    """Why a key named ``__metadata__`` cannot go into a HuggingFace directory, and what to do instead."""
    return (f"key {RESERVED_NAME!r}: a HuggingFace checkpoint stores each tensor under its key, and safetensors "
            "reserves this name for the header's metadata block; rename it for the export (an AOA statement "
            f"`{RESERVED_NAME} -> NEW_NAME`) or leave it out (--exclude {RESERVED_NAME})")


def hf_config_text(config: Any) -> str:
    """The ``config.json`` text of an HF model config: a mapping (written as JSON) or a transformers
    ``PretrainedConfig`` (its own ``to_json_string()``, the text ``save_pretrained`` writes).

    Raises:
        CheckpointError: anything else, or a mapping that is not JSON-serialisable (naming the type).
    """
    if isinstance(config, Mapping):
        try:
            return json.dumps(dict(config), indent=2, sort_keys=True) + "\n"
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"config: not JSON-serialisable ({e})") from None
    if callable(getattr(config, "to_json_string", None)):
        return config.to_json_string()
    raise CheckpointError(f"config: expected a dict or a transformers PretrainedConfig, got {type(config).__name__}")


def save_hf_checkpoint(tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path, *,
                       max_shard_size: int | str = "5GB", total: int | None = None,
                       show_progress: bool | None = None,
                       extra_files: Mapping[str, str | os.PathLike] | None = None, overwrite: bool = False,
                       config: Any = None) -> Path:
    """Stream ``(key, full_tensor)`` pairs into a HuggingFace safetensors directory.

    Args:
        tensors: pairs in the order they should be written; each tensor is any dtype/device (copied to CPU).
        out_dir: the directory to create. An existing HF checkpoint there holding only files oarlock wrote is
            replaced atomically once the new one is complete; anything else is refused (see ``overwrite``).
        overwrite: write into ``out_dir`` even when it holds entries oarlock did not write; they are kept, only
            files oarlock wrote are replaced.
        max_shard_size: bytes per shard file (int or ``"5GB"``-style string); a tensor larger than this gets a
            shard of its own.
        total: number of tensors, for the progress bar only.
        extra_files: ``{name: path}`` of side files (``config.json``, tokenizer files) copied into the directory
            before it is published.
        config: the model's HF config (a dict or a transformers ``PretrainedConfig``, see
            :func:`hf_config_text`), written as ``config.json`` (None: no ``config.json`` unless ``extra_files``
            has one).

    Returns the directory.

    Raises:
        CheckpointError: a key seen twice or named ``__metadata__`` (:func:`reserved_hf_key_message`), an extra
            file named like a checkpoint file (nothing is published).
        CheckpointDestinationError: ``out_dir`` refused by
            :func:`~oarlock.checkpoint.storage.check_destination` (nothing is written).
    """
    out_dir = location(out_dir)  # a local directory or an s3:// prefix (other schemes refused)
    limit = parse_size(max_shard_size)
    config_text = hf_config_text(config) if config is not None else None  # a bad config fails before writing
    check_destination(out_dir, "huggingface", overwrite=overwrite)
    with staged_directory(out_dir) as tmp:
        shards: list[list[str]] = []
        pending: dict[str, torch.Tensor] = {}
        pending_bytes = 0
        total_size = 0
        seen: set[str] = set()

        def flush() -> None:
            nonlocal pending, pending_bytes
            if pending:
                write_safetensors(tmp / f"shard-{len(shards):05d}.safetensors", pending)
                shards.append(list(pending))
                pending, pending_bytes = {}, 0

        for key, t in progress(tensors, desc="export", total=total, disable=show_progress is False or None):
            if key in seen:
                raise CheckpointError(f"tensor {key!r} was produced twice for the HF export")
            if key == RESERVED_NAME:
                raise CheckpointError(reserved_hf_key_message())
            seen.add(key)
            nbytes = t.numel() * t.element_size()
            if pending and pending_bytes + nbytes > limit:
                flush()
            t = t.detach()
            pending[key] = t if t.device.type == "cpu" else t.to("cpu")  # device memory is not held until flush
            pending_bytes += nbytes
            total_size += nbytes
        flush()
        names = hf_shard_names(len(shards)) if shards else []
        weight_map = {}
        for i, (name, keys) in enumerate(zip(names, shards)):
            rename_within(tmp, f"shard-{i:05d}.safetensors", name)
            weight_map.update({k: name for k in keys})
        if len(shards) > 1:
            write_hf_index(tmp, weight_map, total_size)
        for name, src in (extra_files or {}).items():
            if name in (HF_INDEX, HF_SINGLE) or name.startswith("model-"):
                raise CheckpointError(f"extra file {name!r} would overwrite a checkpoint file of the export")
            copy_file(src, tmp / name)
        if config_text is not None:
            (tmp / "config.json").write_text(config_text)
        publish_directory(tmp, out_dir, overwrite=overwrite)
    return out_dir
