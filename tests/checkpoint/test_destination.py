"""The destination rule (docs/checkpoint-format.md): nothing a writer did not write is ever deleted, and temporary
directories of crashed writes are cleaned by a later write without touching a live one's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testkit import listed_metadata
import torch

from oarlock.checkpoint import CheckpointManager, load_state_dict, save_state_dict
from oarlock.checkpoint.errors import CheckpointDestinationError
from oarlock.checkpoint.storage import WRITTEN_MANIFEST, hold_staging, release_staging, staging_path
from oarlock.cli import main


def state(v: float = 1.0) -> dict:
    return {"w": torch.full((4, 3), v), "b": torch.arange(5, dtype=torch.float32) * v}


def tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def loaded(path: Path) -> dict:
    out = {"w": torch.zeros(4, 3), "b": torch.zeros(5)}
    load_state_dict(out, path)
    return out


# ---------------------------------------------------------------- convert / export onto an earlier output

def test_convert_to_hf_onto_own_output_with_a_user_note(tmp_path, capsys):
    src = tmp_path / "ck"
    save_state_dict(state(1.0), src)
    out = tmp_path / "hf"
    assert main(["convert", str(src), str(out), "--to", "hf"]) == 0
    assert json.loads((out / WRITTEN_MANIFEST).read_text())["files"] == [WRITTEN_MANIFEST, "model.safetensors"]
    # a re-export onto its own output (nothing else there) replaces it without asking
    save_state_dict(state(2.0), src)
    assert main(["convert", str(src), str(out), "--to", "hf"]) == 0
    (out / "mynote.txt").write_text("my notes")
    save_state_dict(state(3.0), src)
    before = tree(tmp_path)
    capsys.readouterr()
    assert main(["convert", str(src), str(out), "--to", "hf"]) == 2
    err = capsys.readouterr().err
    assert f"{out}: holds entries oarlock did not write: 'mynote.txt'" in err and "--overwrite" in err
    assert tree(tmp_path) == before  # nothing written, nothing removed
    assert main(["convert", str(src), str(out), "--to", "hf", "--overwrite"]) == 0
    assert (out / "mynote.txt").read_text() == "my notes"
    from safetensors.torch import load_file

    assert torch.equal(load_file(out / "model.safetensors")["w"], torch.full((4, 3), 3.0))
    assert "mynote.txt" not in json.loads((out / WRITTEN_MANIFEST).read_text())["files"]
    assert sorted(os.listdir(tmp_path)) == ["ck", "hf"]  # no hidden leftovers
    # the note is still not oarlock's: the next plain export is refused again
    assert main(["convert", str(src), str(out), "--to", "hf"]) == 2


def test_overwrite_refuses_to_replace_a_user_file_under_a_name_it_writes(tmp_path):
    from oarlock.checkpoint.convert import export_hf

    src = tmp_path / "ck"
    save_state_dict(state(), src)
    (src / "config.json").write_text('{"model_type": "llama"}')  # a side file the export copies
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("the user's own config")
    before = tree(tmp_path)
    with pytest.raises(CheckpointDestinationError, match=r"hf: holds 'config.json', which oarlock did not write"):
        export_hf(src, out, overwrite=True)
    assert tree(tmp_path) == before


def test_overwrite_never_mixes_in_a_foreign_checkpoint_of_another_format(tmp_path):
    from safetensors.torch import save_file

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    save_file({"x": torch.ones(2)}, foreign / "model.safetensors")
    (foreign / "config.json").write_text("{}")
    (foreign / WRITTEN_MANIFEST).write_text(json.dumps({"files": ["config.json"]}))  # model.safetensors not ours
    before = tree(tmp_path)
    with pytest.raises(CheckpointDestinationError, match="holds a huggingface checkpoint oarlock did not write"):
        save_state_dict(state(), foreign, overwrite=True)
    assert tree(tmp_path) == before


def test_convert_to_oarlock_and_dcp_keep_user_entries_only_with_overwrite(tmp_path):
    from oarlock.checkpoint.convert import convert_checkpoint, convert_to_dcp

    src = tmp_path / "ck"
    save_state_dict(state(5.0), src)
    for fn, name in ((convert_checkpoint, "oarlock"), (convert_to_dcp, "dcp")):
        out = tmp_path / name
        fn(src, out)
        (out / "logs").mkdir()
        (out / "logs" / "run.txt").write_text("log")
        with pytest.raises(CheckpointDestinationError, match=r"holds entries oarlock did not write: 'logs'"):
            fn(src, out)
        fn(src, out, overwrite=True)
        assert (out / "logs" / "run.txt").read_text() == "log", name
    assert torch.equal(loaded(tmp_path / "oarlock")["w"], torch.full((4, 3), 5.0))


# ---------------------------------------------------------------- save_state_dict, HF writer, manager

def test_save_state_dict_keeps_what_it_did_not_write(tmp_path):
    ck = tmp_path / "ck"
    save_state_dict(state(1.0), ck)
    (ck / "README.md").write_text("what this run was")
    with pytest.raises(CheckpointDestinationError) as e:
        save_state_dict(state(2.0), ck)
    assert str(e.value).startswith(f"{ck}: holds entries oarlock did not write: 'README.md'")
    assert torch.equal(loaded(ck)["w"], torch.full((4, 3), 1.0))
    save_state_dict(state(2.0), ck, overwrite=True)
    assert (ck / "README.md").read_text() == "what this run was"
    assert torch.equal(loaded(ck)["w"], torch.full((4, 3), 2.0))
    # a plain directory of user files: refused, or written next to them with overwrite
    user = tmp_path / "user"
    user.mkdir()
    (user / "a.txt").write_text("a")
    with pytest.raises(CheckpointDestinationError, match=r"user: exists and is not an oarlock checkpoint; refusing "
                                                         r"to replace it \(it holds entries oarlock did not write: "
                                                         r"'a.txt'\)"):
        save_state_dict(state(), user)
    save_state_dict(state(), user, overwrite=True)
    assert (user / "a.txt").read_text() == "a" and torch.equal(loaded(user)["b"], state()["b"])
    # a file is never replaced, even with overwrite
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(CheckpointDestinationError, match="file: exists and is not a directory"):
        save_state_dict(state(), f, overwrite=True)
    assert f.read_text() == "x"


def test_save_hf_checkpoint_keeps_what_it_did_not_write(tmp_path):
    from oarlock.checkpoint.formats.huggingface_writer import save_hf_checkpoint

    out = tmp_path / "hf"
    save_hf_checkpoint(iter(state().items()), out)
    (out / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointDestinationError, match="holds entries oarlock did not write: 'tokenizer.json'"):
        save_hf_checkpoint(iter(state(2.0).items()), out)
    save_hf_checkpoint(iter(state(2.0).items()), out, overwrite=True)
    assert (out / "tokenizer.json").read_text() == "{}"


def test_manager_refuses_user_files_in_a_step_and_rotation_spares_them(tmp_path):
    root = tmp_path / "run"
    mgr = CheckpointManager(root, keep_last=1)
    mgr.save(1, state(1.0))
    (mgr.path(1) / "eval.txt").write_text("loss 1.0")
    with pytest.raises(CheckpointDestinationError, match=r"step-00000001: holds entries oarlock did not write: "
                                                         r"'eval.txt'"):
        mgr.save(1, state(9.0))
    mgr.save(1, state(1.5), overwrite=True)
    assert (mgr.path(1) / "eval.txt").read_text() == "loss 1.0"
    mgr.save(2, state(2.0))  # rotates step 1 out: its files go, the user's note stays
    assert mgr.steps() == [2] and mgr.latest() == 2
    assert sorted(os.listdir(mgr.path(1))) == ["eval.txt"]
    assert (mgr.path(1) / "eval.txt").read_text() == "loss 1.0"


# ---------------------------------------------------------------- a crash while the user's entries are moved

def test_crash_during_an_overwrite_puts_the_user_entries_back(tmp_path, monkeypatch):
    import oarlock.checkpoint.storage.commit.local as storage  # the filesystem commit protocol

    ck = tmp_path / "ck"
    save_state_dict(state(1.0), ck)
    (ck / "note.txt").write_text("keep me")
    before = tree(ck)

    def boom(a, b):
        raise KeyboardInterrupt  # interrupted after the note moved into the new directory, before the swap

    monkeypatch.setattr(storage, "_exchange", boom)
    with pytest.raises(KeyboardInterrupt):
        save_state_dict(state(2.0), ck, overwrite=True)
    assert tree(ck) == before and sorted(os.listdir(tmp_path)) == ["ck"]


def _save_killed_at(module: str, attr: str, path: Path, state: str, *, overwrite: bool = False) -> None:
    """``save_state_dict(STATE, path)`` in a fresh process (``state``: the Python text of STATE) that dies with
    ``os._exit(9)`` when the save calls ``module.attr``: a writer SIGKILLed at that point."""
    code = (f"import os, torch, {module} as s\n"
            "from oarlock.checkpoint import save_state_dict\n"
            f"s.{attr} = lambda *a, **k: os._exit(9)\n"
            f"save_state_dict({state}, {str(path)!r}, overwrite={overwrite})\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 9


def test_recovery_after_a_killed_overwrite_puts_the_user_entries_back(tmp_path):
    """The writer is SIGKILLed after moving the user's entry into its new directory: the next open restores the
    old checkpoint with the entry."""
    ck = tmp_path / "ck"
    save_state_dict(state(1.0), ck)
    (ck / "note.txt").write_text("keep me")
    before = tree(ck)
    _save_killed_at("oarlock.checkpoint.storage.commit.local", "_exchange", ck, "{'w': torch.ones(4, 3), 'b': torch.ones(5)}",
                    overwrite=True)
    assert "note.txt" not in os.listdir(ck)  # it sits in the unpublished directory now
    assert torch.equal(loaded(ck)["w"], torch.full((4, 3), 1.0))  # the open recovers first
    assert tree(ck) == before and sorted(os.listdir(tmp_path)) == ["ck"]


# ---------------------------------------------------------------- temporary directories of crashed saves

def _crashed_save(path: Path) -> None:
    """A save killed after writing its data file, before the commit (its temporary directory stays)."""
    _save_killed_at("oarlock.checkpoint.storage.commit.local", "publish_directory", path, "{'w': torch.ones(4, 3)}")


def test_plain_save_removes_crashed_temporaries_but_not_a_live_one(tmp_path):
    ck = tmp_path / "ck"
    _crashed_save(ck)
    first = [n for n in os.listdir(tmp_path) if n.startswith(".ck.tmp-")]
    assert len(first) == 1 and (tmp_path / first[0] / "rank-00000.safetensors").is_file()
    _crashed_save(ck)  # a later save (crashed too) removed the first one's leftover
    crashed = [n for n in os.listdir(tmp_path) if n.startswith(".ck.tmp-")]
    assert len(crashed) == 1 and crashed != first
    live = staging_path(ck)
    fd = hold_staging(live)  # another save still writing into its temporary directory
    (live / "rank-00000.safetensors").write_bytes(b"partial")
    (tmp_path / ".ck.tmp-notadir").write_text("a file of the user's")  # not a directory: never touched
    other = tmp_path / ".other.tmp-123456789abc"  # a crashed save to another path: not this save's business
    other.mkdir()
    try:
        save_state_dict(state(), ck)
        assert sorted(os.listdir(tmp_path)) == sorted([".ck.tmp-notadir", live.name, other.name, "ck"])
        assert (live / "rank-00000.safetensors").read_bytes() == b"partial"
    finally:
        release_staging(fd)
    save_state_dict(state(2.0), ck)  # now that writer is gone: its directory is a leftover too
    assert sorted(os.listdir(tmp_path)) == sorted([".ck.tmp-notadir", other.name, "ck"])
    assert torch.equal(loaded(ck)["w"], torch.full((4, 3), 2.0))


def test_manager_cleanup_skips_a_live_save_directory(tmp_path):
    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    mgr.save(1, state())
    live = staging_path(mgr.path(2))
    fd = hold_staging(live)
    try:
        _crashed_save(mgr.path(3))
        removed = mgr.clean_stale()
        assert len(removed) == 1 and removed[0].startswith(".step-00000003.tmp-")
        assert live.is_dir()
    finally:
        release_staging(fd)
    assert mgr.clean_stale() == [live.name]


def test_hf_export_removes_crashed_temporaries(tmp_path):
    from oarlock.checkpoint.convert import export_hf

    src = tmp_path / "ck"
    save_state_dict(state(), src)
    out = tmp_path / "hf"
    stale = staging_path(out)
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    export_hf(src, out)
    assert sorted(os.listdir(tmp_path)) == ["ck", "hf"]


# ---------------------------------------------------------------- hostile inputs found by the hidden suite

def test_every_paddle_safetensors_header_is_checked_before_a_target_is_written(tmp_path):
    import numpy as np

    from oarlock.checkpoint.errors import CheckpointFormatError
    from testkit import write_paddle_checkpoint

    write_paddle_checkpoint(tmp_path, {"a": np.ones((3, 2), np.float32), "z": np.ones(4, np.float32)},
                            "safetensors", rank_of={"a": 0, "z": 1})
    bad = tmp_path / "1_0.safetensors"
    b = bytearray(bad.read_bytes())
    b[8:10] = b"[["  # the header of rank 1's file is no longer a JSON object
    bad.write_bytes(bytes(b))
    out = {"a": torch.full((3, 2), -1.0), "z": torch.full((4,), -1.0)}
    with pytest.raises(CheckpointFormatError, match=r"1_0\.safetensors: invalid safetensors file"):
        load_state_dict(out, tmp_path)
    assert torch.equal(out["a"], torch.full((3, 2), -1.0))  # rank 0's file was valid, and still nothing was written


@pytest.mark.parametrize("field, value, expected", [
    ("tensors", [], 'field "tensors" must be a JSON object, found a list'),
    ("objects", "x", 'field "objects" must be a JSON object, found a string'),
    ("tensors.w", [1], "field tensors['w'] must be a JSON object"),
    ("tensors.w.shards", {}, "field tensors['w'].shards must be a list, found an object"),
    ("tensors.w.shards.0.local_shape", "4", "field tensors['w'].shards[0].local_shape must be a list of integers, "
                                            "found a string"),
])
def test_metadata_field_of_the_wrong_json_type_is_named(tmp_path, field, value, expected):
    from oarlock.checkpoint.errors import CheckpointFormatError

    ck = tmp_path / "ck"
    save_state_dict({"w": torch.ones(4)}, ck)
    meta = listed_metadata(ck)  # the shard-list form, whose fields are edited below
    node, *path = field.split(".")
    if not path:
        meta[node] = value
    else:
        d = meta[node]
        for p in path[:-1]:
            d = d[int(p)] if isinstance(d, list) else d[p]
        d[int(path[-1]) if isinstance(d, list) else path[-1]] = value
    (ck / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointFormatError) as e:
        load_state_dict({"w": torch.zeros(4)}, ck)
    assert str(e.value) == f"{ck / 'metadata.json'}: {expected}" or str(e.value).startswith(
        f"{ck / 'metadata.json'}: {expected}")


def test_conjugate_and_negative_views_are_saved_as_the_values_they_show(tmp_path):
    from oarlock.checkpoint.formats.huggingface_writer import save_hf_checkpoint
    from safetensors.torch import load_file

    x = torch.randn(3, 4, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    sd = {"c": x.conj(), "n": x.conj().imag}
    assert sd["c"].is_conj() and sd["n"].is_neg()
    save_state_dict(sd, tmp_path / "ck")
    out = {"c": torch.zeros(3, 4, dtype=torch.complex64), "n": torch.zeros(3, 4)}
    load_state_dict(out, tmp_path / "ck")  # the block checksums are verified on the way
    assert torch.equal(out["c"], x.conj().resolve_conj()) and torch.equal(out["n"], -x.imag)
    save_hf_checkpoint(iter(sd.items()), tmp_path / "hf")
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert torch.equal(got["c"], x.conj().resolve_conj()) and torch.equal(got["n"], -x.imag)


# ---------------------------------------------------------------- commands on a CheckpointManager root

def test_commands_on_a_manager_root_read_the_latest_committed_step(tmp_path, capsys):
    root = tmp_path / "run"
    mgr = CheckpointManager(root, keep_last=None)
    mgr.save(100, state(1.0))
    mgr.save(200, state(2.0))
    (root / ".step-00000300.tmp-abcdef123456").mkdir()  # a save in flight is not the latest
    said = f"{root}: a CheckpointManager root; reading its latest committed step step-00000200"
    capsys.readouterr()
    assert main(["inspect", str(root)]) == 0
    out, err = capsys.readouterr()
    assert said in err and out.startswith(f"{mgr.path(200)}: oarlock checkpoint, 2 tensors")
    assert main(["verify", str(root)]) == 0
    assert said in capsys.readouterr().err
    assert main(["diff", str(root), str(mgr.path(200))]) == 0  # the same step: equal
    assert said in capsys.readouterr().err
    assert main(["diff", str(root), str(mgr.path(100))]) == 1
    assert main(["convert", str(root), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert said in capsys.readouterr().err
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "hf" / "model.safetensors")["w"], torch.full((4, 3), 2.0))
    # the pointer wins over the highest number; without it, the highest committed step
    (root / "latest").write_text("step-00000100\n")
    capsys.readouterr()
    assert main(["inspect", str(root)]) == 0
    assert "latest committed step step-00000100" in capsys.readouterr().err
    (root / "latest").unlink()
    assert main(["inspect", str(root)]) == 0
    assert "latest committed step step-00000200" in capsys.readouterr().err
    # a directory with nothing committed still says what it looked for
    empty = tmp_path / "empty_run"
    empty.mkdir()
    assert main(["inspect", str(empty)]) == 2
    assert "no checkpoint found" in capsys.readouterr().err
