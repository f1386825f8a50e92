"""The reader protocol: a format is one reader class registered by name; detection, mixing and the base
class's safetensors reads work for any registered format."""

import json
from pathlib import Path

import pytest
import torch

from oarlock.checkpoint import CheckpointFormatError, load_state_dict, open_checkpoint, save_state_dict
from oarlock.checkpoint.formats import load_formats
from oarlock.checkpoint.model.metadata import CheckpointMetadata, ShardMeta, TensorMeta
from oarlock.checkpoint.formats.reader import CheckpointReader, register_format, unregister_format
from oarlock.checkpoint.storage.safetensors import write_safetensors


class ToyReader(CheckpointReader):
    """A made-up format: ``toy.json`` names one safetensors file holding the rows of ``w`` in two halves."""

    format = "toy-test"
    hint = "toy.json"

    @classmethod
    def claim(cls, path, names):
        return 2 if names is not None and "toy.json" in names else 0

    @classmethod
    def open(cls, path, *, shipped=None, partial=False):
        spec = json.loads((Path(path) / "toy.json").read_text())
        rows, cols = spec["shape"]
        half = rows // 2
        shards = [ShardMeta((0, 0), (half, cols), spec["file"], "top"),
                  ShardMeta((half, 0), (rows - half, cols), spec["file"], "bottom")]
        meta = CheckpointMetadata(cls.format, tensors={"w": TensorMeta("w", (rows, cols), "float32", shards)})
        return cls(Path(path), meta)


@pytest.fixture
def toy(tmp_path):
    register_format(ToyReader)
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    d = tmp_path / "toy"
    d.mkdir()
    write_safetensors(d / "data.safetensors", {"top": full[:3].clone(), "bottom": full[3:].clone()})
    (d / "toy.json").write_text(json.dumps({"shape": [6, 4], "file": "data.safetensors"}))
    yield d, full
    unregister_format(ToyReader.format)


def test_a_registered_format_is_detected_and_loads_through_the_planner(toy):
    d, full = toy
    with open_checkpoint(d) as r:
        assert type(r) is ToyReader and r.metadata.format == "toy-test"
        assert r.visible_files() == {"data.safetensors"}
    t = torch.zeros(4, 3)  # a box across both stored halves
    from oarlock.checkpoint import ShardedWeight

    load_state_dict({"w": ShardedWeight("w", t, (4, 3), (6, 4), (1, 1))}, d)
    assert torch.equal(t, full[1:5, 1:4])


def test_two_formats_claiming_one_directory_is_an_error(toy, tmp_path):
    d, _ = toy
    save_state_dict({"x": torch.ones(2)}, tmp_path / "ck")
    (d / "metadata.json").write_text((tmp_path / "ck" / "metadata.json").read_text())
    with pytest.raises(CheckpointFormatError, match="mixes checkpoint formats .*oarlock.*toy-test"):
        open_checkpoint(d)


def test_builtin_formats_are_registered_by_their_modules():
    assert {"oarlock", "paddle", "huggingface", "safetensors"} <= set(load_formats())
