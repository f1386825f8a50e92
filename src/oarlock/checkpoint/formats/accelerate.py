"""Hugging Face accelerate's FSDP ``save_state`` output with ``SHARDED_STATE_DICT`` (the default for FSDP2).

What ``Accelerator.save_state(output_dir)`` writes for an FSDP model (accelerate 1.x, ``accelerate.utils.fsdp_utils``;
see ``docs/foreign-formats.md``):

* ``pytorch_model_fsdp_<i>/``: a torch DCP directory (``.metadata`` + ``__<rank>_<j>.distcp``) of
  ``{"model": <model i's sharded state dict>}``, so every key reads ``model.<fqn>``;
* ``optimizer_<i>/``: a torch DCP directory of ``{"optimizer": <optimizer i's state dict>}`` (``get_optimizer_state_dict``:
  ``optimizer.state.<fqn>.exp_avg`` ..., ``optimizer.param_groups``);
* beside them pickles of the run (``random_states_<rank>.pkl``, ``scheduler.bin``, ``custom_checkpoint_<i>.pkl``),
  which oarlock never opens.

The reader presents model 0 and optimizer 0 as one checkpoint: the DCP reader
(:mod:`oarlock.checkpoint.formats.dcp`) reads each directory and their keys are merged (they cannot clash: one
starts with ``model.``, the other with ``optimizer.``); data file names carry their directory
(``pytorch_model_fsdp_0/__0_0.distcp``). The ``model.`` wrapper is the
:attr:`~oarlock.checkpoint.model.metadata.CheckpointMetadata.model_prefix` (an HF export strips it) and the optimizer
entries are marked as not model weights (:func:`~oarlock.checkpoint.model.metadata.mark_training_layout`). Further
models and optimizers (``pytorch_model_fsdp_1``, ``optimizer_1``, ...) are named in
``metadata.extra["accelerate"]["not_read"]``; open such a directory itself to read one of them. The metadata is
read from the sub-directories, so every rank must see them (a shared filesystem): nothing is shipped between
ranks for this format.
"""

from __future__ import annotations

import re
from pathlib import Path

from oarlock.checkpoint.errors import CheckpointFormatError
from oarlock.checkpoint.formats.dcp import DcpEntry, DcpReader, is_dcp_dir, parse_dcp_metadata, regroup_list_objects
from oarlock.checkpoint.model.metadata import CheckpointMetadata, ShardMeta
from oarlock.checkpoint.formats.reader import checkpoint_file, register_format
from oarlock.checkpoint.storage.files import list_names
from oarlock.checkpoint.storage.location import location

#: accelerate's directory names (``FSDP_MODEL_NAME`` and ``OPTIMIZER_NAME`` with the model / optimizer index).
MODEL_DIR = "pytorch_model_fsdp_0"
OPTIMIZER_DIR = "optimizer_0"
_OTHER = re.compile(r"^(pytorch_model_fsdp|optimizer)_(\d+)$")


def _dcp_subdir(path: Path, name: str) -> bool:
    try:
        return (path / name).is_dir() and is_dcp_dir(set(list_names(path / name)))
    except OSError:
        return False


@register_format
class AccelerateFsdpReader(DcpReader):
    """Reader of an accelerate FSDP ``save_state`` directory (see the module docstring): the DCP reader over
    ``pytorch_model_fsdp_0/`` and ``optimizer_0/`` together, under format name ``"accelerate"``."""

    format = "accelerate"
    priority = 1
    hint = "pytorch_model_fsdp_0/ + optimizer_0/ DCP directories (accelerate save_state)"
    metadata_files = ()

    @classmethod
    def claim(cls, path: Path, names: set[str] | None) -> int:
        return 2 if names is not None and MODEL_DIR in names and _dcp_subdir(path, MODEL_DIR) else 0

    @classmethod
    def open(cls, path: Path, *, shipped: dict[str, bytes] | None = None, partial: bool = False
             ) -> "AccelerateFsdpReader":
        path = location(path)
        meta = CheckpointMetadata(cls.format)
        entries: dict[tuple[str, str], DcpEntry] = {}
        objects: dict[str, DcpEntry] = {}
        read = []
        for sub in (MODEL_DIR, OPTIMIZER_DIR):
            if sub == OPTIMIZER_DIR and not (path / sub).exists():
                continue  # a model saved without an optimizer
            checkpoint_file(path, sub, f"{path}: accelerate directory")  # no symlink out of the checkpoint
            if not _dcp_subdir(path, sub):
                raise CheckpointFormatError(f"{path / sub}: not a torch DCP directory (no .metadata)")
            part, ents, objs = parse_dcp_metadata(path / sub, partial=partial, fmt=cls.format)
            for key, tm in part.tensors.items():
                if key in meta.tensors or key in meta.objects:
                    raise CheckpointFormatError(f"{path / sub}: key {key!r} is stored in {read[0]} too")
                tm.shards = [ShardMeta(s.global_offset, s.local_shape, f"{sub}/{s.file}", s.name) for s in tm.shards]
                meta.tensors[key] = tm
            entries.update({(f"{sub}/{f}", n): DcpEntry(f"{sub}/{e.file}", e.offset, e.length, e.transforms,
                                                        e.serialization) for (f, n), e in ents.items()})
            for key, e in objs.items():
                if key in meta.tensors or key in objects:
                    raise CheckpointFormatError(f"{path / sub}: key {key!r} is stored in {read[0]} too")
                objects[key] = DcpEntry(f"{sub}/{e.file}", e.offset, e.length, e.transforms, e.serialization)
            meta.nested.update(part.nested)
            meta.extra[f"dcp:{sub}"] = part.extra["dcp"]
            read.append(sub)
        reader = cls(path, meta, entries)
        values, refused = reader.load_objects(objects)
        meta.objects.update(values)
        meta.extra["dcp"] = {"refused_objects": refused}
        regroup_list_objects(meta)
        others = sorted(n for n in list_names(path) if _OTHER.match(n) and n not in read and (path / n).is_dir())
        meta.extra["accelerate"] = {"read": read, "not_read": others}
        rest = [k for k in meta.tensors if not k.startswith("optimizer.")]
        if rest and all(k.startswith("model.") for k in rest):
            meta.model_prefix = "model."  # accelerate saves {"model": state_dict}
        return reader

