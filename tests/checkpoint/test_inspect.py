"""`oarlock inspect` and the format readers behind it, on real and hand-made checkpoints, good and bad."""

import json
import os
import pickle
import struct
import subprocess

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from oarlock.checkpoint import CheckpointFormatError, UnsafePickleError, open_checkpoint, save_state_dict
from oarlock.cli import main
from paddle_venv import paddle_python
from testkit import run_cli, tree_digest, write_paddle_checkpoint


# ---------------------------------------------------------------- real input: all-MiniLM-L6-v2

def test_minilm_every_tensor_matches_safe_open(minilm_dir, capsys):
    assert main(["inspect", str(minilm_dir), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    with safe_open(str(minilm_dir / "model.safetensors"), "pt") as f:
        ref = {k: (list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    assert out["format"] == "huggingface"
    assert out["num_tensors"] == len(ref) == len(out["tensors"])
    code = {"float32": "F32", "int64": "I64"}
    for t in out["tensors"]:
        shape, dt = ref[t["key"]]
        assert t["shape"] == shape and code[t["dtype"]] == dt
        assert t["nbytes"] == (4 if dt == "F32" else 8) * int(torch.tensor(shape).prod())
    assert {t["key"]: t["shape"] for t in out["tensors"]}["embeddings.word_embeddings.weight"] == [30522, 384]
    assert out["total_bytes"] == sum(t["nbytes"] for t in out["tensors"])


def test_minilm_text_output_and_single_file(minilm_dir, capsys):
    assert main(["inspect", str(minilm_dir / "model.safetensors")]) == 0
    text = capsys.readouterr().out
    assert "safetensors checkpoint" in text
    line = next(l for l in text.splitlines() if l.startswith("embeddings.position_ids "))
    assert "[1, 512]" in line and "int64" in line and line.split()[-1] == "4096"


# ---------------------------------------------------------------- sharded HF directory

@pytest.fixture
def hf_sharded(tmp_path):
    a, b, c = torch.randn(4, 3), torch.arange(6, dtype=torch.int32), torch.randn(2, 2, dtype=torch.bfloat16)
    save_file({"a": a, "b": b}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"c": c}, tmp_path / "model-00002-of-00002.safetensors")
    idx = {"metadata": {"total_size": 48 + 24 + 8},
           "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                          "c": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    return tmp_path, {"a": a, "b": b, "c": c}


def test_hf_sharded_index(hf_sharded):
    root, ref = hf_sharded
    with open_checkpoint(root) as r:
        meta = r.metadata
        assert meta.format == "huggingface"
        assert {k: (t.global_shape, t.dtype) for k, t in meta.tensors.items()} == {
            "a": ((4, 3), "float32"), "b": ((6,), "int32"), "c": ((2, 2), "bfloat16")}
        for k, t in meta.tensors.items():
            assert torch.equal(r.read(k, t.shards[0]), ref[k])
        assert torch.equal(r.read("a", meta.tensors["a"].shards[0], (slice(1, 3), slice(0, 2))), ref["a"][1:3, :2])


# ---------------------------------------------------------------- oarlock sharded directory (format of metadata.json)

def test_oarlock_sharded_directory_lists_shards(tmp_path, capsys):
    full = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    save_file({"w@0": full[:2].contiguous(), "step": torch.tensor(3)}, tmp_path / "rank00000.safetensors")
    save_file({"w@1": full[2:].contiguous()}, tmp_path / "rank00001.safetensors")
    meta = {"format": "oarlock.flexcheckpoint", "version": 1, "objects": {"lr": 0.1},
            "tensors": {"w": {"global_shape": [4, 5], "dtype": "float32", "shards": [
                {"global_offset": [0, 0], "local_shape": [2, 5], "file": "rank00000.safetensors", "name": "w@0"},
                {"global_offset": [2, 0], "local_shape": [2, 5], "file": "rank00001.safetensors", "name": "w@1"}]},
                "step": {"global_shape": [], "dtype": "int64", "shards": [
                    {"global_offset": [], "local_shape": [], "file": "rank00000.safetensors", "name": "step"}]}}}
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    assert main(["inspect", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "oarlock checkpoint, 2 tensors" in text
    assert "shard offset=[2, 0] local_shape=[2, 5] file=rank00001.safetensors" in text
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    w = next(t for t in out["tensors"] if t["key"] == "w")
    assert [s["global_offset"] for s in w["shards"]] == [[0, 0], [2, 0]] and w["shards"][1]["nbytes"] == 40
    assert out["objects"] == {"lr": 0.1}
    with open_checkpoint(tmp_path) as r:
        shard = r.metadata.tensors["w"].shards[1]
        assert torch.equal(r.read("w", shard), full[2:])


# ---------------------------------------------------------------- Paddle FlexCheckpoint layout

@pytest.mark.parametrize("data_format", ["distcp", "safetensors"])
def test_paddle_layout(tmp_path, data_format):
    import numpy as np

    tensors = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(5, dtype=np.int64)}
    write_paddle_checkpoint(tmp_path, tensors, data_format)
    with open_checkpoint(tmp_path) as r:
        assert r.metadata.format == "paddle"
        assert {k: (t.global_shape, t.dtype) for k, t in r.metadata.tensors.items()} == {
            "w": ((3, 4), "float32"), "b": ((5,), "int64")}
        for k, t in r.metadata.tensors.items():
            assert torch.equal(r.read(k, t.shards[0]), torch.from_numpy(tensors[k]))


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


@pytest.mark.parametrize("target", ["0.metadata", "0_0.distcp"])
def test_malicious_paddle_pickle_does_not_run(tmp_path, target):
    import numpy as np

    write_paddle_checkpoint(tmp_path, {"w": np.ones((2, 2), dtype=np.float32)})
    (tmp_path / target).write_bytes(pickle.dumps({"w": _Evil()}))
    before = tree_digest(tmp_path)
    with pytest.raises(UnsafePickleError, match=r"refuses to unpickle (posix|os|nt)\.system"):
        with open_checkpoint(tmp_path) as r:
            t = r.metadata.tensors["w"]
            r.read("w", t.shards[0])
    r = run_cli("inspect", tmp_path, cwd=tmp_path)
    assert not (tmp_path / "PWNED").exists()
    assert tree_digest(tmp_path) == before
    if target == "0.metadata":
        assert r.returncode == 2 and "system" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_real_paddle_checkpoint(tmp_path):
    """Files written by PaddlePaddle 3.3.1 itself (in .paddle-venv, which `make test` builds; skipped without it)."""
    py = paddle_python()
    script = """
import sys, numpy as np, paddle, paddle.distributed as dist
sd = {'w': paddle.to_tensor(np.arange(12, dtype='float32').reshape(3, 4)),
      'b': paddle.to_tensor(np.arange(5, dtype='int64'))}
dist.save_state_dict(sd, sys.argv[1] + '/distcp')
dist.save_state_dict(sd, sys.argv[1] + '/st', safetensors=True)
"""
    r = subprocess.run([py, "-c", script, str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    for sub in ("distcp", "st"):
        with open_checkpoint(tmp_path / sub) as rd:
            m = rd.metadata
            assert m.format == "paddle"
            assert torch.equal(rd.read("w", m.tensors["w"].shards[0]), torch.arange(12.0).reshape(3, 4))
            assert torch.equal(rd.read("b", m.tensors["b"].shards[0]), torch.arange(5))


# ---------------------------------------------------------------- bad input: one line, exit 2, nothing modified

def _corrupt(tmp_path, kind):
    p = tmp_path / "bad.safetensors"
    save_file({"a": torch.zeros(4, 4), "b": torch.ones(3)}, p)
    raw = p.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    if kind == "truncated":
        p.write_bytes(raw[:20])
    else:
        header["b"]["data_offsets"] = [0, 12] if kind == "overlap" else [64, 1000]
        hb = json.dumps(header).encode()
        hb += b" " * (-len(hb) % 8)
        p.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])
    return p


@pytest.mark.parametrize("kind,needle", [("truncated", "header"), ("overlap", "offset"), ("exceed", "offset")])
def test_bad_safetensors(tmp_path, kind, needle):
    p = _corrupt(tmp_path, kind)
    before = tree_digest(tmp_path)
    r = run_cli("inspect", p)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"oarlock: error: {p}: invalid safetensors file") and needle in r.stderr
    assert r.stderr.count("\n") == 1
    assert tree_digest(tmp_path) == before


def test_empty_file_is_rejected(tmp_path):
    p = tmp_path / "empty.safetensors"
    p.write_bytes(b"")
    with pytest.raises(CheckpointFormatError, match="empty.safetensors"):
        open_checkpoint(p)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read any file")
def test_unreadable_file(tmp_path):
    p = tmp_path / "x.safetensors"
    save_file({"a": torch.zeros(1)}, p)
    p.chmod(0)
    r = run_cli("inspect", p)
    assert r.returncode == 2 and str(p) in r.stderr


def test_index_names_missing_shard(hf_sharded):
    root, _ = hf_sharded
    (root / "model-00002-of-00002.safetensors").unlink()
    before = tree_digest(root)
    r = run_cli("inspect", root)
    assert r.returncode == 2
    assert "model.safetensors.index.json" in r.stderr and "'c'" in r.stderr and "does not exist" in r.stderr
    assert tree_digest(root) == before


def test_tensor_listed_twice(tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"a": torch.ones(2)}, tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointFormatError, match="'a' is stored twice"):
        open_checkpoint(tmp_path)


def test_directory_mixing_formats(tmp_path, hf_sharded):
    root, _ = hf_sharded
    (root / "metadata.json").write_text("{}")
    before = tree_digest(root)
    r = run_cli("inspect", root)
    assert r.returncode == 2 and "mixes checkpoint formats (oarlock and huggingface)" in r.stderr
    assert tree_digest(root) == before


def test_directory_without_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    r = run_cli("inspect", tmp_path)
    assert r.returncode == 2 and "no checkpoint found" in r.stderr


def test_truncated_data_section_is_named_with_byte_counts(tmp_path, capsys):
    """A safetensors file cut inside its data section: `verify` (exit 1) and `inspect` (exit 2) say the header's
    offsets run past the end, with both byte counts (from the header and the file size, computed here)."""
    d = tmp_path / "hf"
    d.mkdir()
    p = d / "model.safetensors"
    save_file({"a": torch.randn(64, 64), "b": torch.randn(10)}, p)
    raw = p.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    end = 8 + n + max(e["data_offsets"][1] for k, e in json.loads(raw[8:8 + n]).items() if k != "__metadata__")
    assert end == len(raw)
    p.write_bytes(raw[: len(raw) // 2])
    want = f"data offsets run to byte {end}, the file has only {len(raw) // 2} bytes (truncated"
    assert main(["verify", str(d)]) == 1
    assert want in capsys.readouterr().out
    assert main(["inspect", str(d)]) == 2
    assert want in capsys.readouterr().err


def test_inspect_of_a_directory_with_a_truncated_data_file_fails_naming_it(tmp_path, capsys):
    """An oarlock checkpoint whose data file lost its last 10 bytes: `inspect` exits 2 naming the file and both
    byte counts (as convert and diff do), not 0 with the listing; intact, it still lists it (exit 0)."""
    ck = tmp_path / "ck"
    save_state_dict({"w": torch.randn(4, 4), "step": 3}, ck)
    assert main(["inspect", str(ck)]) == 0
    assert "'w'" not in capsys.readouterr().err
    f = ck / "rank-00000.safetensors"
    size = os.path.getsize(f)
    os.truncate(f, size - 10)
    assert main(["inspect", str(ck)]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    assert f"{f}: invalid safetensors file: the header's data offsets run to byte {size}, the file has only " \
           f"{size - 10} bytes (truncated" in cap.err, cap.err
    os.unlink(f)
    assert main(["inspect", str(ck), "--json"]) == 2
    assert f"{f}: data file named in metadata.json is missing" in capsys.readouterr().err


def test_inspect_says_when_no_key_matches_the_filter(tmp_path):
    """`--include` that matches nothing: the listing is empty and stderr says the filter matched none of the
    checkpoint's keys (an empty listing alone reads like an empty checkpoint)."""
    from oarlock.checkpoint import save_state_dict
    from testkit import run_cli

    save_state_dict({"w": torch.ones(3), "b": torch.zeros(2)}, tmp_path / "ck")
    r = run_cli("inspect", tmp_path / "ck", "--include", "weight")
    assert r.returncode == 0
    assert "no key of the 2 in" in r.stderr and "--include/--exclude" in r.stderr
    r = run_cli("inspect", tmp_path / "ck", "--include", "w")
    assert "no key" not in r.stderr and "w" in r.stdout
