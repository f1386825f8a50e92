"""Hostile and damaged checkpoints (issue 21): writers never delete or write into what they were not asked to,
replacement is old-or-new at every instant, readers never open anything outside the checkpoint, never build
objects from file bytes, never mix two saves, and refuse before writing any target byte."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from oarlock.checkpoint import load_state_dict, save_state_dict
from oarlock.checkpoint.errors import CheckpointError, CheckpointFormatError

PY = sys.executable


def tree(root: Path) -> dict[str, bytes | None]:
    """Every entry under ``root`` (hidden ones included): relative path -> file bytes (None for directories)."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = Path(p).read_bytes()
    return out


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "oarlock.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def small_state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(4, dtype=torch.int64)}


# ---------------------------------------------------------------- 1. writers never delete user data

def test_convert_into_parent_of_source_deletes_nothing(tmp_path):
    """The reproduction of the issue, run as written: before the fix ``proj`` held only model.safetensors."""
    subprocess.run("mkdir proj && echo precious > proj/notes.txt", shell=True, cwd=tmp_path, check=True)
    save_state_dict(small_state(), tmp_path / "proj" / "ckpt")
    before = tree(tmp_path)
    r = cli("convert", "proj/ckpt", "proj", "--to", "hf", cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "proj: the destination contains the source checkpoint proj/ckpt" in r.stderr
    assert tree(tmp_path) == before
    assert (tmp_path / "proj" / "notes.txt").read_text() == "precious\n"


def test_convert_refuses_source_overlap_and_foreign_directories(tmp_path, monkeypatch, capsys):
    from oarlock.cli import main

    (tmp_path / "proj").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("precious")
    save_state_dict(small_state(), tmp_path / "proj" / "ckpt")
    monkeypatch.chdir(tmp_path)
    before = tree(tmp_path)
    for to in ("hf", "oarlock"):
        for dst, why in [("proj/ckpt", "is the source checkpoint"), ("proj/ckpt/out", "is inside the source"),
                         ("proj/ckpt/../ckpt", "is the source checkpoint"), ("proj", "contains the source"),
                         ("other", "exists and is not a")]:
            assert main(["convert", "proj/ckpt", dst, "--to", to]) == 2, (to, dst)
            err = capsys.readouterr().err
            assert why in err and err.startswith(f"oarlock: error: {dst}: "), (to, dst, err)
            assert tree(tmp_path) == before, (to, dst)


def test_every_writer_refuses_a_directory_that_is_not_its_checkpoint(tmp_path):
    from oarlock.checkpoint.convert import convert_checkpoint, export_hf
    from oarlock.checkpoint.hf import save_hf_checkpoint

    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("precious")
    src = tmp_path / "ckpt"
    save_state_dict(small_state(), src)
    hf = tmp_path / "hf"
    export_hf(src, hf)
    before = tree(tmp_path)
    writers = [lambda d: save_state_dict(small_state(), d), lambda d: convert_checkpoint(src, d),
               lambda d: export_hf(src, d), lambda d: save_hf_checkpoint(iter(small_state().items()), d)]
    for write in writers:
        with pytest.raises(CheckpointError, match="user: exists and is not"):
            write(user)
    # a checkpoint of another format is not replaced either
    with pytest.raises(CheckpointError, match="exists and is not an oarlock checkpoint"):
        save_state_dict(small_state(), hf)
    with pytest.raises(CheckpointError, match="exists and is not a huggingface checkpoint"):
        export_hf(hf, src)
    with pytest.raises(CheckpointError, match="destination is the source"):
        export_hf(src, src)
    assert tree(tmp_path) == before


def test_writers_replace_their_own_format_and_fill_empty_directories(tmp_path):
    from oarlock.checkpoint.convert import export_hf

    empty = tmp_path / "empty"
    empty.mkdir()
    save_state_dict(small_state(), empty)
    save_state_dict({"w": torch.ones(2)}, empty)  # replaces its own kind
    out = {"w": torch.zeros(2)}
    load_state_dict(out, empty)
    assert torch.equal(out["w"], torch.ones(2))
    export_hf(empty, tmp_path / "hf")
    export_hf(empty, tmp_path / "hf")
    assert sorted(os.listdir(tmp_path)) == ["empty", "hf"]  # no hidden leftovers


# ---------------------------------------------------------------- 5. replacement is old-or-new at every instant

_DIE_AFTER_MOVE_ASIDE = textwrap.dedent("""
    import os, sys, torch
    from oarlock.checkpoint import save_state_dict, storage
    storage._exchange = lambda a, b: False       # the two-rename fallback (filesystems without RENAME_EXCHANGE)
    real, calls = os.replace, []
    def dying_replace(a, b):
        calls.append((str(a), str(b)))
        if ".old-" in str(b):                    # the old checkpoint has just been moved aside
            real(a, b)
            os._exit(9)                           # the writer dies before the new one is renamed in
        return real(a, b)
    os.replace = dying_replace
    save_state_dict({"w": torch.full((3,), 2.0)}, sys.argv[1])
""")


def test_death_after_old_is_moved_aside_is_completed_by_the_next_open(tmp_path):
    ck = tmp_path / "ckpt"
    save_state_dict({"w": torch.full((3,), 1.0)}, ck)
    r = subprocess.run([PY, "-c", _DIE_AFTER_MOVE_ASIDE, str(ck)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 9, r.stderr
    assert not ck.exists()  # the instant the issue describes: old data only in a hidden .old-* directory
    out = {"w": torch.zeros(3)}
    load_state_dict(out, ck)  # the open completes the replacement
    assert torch.equal(out["w"], torch.full((3,), 2.0))
    assert os.listdir(tmp_path) == ["ckpt"]


def test_death_before_swap_keeps_the_old_checkpoint(tmp_path):
    script = _DIE_AFTER_MOVE_ASIDE.replace('if ".old-" in str(b):', 'if str(b) == sys.argv[1]:').replace(
        "real(a, b)\n        os._exit(9)", "os._exit(9)")
    ck = tmp_path / "ckpt"
    save_state_dict({"w": torch.full((3,), 1.0)}, ck)
    r = subprocess.run([PY, "-c", script, str(ck)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 9, r.stderr
    out = {"w": torch.zeros(3)}
    load_state_dict(out, ck)
    assert torch.equal(out["w"], torch.full((3,), 1.0)) or torch.equal(out["w"], torch.full((3,), 2.0))
    assert os.listdir(tmp_path) == ["ckpt"]


def test_replacement_uses_one_atomic_exchange_where_available(tmp_path, monkeypatch):
    from oarlock.checkpoint import storage

    swaps = []
    real = storage._exchange
    monkeypatch.setattr(storage, "_exchange", lambda a, b: swaps.append(real(a, b)) or swaps[-1])
    ck = tmp_path / "ckpt"
    save_state_dict({"w": torch.full((3,), 1.0)}, ck)
    save_state_dict({"w": torch.full((3,), 2.0)}, ck)
    out = {"w": torch.zeros(3)}
    load_state_dict(out, ck)
    assert torch.equal(out["w"], torch.full((3,), 2.0))
    assert len(swaps) == 1 and os.listdir(tmp_path) == ["ckpt"]
