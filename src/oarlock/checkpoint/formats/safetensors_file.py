"""A lone ``.safetensors`` file: every tensor is one whole shard."""

from __future__ import annotations

from pathlib import Path

from oarlock.checkpoint.errors import CheckpointFormatError
from oarlock.checkpoint.model.metadata import CheckpointMetadata, ShardMeta, TensorMeta
from oarlock.checkpoint.formats.reader import CheckpointReader, checkpoint_file, register_format
from oarlock.checkpoint.storage.safetensors import safetensors_header


def whole_tensor_metadata(fmt: str, files: dict[str, Path], root: Path) -> CheckpointMetadata:
    """Metadata where every tensor of every safetensors file in ``files`` (name relative to ``root`` -> path) is
    one whole shard, files in the given order, tensors sorted by name within a file.

    Raises:
        CheckpointFormatError: an invalid file, or a tensor stored in two files (naming both).
    """
    meta = CheckpointMetadata(fmt)
    owner: dict[str, str] = {}
    for rel, p in files.items():
        if root.is_dir():
            checkpoint_file(root, rel, str(root))
        for name, (shape, dt) in safetensors_header(p).items():
            if name in owner:
                raise CheckpointFormatError(f"{root}: tensor {name!r} is stored twice, in {owner[name]} and {rel}")
            owner[name] = rel
            meta.tensors[name] = TensorMeta(name, shape, dt, [ShardMeta((0,) * len(shape), shape, rel, name)])
    return meta


@register_format
class SafetensorsFileReader(CheckpointReader):
    """Reader of one ``.safetensors`` file (the root is the file itself)."""

    format = "safetensors"
    priority = 3
    hint = "*.safetensors"

    @classmethod
    def claim(cls, path: Path, names: set[str] | None) -> int:
        return 2 if names is None and path.suffix == ".safetensors" else 0

    @classmethod
    def open(cls, path: Path, *, shipped: dict[str, bytes] | None = None, partial: bool = False
             ) -> "SafetensorsFileReader":
        return cls(path, whole_tensor_metadata("safetensors", {path.name: path}, path))
