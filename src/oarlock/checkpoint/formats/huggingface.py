"""HuggingFace directories: ``model.safetensors``, or shards listed by ``model.safetensors.index.json``
(``{"metadata": {...}, "weight_map": {key: file}}``), or just ``*.safetensors`` files. Every tensor is one
whole shard; the metadata comes from the files' headers."""

from __future__ import annotations

from pathlib import Path

from oarlock.checkpoint.errors import CheckpointFormatError
from oarlock.checkpoint.model.metadata import parse_json
from oarlock.checkpoint.formats.safetensors_file import whole_tensor_metadata
from oarlock.checkpoint.formats.reader import CheckpointReader, checkpoint_file, register_format
from oarlock.checkpoint.storage.files import list_names

HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"
PADDLE_HF_CACHE = "flex-ckpt.auto_generated.metadata"  # Paddle writes this into HF dirs it has loaded


@register_format
class HuggingFaceReader(CheckpointReader):
    """Reader of HuggingFace safetensors directories."""

    format = "huggingface"
    priority = 2
    hint = f"{HF_INDEX} or *.safetensors"

    @classmethod
    def claim(cls, path: Path, names: set[str] | None) -> int:
        if names is None:
            return 0
        if HF_INDEX in names or HF_SINGLE in names:
            return 2
        return 1 if any(n.endswith(".safetensors") for n in names) else 0

    @classmethod
    def open(cls, path: Path, *, shipped: dict[str, bytes] | None = None, partial: bool = False
             ) -> "HuggingFaceReader":
        root = path
        index_path = root / HF_INDEX
        if not index_path.exists():
            files = {n: root / n for n in sorted(list_names(root)) if n.endswith(".safetensors")}
            return cls(root, whole_tensor_metadata("huggingface", files, root))
        try:
            index = parse_json(checkpoint_file(root, HF_INDEX, str(root)).read_bytes(), str(index_path))
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, KeyError, TypeError) as e:
            raise CheckpointFormatError(f"{index_path}: invalid index: {e}") from None
        files = {}
        for key, f in weight_map.items():
            checkpoint_file(root, f, f"{index_path}: tensor {key!r}")
            if not (root / f).is_file():
                raise CheckpointFormatError(f"{index_path}: tensor {key!r} is mapped to {f}, which does not exist")
            files[f] = root / f
        meta = whole_tensor_metadata("huggingface", dict(sorted(files.items())), root)
        for key, f in weight_map.items():
            t = meta.tensors.get(key)
            if t is None:
                raise CheckpointFormatError(f"{index_path}: tensor {key!r} is mapped to {f}, which does not hold it")
            if t.shards[0].file != f:
                raise CheckpointFormatError(f"{index_path}: tensor {key!r} is mapped to {f} but stored in "
                                            f"{t.shards[0].file}")
        meta.extra["index_metadata"] = index.get("metadata", {})
        return cls(root, meta)
