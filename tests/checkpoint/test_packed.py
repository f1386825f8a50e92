"""Packed data files (docs/checkpoint-format.md, "Data files"): a save of DTensors writes each rank's grid pieces
into one ``oarlock.packed`` entry, in key order; the bytes are checked against pieces cut independently with
torch.chunk, hostile edits are refused naming the file, and a version-2 checkpoint written before the change
still loads bit-exact."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from oarlock.checkpoint import load_state_dict
from oarlock.checkpoint.errors import CheckpointFormatError

FIXTURES = Path(__file__).with_name("fixtures")
sys.path.insert(0, str(FIXTURES))
import make_v2_grid  # noqa: E402  (the fixture's generator: the state both checkpoints hold)


@pytest.fixture(scope="module")
def packed_ckpt(tmp_path_factory) -> Path:
    """The fixture generator's state saved by the current version on 2 gloo ranks."""
    out = tmp_path_factory.mktemp("packed") / "ck"
    subprocess.run([sys.executable, str(FIXTURES / "make_v2_grid.py"), str(out)], check=True, timeout=300)
    return out


def _zeros() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(t) for k, t in make_v2_grid.values().items()}


def test_packed_save_loads_bit_exact_and_has_one_entry_per_file(packed_ckpt):
    meta = json.loads((packed_ckpt / "metadata.json").read_text())
    assert meta["version"] == 4
    for f in ("rank-00000.safetensors", "rank-00001.safetensors"):
        with safe_open(str(packed_ckpt / f), "pt") as fh:  # still a valid safetensors file
            names = set(fh.keys())
        # the DTensors (w, b, rep) are packed; the ShardedWeight and the plain tensor keep named entries
        assert "oarlock.packed" in names and not names & {"w", "b", "rep"}, (f, names)
    got = _zeros()
    load_state_dict(got, packed_ckpt)
    want = make_v2_grid.values()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_packed_entry_holds_the_pieces_in_key_order(packed_ckpt):
    """The documented layout, recomputed without oarlock: per rank, the rank's torch.chunk piece of each DTensor,
    in code-point order of the keys, back to back; the replicated tensor is in the file of the replica that the
    rotation (CRC-32 of the key) picks."""
    v = make_v2_grid.values()
    rep_writer = zlib.crc32(b"rep") % 2
    for rank in (0, 1):
        pieces = {"w": torch.chunk(v["w"], 2, dim=0)[rank], "b": torch.chunk(v["b"], 2, dim=0)[rank]}
        if rank == rep_writer:
            pieces["rep"] = v["rep"]
        want = b"".join(pieces[k].contiguous().numpy().tobytes() for k in sorted(pieces))
        with safe_open(str(packed_ckpt / f"rank-{rank:05d}.safetensors"), "pt") as fh:
            blob = fh.get_tensor("oarlock.packed")
        assert blob.dtype == torch.uint8 and blob.numpy().tobytes() == want, rank


def test_a_grid_record_edited_to_another_layout_is_refused_naming_the_file(packed_ckpt, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(packed_ckpt, ck)
    meta = json.loads((ck / "metadata.json").read_text())
    meta["tensors"]["w"]["dtype"] = "float64"  # the pieces the records give no longer fill the packed entries
    (ck / "metadata.json").write_text(json.dumps(meta))
    got = _zeros()
    got["w"] = got["w"].double()
    with pytest.raises(CheckpointFormatError, match=r"rank-0000[01]\.safetensors: the packed entry 'oarlock.packed' "
                                                    r"holds \d+ bytes, but the metadata's grid records give"):
        load_state_dict(got, ck)
    assert all(not t.any() for t in got.values()), "a target was written before the error"


def test_a_version_2_checkpoint_still_loads_bit_exact():
    """Written by the version before packed files (tests/checkpoint/fixtures/v2-grid, by make_v2_grid.py)."""
    assert json.loads((FIXTURES / "v2-grid" / "metadata.json").read_text())["version"] == 2
    got = _zeros()
    load_state_dict(got, FIXTURES / "v2-grid")
    want = make_v2_grid.values()
    for k in want:
        assert torch.equal(got[k], want[k]), k
