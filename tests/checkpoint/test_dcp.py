"""torch.distributed.checkpoint (DCP) directories written by the real ``dcp.save`` on 4 gloo ranks, read by oarlock.

The fixtures (see _dcp_worker.py) are an FSDP2 HF-Llama model + AdamW state from ``get_state_dict`` in the three
serialisations torch 2.13 writes (torch.save archives, embedded safetensors, zstd-compressed archives), DTensors
on a 2x2 mesh, a ShardedTensor with two chunks of one key per rank, and a checkpoint saved by a 2-rank subgroup.
Values are compared bit for bit with the writer's own full tensors.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import socket
import warnings
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import _dcp_worker as W
from oarlock.checkpoint.dcp import DcpDataFiles, load_dcp_pickle, parse_dcp_metadata, read_dcp_objects
from oarlock.checkpoint.errors import CheckpointFormatError, UnsafePickleError

pytestmark = pytest.mark.multiproc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mp.start_processes(W.run, args=(4, _free_port(), str(root)), nprocs=4, start_method="spawn", join=True)
    return root


def _flat(d, p=()):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, p + (str(k),))
        elif isinstance(v, list) and any(isinstance(x, dict) for x in v):
            for i, x in enumerate(v):
                yield from _flat(x, p + (str(k), str(i)))
        else:
            yield ".".join(p + (str(k),)), v


@pytest.fixture(scope="module")
def reference(written) -> dict:
    """The writer's full tensors and values, flattened the way DCP names keys."""
    return dict(_flat(torch.load(written / "fsdp_ref.pt", weights_only=True)))


def _assemble(root: Path) -> tuple[dict[str, torch.Tensor], dict]:
    meta, tensor_entries, object_entries = parse_dcp_metadata(root)
    files = DcpDataFiles(root, tensor_entries, meta.tensors)
    out = {}
    for key, t in meta.tensors.items():
        full = torch.full(t.global_shape, 7, dtype=getattr(torch, t.dtype))
        covered = 0
        for s in t.shards:
            box = tuple(slice(o, o + n) for o, n in zip(s.global_offset, s.local_shape))
            full[box] = files.chunk(key, s.file, s.name, s.local_shape)
            covered += s.numel
        assert covered == full.numel(), key
        out[key] = full
    files.close()
    values, refused = read_dcp_objects(root, object_entries)
    assert refused == {}
    return out, values


@pytest.mark.parametrize("name", ["fsdp", "fsdp_st", "fsdp_zstd"])
def test_fsdp2_model_and_optimizer_bit_exact(written, reference, name):
    if not (written / name).exists():
        pytest.skip("zstandard not installed: torch wrote no zstd checkpoint")
    tensors, values = _assemble(written / name)
    meta = parse_dcp_metadata(written / name)[0]
    assert meta.extra["dcp"]["serialization"] == ("safetensors" if name == "fsdp_st" else "torch_save")
    assert meta.extra["dcp"]["transforms"] == (["stream.zstd/1"] if name == "fsdp_zstd" else [])
    assert set(tensors) | set(values) == set(reference)
    for k, t in tensors.items():
        assert torch.equal(t, reference[k]), k
    assert "model.model.layers.1.mlp.down_proj.weight" in tensors
    assert "optim.state.model.layers.0.self_attn.q_proj.weight.exp_avg_sq" in tensors
    for k, v in values.items():
        assert v == reference[k], k
    assert values["optim.param_groups.0.lr"] == 0.01
    assert meta.nested["optim.state.model.embed_tokens.weight.exp_avg"] == [
        "optim", "state", "model.embed_tokens.weight", "exp_avg"]


def test_mesh_multichunk_and_subgroup_bit_exact(written):
    tensors, values = _assemble(written / "mesh")
    assert set(tensors) == set(W.MESH_SHAPES)
    for k in W.MESH_SHAPES:
        assert torch.equal(tensors[k], W.mesh_full(k)), k
    assert values == {"step": 11, "note.text": "hello", "note.values": [1, 2.5]}

    meta = parse_dcp_metadata(written / "multi")[0]
    shards = meta.tensors["multi.w"].shards
    assert len(shards) == 8 and len({s.file for s in shards}) == 4  # two chunks of the key in each rank's file
    assert torch.equal(_assemble(written / "multi")[0]["multi.w"], W.multi_full())

    tensors, values = _assemble(written / "two")
    assert sorted(p.name for p in (written / "two").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert torch.equal(tensors["two.w"], W.mesh_full("mesh.a")) and values == {"two.step": 3}


# ---------------------------------------------------------------- hostile and broken files

class _Call:
    """Pickles as a call of ``fn(*args)``: what a hostile .metadata would contain."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _hostile(kind: str, marker: Path) -> bytes:
    if kind == "os.system":
        return pickle.dumps(_Call(os.system, f"touch {marker}"))
    if kind == "eval":
        import builtins

        return pickle.dumps(_Call(builtins.eval, f"open({str(marker)!r}, 'w').close()"))
    if kind == "numpy-object":
        import numpy as np

        return pickle.dumps({"state_dict_metadata": np.array([_Call(os.system, f"touch {marker}")], dtype=object)})
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["os.system", "eval", "numpy-object"])
def test_hostile_metadata_refused_and_nothing_runs(tmp_path, kind):
    marker = tmp_path / "pwned"
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / ".metadata").write_bytes(_hostile(kind, marker))
    (d / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(UnsafePickleError, match=r"\.metadata: refuses to unpickle"):
        parse_dcp_metadata(d)
    assert not marker.exists()
    with pytest.raises(UnsafePickleError):
        load_dcp_pickle(d / ".metadata")
    assert not marker.exists()


def test_hostile_object_entry_is_refused_not_run(written, tmp_path):
    """A non-tensor value whose torch.save archive calls os.system is reported as refused and never runs."""
    d = tmp_path / "mesh"
    shutil.copytree(written / "mesh", d)
    meta, _, entries = parse_dcp_metadata(d)
    e = entries["step"]
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(_Call(os.system, f"touch {marker}"), buf)
    evil = buf.getvalue()
    data = bytearray((d / e.file).read_bytes())
    # rewrite the file with the evil archive in place of 'step', then patch its length in the metadata
    new = bytes(data[:e.offset]) + evil + bytes(data[e.offset + e.length:])
    (d / e.file).write_bytes(new)
    shift = len(evil) - e.length
    md = pickle.loads((d / ".metadata").read_bytes())  # our own file, written by torch: a trusted load is fine
    for idx, info in md.storage_data.items():
        if info.relative_path == e.file and info.offset > e.offset:
            info.offset += shift
        if idx.fqn == "step":
            info.length = len(evil)
    (d / ".metadata").write_bytes(pickle.dumps(md))
    meta, _, entries = parse_dcp_metadata(d)
    values, refused = read_dcp_objects(d, entries)
    assert not marker.exists()
    assert "step" in refused and "weights-only" in refused["step"]
    assert values["note.text"] == "hello"
    tensors, _ = _assemble_allowing(d)
    assert torch.equal(tensors["mesh.a"], W.mesh_full("mesh.a"))


def _assemble_allowing(root: Path):
    meta, te, oe = parse_dcp_metadata(root)
    files = DcpDataFiles(root, te, meta.tensors)
    out = {}
    for key, t in meta.tensors.items():
        full = torch.zeros(t.global_shape, dtype=getattr(torch, t.dtype))
        for s in t.shards:
            full[tuple(slice(o, o + n) for o, n in zip(s.global_offset, s.local_shape))] = files.chunk(
                key, s.file, s.name, s.local_shape)
        out[key] = full
    return out, oe


@pytest.mark.parametrize("name", ["fsdp", "fsdp_st"])
def test_truncated_and_missing_data_files(written, tmp_path, name):
    d = tmp_path / name
    shutil.copytree(written / name, d)
    f = d / "__2_0.distcp"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointFormatError, match=r"__2_0\.distcp.*truncated"):
        _assemble(d)
    f.unlink()
    with pytest.raises(CheckpointFormatError, match=r"__2_0\.distcp: DCP data file holding .* is missing"):
        parse_dcp_metadata(d)


def test_truncated_metadata(written, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(written / "mesh", d)
    (d / ".metadata").write_bytes((d / ".metadata").read_bytes()[:100])
    with pytest.raises(CheckpointFormatError, match=r"\.metadata: not a readable DCP metadata pickle"):
        parse_dcp_metadata(d)
