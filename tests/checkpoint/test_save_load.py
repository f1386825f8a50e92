"""save_state_dict / load_state_dict in one process: formats, sources, AOA hook, validation, crash safety."""

import json
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import oarlock.checkpoint.runtime.save as api
from oarlock.checkpoint import (CheckpointError, CheckpointFormatError, CheckpointMismatchError,
                                CheckpointTilingError, ShardedWeight, TensorSpec, load_state_dict,
                                save_state_dict, sharded_state_dict)
from oarlock.checkpoint.model.mapping import execute_on_full_tensors
from testkit import TransposeSplit, listed_metadata, tree_digest, write_paddle_checkpoint


def sample(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(6, 5, generator=g), "e": torch.randn(7, 3, generator=g).to(torch.bfloat16),
                      "h": torch.randn(4, generator=g).to(torch.float16),
                      "ids": torch.randint(0, 2**40, (3, 2), generator=g)},
            "step": torch.tensor(11), "lr": 0.25, "name": "run-1", "betas": [0.9, 0.99]}


def zeros_like_sd(sd):
    if isinstance(sd, dict):
        return {k: zeros_like_sd(v) for k, v in sd.items()}
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    return None if not isinstance(sd, list) else [None] * len(sd)


def test_round_trip_single_process_bit_exact(tmp_path):
    sd = sample()
    save_state_dict(sd, tmp_path / "ck")
    assert sorted(os.listdir(tmp_path / "ck")) == [".oarlock-files", "metadata.json", "rank-00000.safetensors",
                                                   "rank-00000.safetensors.xxh3"]
    meta = json.loads((tmp_path / "ck" / "metadata.json").read_text())
    assert meta["format"] == "oarlock.flexcheckpoint" and meta["objects"] == {"lr": 0.25, "name": "run-1",
                                                                              "betas": [0.9, 0.99]}
    # the data file is plain safetensors: the safetensors library reads it back
    data = load_file(tmp_path / "ck" / "rank-00000.safetensors")
    assert torch.equal(data["model.e"], sd["model"]["e"]) and data["model.e"].dtype == torch.bfloat16
    got = zeros_like_sd(sd)
    report = load_state_dict(got, tmp_path / "ck")
    assert report.missing_keys == [] and report.unexpected_keys == []
    for k in ("w", "e", "h", "ids"):
        assert got["model"][k].dtype == sd["model"][k].dtype and torch.equal(got["model"][k], sd["model"][k])
    assert torch.equal(got["step"], sd["step"]) and got["lr"] == 0.25 and got["name"] == "run-1"
    assert got["betas"] == [0.9, 0.99]


def test_partial_and_flattened_targets_read_only_their_bytes(tmp_path):
    full = torch.arange(4096 * 8, dtype=torch.float32).reshape(4096, 8)
    save_state_dict({"w": full}, tmp_path / "ck")
    box = ShardedWeight("w", torch.zeros(100, 3), (100, 3), (4096, 8), (2000, 5))
    flat = ShardedWeight("w", torch.zeros(1000), (4096, 8), (4096, 8), (0, 0), flattened_range=slice(13, 1013))
    for sw in (box, flat):
        report = load_state_dict({"w": sw}, tmp_path / "ck")
        assert report.bytes_read == sw.local_tensor.numel() * 4
    assert torch.equal(box.local_tensor, full[2000:2100, 5:8])
    assert torch.equal(flat.local_tensor, full.reshape(-1)[13:1013])


def test_module_round_trip(tmp_path):
    torch.manual_seed(0)
    a, b = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)), \
        torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    a[1].running_mean.add_(1.5)
    ssd = sharded_state_dict(a)
    assert set(ssd) == set(a.state_dict()) and ssd["0.weight"].global_shape == (3, 4)
    save_state_dict(ssd, tmp_path / "m")
    load_state_dict(sharded_state_dict(b), tmp_path / "m")
    for k, v in a.state_dict().items():
        assert torch.equal(b.state_dict()[k], v), k


def test_hf_directory_source(tmp_path):
    g = torch.Generator().manual_seed(1)
    t = {"a.weight": torch.randn(8, 6, generator=g), "a.bias": torch.randn(8, generator=g),
         "pos": torch.arange(10, dtype=torch.int64)}
    save_file({"a.weight": t["a.weight"]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"a.bias": t["a.bias"], "pos": t["pos"]}, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "a.weight": "model-00001-of-00002.safetensors", "a.bias": "model-00002-of-00002.safetensors",
        "pos": "model-00002-of-00002.safetensors"}}))
    w = ShardedWeight("a.weight", torch.zeros(3, 6), (3, 6), (8, 6), (4, 0))
    rest = {"a.bias": torch.zeros(8), "pos": torch.zeros(10, dtype=torch.int64)}
    load_state_dict({"a.weight": w, **rest}, tmp_path)
    assert torch.equal(w.local_tensor, t["a.weight"][4:7])
    assert torch.equal(rest["a.bias"], t["a.bias"]) and torch.equal(rest["pos"], t["pos"])


def test_real_minilm_into_a_transformers_model(minilm_dir):
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig.from_pretrained(minilm_dir), add_pooling_layer=False)
    ref = load_file(minilm_dir / "model.safetensors")
    report = load_state_dict(sharded_state_dict(model), minilm_dir, strict=False)
    sd = model.state_dict()
    assert not report.missing_keys and report.unexpected_keys == [k for k in sorted(ref) if k not in sd]
    assert all(torch.equal(sd[k], ref[k]) for k in sd)


@pytest.mark.parametrize("data_format", ["distcp", "safetensors"])
def test_paddle_directory_source(tmp_path, data_format):
    arr = np.arange(24, dtype=np.float32).reshape(4, 6)
    write_paddle_checkpoint(tmp_path, {"w": arr, "b": np.arange(5, dtype=np.int64)}, data_format)
    w = ShardedWeight("w", torch.zeros(4, 2), (4, 2), (4, 6), (0, 3))
    b = torch.zeros(5, dtype=torch.int64)
    load_state_dict({"w": w, "b": b}, tmp_path)
    assert torch.equal(w.local_tensor, torch.from_numpy(arr)[:, 3:5]) and torch.equal(b, torch.arange(5))


# ---------------------------------------------------------------- mapping programs and the AOA hook

def test_hand_built_program_through_files(tmp_path):
    full = torch.randn(4, 6)
    save_state_dict({"w": full}, tmp_path / "ck")
    ref = execute_on_full_tensors(TransposeSplit(), {"w": full})
    a = ShardedWeight("a", torch.zeros(2, 4), (2, 4), (3, 4), (1, 0))
    b = ShardedWeight("b", torch.zeros(4, 2, dtype=torch.float64), (4, 2), (4, 3), (0, 1))
    report = load_state_dict({"a": a, "b": b}, tmp_path / "ck", program=TransposeSplit())
    assert torch.equal(a.local_tensor, ref["a"][1:3]) and torch.equal(b.local_tensor, ref["b"][:, 1:3])
    assert report.unexpected_keys == []


def test_aoa_config_goes_to_compile_aoa(tmp_path, monkeypatch):
    full = torch.randn(4, 6)
    save_state_dict({"w": full}, tmp_path / "ck")
    calls = []
    fake = types.ModuleType("oarlock.checkpoint.aoa")

    def compile_aoa(config, source, destination, *, source_shards, destination_shards):
        calls.append((config, source, destination))
        assert source_shards == {"w": 1} and destination_shards == {"a": 1, "b": 1}  # TP shard counts
        return TransposeSplit()

    fake.compile_aoa = compile_aoa
    fake.shard_counts = lambda meta: {k: len(t.shards) for k, t in meta.tensors.items()}
    monkeypatch.setitem(sys.modules, "oarlock.checkpoint.aoa", fake)
    layout = types.ModuleType("oarlock.checkpoint.aoa.layout")  # no TP-blocked layouts recorded: config as given
    layout.relayout_config = lambda config, meta, destination_shards: config
    monkeypatch.setitem(sys.modules, "oarlock.checkpoint.aoa.layout", layout)
    a, b = torch.zeros(3, 4), torch.zeros(4, 3, dtype=torch.float64)
    cfg = {"aoa_statements": ["w^T -> a"]}
    load_state_dict({"a": a, "b": b}, tmp_path / "ck", aoa_config=cfg)
    ((config, source, destination),) = calls
    assert config is cfg and source == {"w": TensorSpec((4, 6), "float32")}
    assert destination == {"a": TensorSpec((3, 4), "float32"), "b": TensorSpec((4, 3), "float64")}
    assert torch.equal(a, full[:, :3].T) and torch.equal(b, full[:, 3:].double())


# ---------------------------------------------------------------- validation errors name the culprit

def test_shape_mismatch(tmp_path):
    save_state_dict({"layer.w": torch.ones(4, 6)}, tmp_path / "ck")
    with pytest.raises(CheckpointMismatchError) as e:
        load_state_dict({"layer.w": torch.zeros(6, 4)}, tmp_path / "ck")
    msg = str(e.value)
    assert "'layer.w'" in msg and "[6, 4]" in msg and "[4, 6]" in msg and "aoa_config" in msg


def test_dtype_mismatch_needs_a_cast(tmp_path):
    save_state_dict({"w": torch.ones(3)}, tmp_path / "ck")
    t = torch.zeros(3, dtype=torch.bfloat16)
    with pytest.raises(CheckpointMismatchError) as e:
        load_state_dict({"w": t}, tmp_path / "ck")
    assert "'w'" in str(e.value) and "float32" in str(e.value) and "bfloat16" in str(e.value)
    assert "dtype=" in str(e.value) and torch.equal(t, torch.zeros(3, dtype=torch.bfloat16))


def test_missing_and_unexpected_keys(tmp_path):
    save_state_dict({"a": torch.ones(2), "old": torch.ones(1), "epoch": 3}, tmp_path / "ck")
    target = {"a": torch.zeros(2), "new": torch.zeros(2), "note": "x"}
    with pytest.raises(CheckpointMismatchError) as e:
        load_state_dict(target, tmp_path / "ck")
    msg = str(e.value)
    assert "missing keys" in msg and "'new'" in msg and "'note'" in msg
    assert "unexpected keys" in msg and "'old'" in msg and "'epoch'" in msg
    assert torch.equal(target["a"], torch.zeros(2))  # nothing written before validation passed
    report = load_state_dict(target, tmp_path / "ck", strict=False)
    assert report.missing_keys == ["new", "note"] and report.unexpected_keys == ["epoch", "old"]
    assert torch.equal(target["a"], torch.ones(2)) and torch.equal(target["new"], torch.zeros(2))


def test_tiling_error_on_load_names_key_and_box(tmp_path):
    save_state_dict({"w": ShardedWeight("w", torch.ones(10, 4), (10, 4), (10, 4), (0, 0))}, tmp_path / "ck")
    mpath = tmp_path / "ck" / "metadata.json"
    meta = listed_metadata(tmp_path / "ck")
    meta["tensors"]["w"]["global_shape"] = [12, 4]  # a corrupt file: rows 10:12 are nowhere
    mpath.write_text(json.dumps(meta))
    with pytest.raises(CheckpointTilingError) as e:
        load_state_dict({"w": torch.zeros(12, 4)}, tmp_path / "ck")
    assert "'w'" in str(e.value) and "[10:12, 0:4]" in str(e.value)


def test_bad_inputs(tmp_path):
    with pytest.raises(CheckpointError, match="'opt.fn'.*neither a tensor nor JSON"):
        save_state_dict({"opt": {"fn": object()}}, tmp_path / "x")
    with pytest.raises(CheckpointError, match="'a.b' occurs twice"):
        save_state_dict({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, tmp_path / "x")
    with pytest.raises(CheckpointError, match="'w'.*local_tensor has shape \\(2,\\), local_shape says \\(3,\\)"):
        ShardedWeight("w", torch.ones(2), (3,), (3,), (0,))
    with pytest.raises(CheckpointError, match="'w'.*leaves global shape"):
        ShardedWeight("w", torch.ones(2), (2,), (3,), (2,))
    (tmp_path / "notckpt").mkdir()
    (tmp_path / "notckpt" / "important.txt").write_text("keep")
    with pytest.raises(CheckpointError, match="not an oarlock checkpoint; refusing"):
        save_state_dict({"w": torch.ones(1)}, tmp_path / "notckpt")
    assert (tmp_path / "notckpt" / "important.txt").read_text() == "keep"
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------- crash safety

def test_injected_failure_leaves_nothing_and_keeps_the_earlier_checkpoint(tmp_path, monkeypatch):
    save_state_dict(sample(0), tmp_path / "step1")
    before = tree_digest(tmp_path / "step1")

    def boom(path, tensors, **kw):
        Path(path).write_bytes(b"half a file")
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(api, "write_safetensors", boom)
    with pytest.raises(CheckpointError, match="Input/output error"):
        save_state_dict(sample(1), tmp_path / "step2")
    with pytest.raises(CheckpointError, match="Input/output error"):
        save_state_dict(sample(1), tmp_path / "step1")  # re-saving over it fails too: the old one survives
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step1"]
    assert tree_digest(tmp_path / "step1") == before
    monkeypatch.undo()
    save_state_dict(sample(2), tmp_path / "step1")  # a successful overwrite replaces it whole
    got = zeros_like_sd(sample())
    load_state_dict(got, tmp_path / "step1")
    assert torch.equal(got["model"]["w"], sample(2)["model"]["w"])


KILL_SCRIPT = r"""
import os, signal, sys, torch
import oarlock.checkpoint.runtime.save as api
from oarlock.checkpoint import save_state_dict
real = api.write_safetensors
def killed_mid_write(path, tensors, **kw):
    real(path, tensors, **kw)
    with open(path, "r+b") as f:  # leave a truncated file, as a kill during the write would
        f.truncate(os.path.getsize(path) // 2)
    os.kill(os.getpid(), signal.SIGKILL)
api.write_safetensors = killed_mid_write
save_state_dict({"w": torch.randn(256, 256), "step": 5}, sys.argv[1])
"""


def test_killed_save_does_not_load_and_spares_the_parent(tmp_path):
    save_state_dict(sample(0), tmp_path / "step1")
    before = tree_digest(tmp_path / "step1")
    r = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(tmp_path / "step2")], capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert not (tmp_path / "step2").exists()
    (leftover,) = [p for p in tmp_path.iterdir() if p.name != "step1"]
    assert leftover.name.startswith(".step2.tmp-")
    with pytest.raises(CheckpointFormatError, match="incomplete checkpoint"):
        load_state_dict({"w": torch.zeros(256, 256)}, leftover)
    with pytest.raises(CheckpointFormatError, match="no such file"):
        load_state_dict({"w": torch.zeros(256, 256)}, tmp_path / "step2")
    assert tree_digest(tmp_path / "step1") == before
    got = zeros_like_sd(sample())
    load_state_dict(got, tmp_path / "step1")
    assert torch.equal(got["model"]["e"], sample(0)["model"]["e"])


def test_aoa_deleted_source_is_not_unexpected(tmp_path):
    save_state_dict({"w": torch.arange(6.0).view(2, 3), "junk": torch.ones(2)}, tmp_path / "ck")
    w = torch.zeros(3, 2)
    report = load_state_dict({"wt": w}, tmp_path / "ck", aoa_config=["w^T -> wt", "junk -> _"], strict=True)
    assert torch.equal(w, torch.arange(6.0).view(2, 3).T) and report.unexpected_keys == []
    with pytest.raises(CheckpointMismatchError, match="junk"):
        load_state_dict({"wt": torch.zeros(3, 2)}, tmp_path / "ck", aoa_config=["w^T -> wt"], strict=True)


def test_missing_key_hint_names_the_fix_for_missing_keys(tmp_path):
    """A target key the checkpoint does not hold (and nothing unexpected): the error names the key and points at
    the names, AOA and strict=False, not at model_only (which cannot help, a new user's trial followed it in a
    loop); the present key is left untouched."""
    save_state_dict({"model.w": torch.ones(3)}, tmp_path / "c")
    tgt = {"model.w": torch.zeros(3), "model.extra": torch.zeros(2)}
    with pytest.raises(CheckpointMismatchError) as e:
        load_state_dict(tgt, tmp_path / "c")
    msg = str(e.value)
    assert "missing keys (requested, not in the checkpoint): 'model.extra'" in msg or "model.extra" in msg, msg
    assert "oarlock inspect" in msg and "strict=False" in msg and "model_only" not in msg, msg
    assert torch.equal(tgt["model.w"], torch.zeros(3))
