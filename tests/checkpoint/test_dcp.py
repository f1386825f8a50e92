"""torch.distributed.checkpoint (DCP) directories written by the real ``dcp.save`` on 4 gloo ranks, read by oarlock.

The fixtures (written by the ``write_*`` scenarios of _dcp_scenarios.py, one launch of 4 ranks) are an FSDP2
HF-Llama model + AdamW state from ``get_state_dict`` in the three serialisations torch 2.13 writes (torch.save
archives, embedded safetensors, zstd-compressed archives), DTensors on a 2x2 mesh, a ShardedTensor with two chunks
of one key per rank, and a checkpoint saved by a 2-rank subgroup.
Values are compared bit for bit with the writer's own full tensors.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import _dcp_scenarios as W
from multirank import each_scenario, launch_fixture, scenario_names
from oarlock.checkpoint import load_state_dict, open_checkpoint
from oarlock.checkpoint.errors import CheckpointFormatError, UnsafePickleError
from oarlock.checkpoint.formats.dcp import load_dcp_pickle, parse_dcp_metadata
from oarlock.cli import main
from testkit import PickledCall

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def _single(root: Path, world: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch.distributed.checkpoint as dcp

        dcp.save(W.single_state(), checkpoint_id=str(root / "single"))  # one process, no process group


launched = launch_fixture("_dcp_scenarios", worlds=(4,), prepare=_single, timeout_s=300)
WRITERS = [n for n in scenario_names("_dcp_scenarios") if n.startswith("scenario_write_")]


@pytest.fixture(scope="module")
def written(launched) -> Path:
    for name in WRITERS:
        launched.check(name)
    return launched.root(4)


def _flat(d, p=()):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, p + (str(k),))
        else:
            yield ".".join(p + (str(k),)), v


@pytest.fixture(scope="module")
def reference(written) -> dict:
    """The writer's full tensors and values, flattened the way oarlock names keys (lists without tensors are one
    value: ``optim.param_groups``)."""
    return dict(_flat(torch.load(written / "fsdp_ref.pt", weights_only=True)))


def _assemble(root: Path, refused_ok: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """Every tensor rebuilt from its stored chunks (reader.chunk), and the non-tensor values."""
    with open_checkpoint(root) as reader:
        meta = reader.metadata
        assert meta.format == "dcp"
        out = {}
        for key, t in meta.tensors.items():
            full = torch.full(t.global_shape, 7, dtype=getattr(torch, t.dtype))
            covered = 0
            for s in t.shards:
                box = tuple(slice(o, o + n) for o, n in zip(s.global_offset, s.local_shape))
                full[box] = reader.chunk(key, s.file, s.name)
                covered += s.numel
            assert covered == full.numel(), key
            out[key] = full
        if not refused_ok:
            assert meta.extra["dcp"]["refused_objects"] == {}
        return out, dict(meta.objects)


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
    assert values["optim.param_groups"][0]["lr"] == 0.01
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

def _hostile(kind: str, marker: Path) -> bytes:
    if kind == "os.system":
        return pickle.dumps(PickledCall(os.system, f"touch {marker}"))
    if kind == "eval":
        import builtins

        return pickle.dumps(PickledCall(builtins.eval, f"open({str(marker)!r}, 'w').close()"))
    if kind == "numpy-object":
        import numpy as np

        evil = PickledCall(os.system, f"touch {marker}")
        return pickle.dumps({"state_dict_metadata": np.array([evil], dtype=object)})
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
    torch.save(PickledCall(os.system, f"touch {marker}"), buf)
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
    with open_checkpoint(d) as reader:
        refused = reader.metadata.extra["dcp"]["refused_objects"]
        values = reader.metadata.objects
    assert not marker.exists()
    assert list(refused) == ["step"] and "weights-only" in refused["step"]
    assert values["note.text"] == "hello"
    tensors, _ = _assemble(d, refused_ok=True)
    assert torch.equal(tensors["mesh.a"], W.mesh_full("mesh.a"))
    target = {"step": 0, "mesh.a": torch.zeros(16, 12)}
    with pytest.raises(Exception, match="step"):  # the refused value is missing, never executed
        load_state_dict(target, d)
    assert not marker.exists()


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


# ---------------------------------------------------------------- entry points: load_state_dict, inspect, convert

@each_scenario("_dcp_scenarios", worlds=(4,))
def test_rank_scenarios(launched, world, scenario):
    """Every rank's part of each scenario: the torch writers (write_*), then oarlock's load_state_dict of what they
    wrote into other layouts, compared bit for bit with the writer's own tensors."""
    launched.check(scenario, world)


def test_four_to_one_into_plain_model(written, reference):
    """The 4-rank FSDP2 checkpoint loaded in one process into a plain (unsharded) HF model + nested optimizer
    state, with torch's own dcp.load of the same files as a second reference."""
    from transformers import LlamaForCausalLM

    import torch.distributed.checkpoint as dcp

    model = LlamaForCausalLM(W.tiny_llama_config())
    target = {"model": model.state_dict()}
    report = load_state_dict(target, written / "fsdp", strict=False)
    assert report.missing_keys == []
    assert all(k.startswith("optim.") for k in report.unexpected_keys) and report.unexpected_keys
    ref_sd = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(ref_sd, checkpoint_id=str(written / "fsdp"))
    for k, v in model.state_dict().items():
        assert torch.equal(v, reference[f"model.{k}"]), k
        assert torch.equal(v, ref_sd["model"][k]), k


def test_inspect_dcp(written, capsys):
    assert main(["inspect", str(written / "mesh"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    text = json.dumps(out)
    assert "mesh.a" in text and "dcp" in text and "__3_0.distcp" in text
    assert main(["inspect", str(written / "fsdp")]) == 0
    assert "dcp checkpoint, 84 tensors" in capsys.readouterr().out


def test_convert_dcp_to_hf_loads_in_transformers(written, reference, tmp_path):
    """`oarlock convert DCP OUT --to hf` of the FSDP2 model (HF key names); config.json placed next to the
    DCP files is carried over, and transformers loads the result with the writer's exact weights."""
    from transformers import LlamaForCausalLM

    src = tmp_path / "src"
    shutil.copytree(written / "hf_model", src)
    W.tiny_llama_config().save_pretrained(src)
    assert main(["convert", str(src), str(tmp_path / "hf"), "--to", "hf"]) == 0
    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    for k, v in model.state_dict().items():
        assert torch.equal(v, reference[f"model.{k}"]), k


@pytest.mark.parametrize("name", ["fsdp", "fsdp_st"])
def test_convert_dcp_to_oarlock_tp2(written, reference, tmp_path, name):
    out = tmp_path / "oar"
    assert main(["convert", str(written / name), str(out), "--to", "oarlock", "--tp", "2"]) == 0
    with open_checkpoint(out) as r:
        meta = r.metadata
        q = meta.tensors["model.model.layers.0.self_attn.q_proj.weight"]
        assert len(q.shards) == 2
    got = {k: torch.zeros_like(reference[k]) for k in ("model.model.layers.0.self_attn.q_proj.weight",
                                                       "optim.state.model.norm.weight.exp_avg")}
    load_state_dict(got, out, strict=False)
    for k, v in got.items():
        assert torch.equal(v, reference[k]), k


def _zeros_like_nested(d):
    if isinstance(d, dict):
        return {k: _zeros_like_nested(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_zeros_like_nested(v) for v in d]
    if isinstance(d, torch.Tensor):
        return torch.zeros_like(d)
    return d


def test_convert_to_dcp_loaded_by_torch(written, tmp_path):
    """`oarlock convert FSDP2-DCP OUT --to dcp --tp 2`: torch's own dcp.load reads OUT into the nested model +
    optimizer state dict (values included) with the writer's exact tensors."""
    import torch.distributed.checkpoint as dcp

    ref = torch.load(written / "fsdp_ref.pt", weights_only=True)
    out = tmp_path / "dcp_tp2"
    assert main(["convert", str(written / "fsdp"), str(out), "--to", "dcp", "--tp", "2"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [".metadata", ".oarlock-files", "__0_0.distcp", "__1_0.distcp"]
    got = _zeros_like_nested(ref)
    got["optim"]["param_groups"][0]["lr"] = -1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, checkpoint_id=str(out))
    for k, v in ref["model"].items():
        assert torch.equal(got["model"][k], v), k
    for fqn, st in ref["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(got["optim"]["state"][fqn][k], v), (fqn, k)
    assert got["optim"]["param_groups"][0]["lr"] == 0.01
    with open_checkpoint(out) as r:  # and oarlock reads what it wrote: 2 chunks of the column-parallel q_proj
        assert len(r.metadata.tensors["model.model.layers.0.self_attn.q_proj.weight"].shards) == 2


def test_convert_hf_to_dcp(minilm_dir, tmp_path):
    """A real HF model (all-MiniLM-L6-v2) to DCP with TP 2, read back by torch's dcp.load."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    ref = load_file(minilm_dir / "model.safetensors")
    out = tmp_path / "mini"
    assert main(["convert", str(minilm_dir), str(out), "--to", "dcp", "--tp", "2"]) == 0
    got = {k: torch.zeros_like(v) for k, v in ref.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, checkpoint_id=str(out))
    for k, v in ref.items():
        assert torch.equal(got[k], v), k
    assert (out / "config.json").is_file()  # side files travel with the weights


def test_directory_of_no_format_names_what_it_saw(tmp_path):
    d = tmp_path / "junk"
    d.mkdir()
    (d / "weights.bin").write_bytes(b"x")
    (d / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointFormatError) as e:
        open_checkpoint(d)
    msg = str(e.value)
    assert "looked for" in msg and ".metadata" in msg and "metadata.json" in msg
    assert "found notes.txt, weights.bin" in msg
