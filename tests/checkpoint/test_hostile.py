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

from oarlock.checkpoint import ShardedWeight, load_state_dict, save_state_dict
from oarlock.checkpoint.errors import CheckpointError, CheckpointFormatError
from testkit import listed_metadata, run_cli

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


def small_state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(4, dtype=torch.int64)}


# ---------------------------------------------------------------- 1. writers never delete user data

def test_convert_into_parent_of_source_deletes_nothing(tmp_path):
    """The reproduction of the issue, run as written: before the fix ``proj`` held only model.safetensors."""
    subprocess.run("mkdir proj && echo precious > proj/notes.txt", shell=True, cwd=tmp_path, check=True)
    save_state_dict(small_state(), tmp_path / "proj" / "ckpt")
    before = tree(tmp_path)
    r = run_cli("convert", "proj/ckpt", "proj", "--to", "hf", cwd=tmp_path)
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
    from oarlock.checkpoint.formats.huggingface_writer import save_hf_checkpoint

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
    from oarlock.checkpoint import save_state_dict
    from oarlock.checkpoint.storage.commit import local as storage
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
    from oarlock.checkpoint.storage.commit import local as storage

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


# ---------------------------------------------------------------- 2. nothing outside the checkpoint is opened

def _paddle_ckpt(root: Path, storage_name: str | None = None) -> None:
    """A Paddle checkpoint (0.metadata + 0_0.distcp); ``storage_name`` (10 characters, like ``0_0.distcp``) is
    written into the metadata as the storage file name instead."""
    import numpy as np
    from testkit import write_paddle_checkpoint

    write_paddle_checkpoint(root, {"w": np.arange(12, dtype=np.float32).reshape(3, 4)})
    if storage_name is not None:
        assert len(storage_name) == len("0_0.distcp")
        raw = (root / "0.metadata").read_bytes()
        (root / "0.metadata").write_bytes(raw.replace(b"0_0.distcp", storage_name.encode()))


def _oarlock_meta_file(ck: Path, value: str) -> None:
    import json

    meta = listed_metadata(ck)  # a grid record names no file: list the shards, then name a hostile one
    for t in meta["tensors"].values():
        for s in t["shards"]:
            s["file"] = value
    (ck / "metadata.json").write_text(json.dumps(meta))


def _escape_corpus(base: Path) -> list[tuple[str, Path, str]]:
    """(case, checkpoint directory, text the refusal must contain) for every format; the targets outside the
    checkpoints live in ``base/outside``."""
    from safetensors.torch import save_file

    from oarlock.checkpoint.convert import export_hf

    outside = base / "outside"
    outside.mkdir()
    save_file({"w": torch.full((3, 4), 666.0)}, outside / "secret.safetensors")
    _paddle_ckpt(outside)
    os.rename(outside / "0_0.distcp", outside / "0_0.dcp")
    cases = []

    def oarlock(name: str) -> Path:
        ck = base / name / "ckpt"
        save_state_dict({"w": torch.zeros(3, 4)}, ck)
        return ck

    ck = oarlock("meta_dotdot")
    _oarlock_meta_file(ck, "../../outside/secret.safetensors")
    cases.append(("oarlock metadata file ..", ck, "'../../outside/secret.safetensors'"))
    ck = oarlock("meta_abs")
    _oarlock_meta_file(ck, str(outside / "secret.safetensors"))
    cases.append(("oarlock metadata file absolute", ck, "is an absolute path"))
    ck = oarlock("data_symlink")
    os.unlink(ck / "rank-00000.safetensors")
    os.symlink(outside / "secret.safetensors", ck / "rank-00000.safetensors")
    cases.append(("oarlock data file symlink", ck, "'rank-00000.safetensors' resolves to"))
    ck = oarlock("meta_symlink")
    os.rename(ck / "metadata.json", outside / "metadata.json")
    os.symlink(outside / "metadata.json", ck / "metadata.json")
    cases.append(("oarlock metadata.json symlink", ck, "'metadata.json' resolves to"))

    src = oarlock("hf_src")
    for name, target, want in [("hf_dotdot", "../../outside/secret.safetensors", "tensor 'w'"),
                               ("hf_passwd", "../../../../etc/passwd", "'../../../../etc/passwd'"),
                               ("hf_abs", str(outside / "secret.safetensors"), "is an absolute path")]:
        ck = base / name / "hf"
        export_hf(src, ck, max_shard_size=1)
        import json

        (ck / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {"w": target}}))
        cases.append((f"hf index {name}", ck, want))
    ck = base / "hf_symlink" / "hf"
    ck.mkdir(parents=True)
    os.symlink(outside / "secret.safetensors", ck / "model.safetensors")
    cases.append(("hf model.safetensors symlink", ck, "'model.safetensors' resolves to"))

    ck = base / "paddle_dotdot" / "pd"
    ck.mkdir(parents=True)
    _paddle_ckpt(ck, "../../o/x.d"[:0] + "../0_0.dcp")
    os.rename(base / "outside" / "0_0.dcp", base / "paddle_dotdot" / "0_0.dcp")
    cases.append(("paddle storage file ..", ck, "'../0_0.dcp'"))
    ck = base / "paddle_meta_symlink" / "pd"
    ck.mkdir(parents=True)
    _paddle_ckpt(ck)
    os.unlink(ck / "0.metadata")
    os.symlink(outside / "0.metadata", ck / "0.metadata")
    cases.append(("paddle metadata symlink", ck, "'0.metadata' resolves to"))
    return cases


def test_path_escapes_are_refused_before_opening_in_every_format(tmp_path, opened, capsys):
    from oarlock.checkpoint.storage import open_checkpoint
    from oarlock.cli import main

    cases = _escape_corpus(tmp_path)
    failures = []
    for case, ck, want in cases:
        del opened[:]
        with pytest.raises(CheckpointFormatError) as e1:
            open_checkpoint(ck).close()
        with pytest.raises(CheckpointFormatError) as e2:
            load_state_dict({"w": torch.zeros(3, 4)}, ck)
        codes = [main(["inspect", str(ck)]), main(["convert", str(ck), str(tmp_path / "out"), "--to", "hf"])]
        err = capsys.readouterr().err.strip().splitlines()
        escaped = sorted({p for p in opened if not p.startswith(os.path.realpath(ck.parent))
                          and (p.startswith(os.path.realpath(tmp_path)) or p.startswith("/etc"))})
        for msg in (str(e1.value), str(e2.value), *err):
            if want not in msg or "refusing to open it" not in msg:
                failures.append(f"{case}: message {msg!r} lacks {want!r}")
        if codes != [2, 2] or len(err) != 2:
            failures.append(f"{case}: CLI exit codes {codes}, stderr {err}")
        if escaped:
            failures.append(f"{case}: opened outside the checkpoint: {escaped}")
        assert not (tmp_path / "out").exists(), case
    assert not failures, "\n".join(failures)


def test_convert_does_not_copy_a_side_file_linked_from_outside(tmp_path):
    from oarlock.checkpoint.convert import export_hf

    ck = tmp_path / "ckpt"
    save_state_dict({"w": torch.zeros(3, 4)}, ck)
    (tmp_path / "private.json").write_text('{"token": "secret"}')
    os.symlink(tmp_path / "private.json", ck / "config.json")
    with pytest.raises(CheckpointFormatError, match="side file: file 'config.json' resolves to"):
        export_hf(ck, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# ---------------------------------------------------------------- 3. hostile pickles: refused, no crash, no code

class _Reduce:
    """Pickles as ``fn(*args)`` (and ``BUILD state`` when given): hand-made hostile pickles."""

    def __init__(self, fn, args, state=None):
        self.r = (fn, args) if state is None else (fn, args, state)

    def __reduce__(self):
        return self.r


def _hostile_pickles() -> dict[str, bytes]:
    import pickle

    import numpy as np

    ma = np._core.multiarray
    obj = np.dtype("O")
    arr = lambda shape, dt, raw: _Reduce(ma._reconstruct, (np.ndarray, (0,), b"b"), (1, shape, dt, False, raw))
    payloads = {
        "ndarray object dtype from bytes (the issue's crash)": _Reduce(np.ndarray, ((4,), obj, b"AAAAAAAA" * 4)),
        "_reconstruct object dtype from bytes": arr((4,), obj, b"AAAAAAAA" * 4),
        "_reconstruct object dtype from a list": np.array([1, "x", None], dtype=object),
        "_reconstruct huge shape": arr((10**12, 10**6), np.dtype("float32"), b"AAAA"),
        "ndarray huge shape": _Reduce(np.ndarray, ((10**15,), np.dtype("float32"), b"AAAA")),
        "ndarray without buffer": _Reduce(np.ndarray, ((10**6, 10**6),)),
        "ndarray negative shape": _Reduce(np.ndarray, ((-8,), np.dtype("float32"), b"AAAA")),
        "ndarray strides from the file": _Reduce(np.ndarray, ((4,), np.dtype("float32"), b"AAAA", 0, (10**9,))),
        "scalar object dtype": _Reduce(ma.scalar, (obj, b"AAAAAAAA")),
        "structured dtype with an object field": np.zeros(2, dtype=[("a", "O"), ("b", "f4")]),
        "dtype state claiming object fields": _Reduce(np.dtype, ("V8", False, True),
                                                      (3, "|", None, ("a",), {"a": (np.dtype("V8"), 0)}, 8, 1, 63)),
        "ObjectDType called": _Reduce(np.dtypes.ObjectDType, ()),
        "ndarray subclass": _Reduce(ma._reconstruct, (np.ma.MaskedArray, (0,), b"b")),
        "nested reduce to os.system": {"w": [(1, {"x": _Reduce(os.system, ("touch PWNED",))})]},
        "array state running code": arr((1,), _Reduce(os.system, ("touch PWNED",)), b"AAAA"),
        "numpy.frombuffer (not admitted)": _Reduce(np.frombuffer, (b"AAAA", "f4")),
    }
    out = {k: pickle.dumps({"w": v}, protocol=4) for k, v in payloads.items()}
    deep = 100_000  # nesting far beyond any recursion limit, as raw opcodes (pickle.dumps would recurse)
    out["100000 nested lists around an array"] = (
        b"\x80\x04}\x8c\x01w" + b"]" * deep + pickle.dumps(np.zeros(2, np.float32), protocol=4)[2:-1]
        + b"a" * deep + b"s.")
    return out


_PICKLE_PROBE = textwrap.dedent("""
    # one process imports torch once, then runs each case in a forked child: a SIGSEGV kills only that child
    import contextlib, io, json, os, sys, torch
    from oarlock.checkpoint import load_state_dict
    from oarlock.cli import main
    torch.set_num_threads(1)
    results = {}
    for ck in json.loads(sys.argv[1]):
        pid = os.fork()
        if pid == 0:
            res, err = [], io.StringIO()
            try:
                load_state_dict({"w": torch.zeros(3, 4)}, ck)
                res.append("loaded")
            except Exception as e:
                res.append(f"{type(e).__name__}: {e}")
            with contextlib.redirect_stderr(err):
                res.append(main(["inspect", ck]))
                res.append(main(["convert", ck, ck + ".out", "--to", "hf"]))
            res.append(err.getvalue())
            with open(ck + ".json", "w") as f:
                json.dump(res, f)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        results[ck] = status
    print(json.dumps(results))
""")


def test_hostile_pickles_never_crash_never_run_code(tmp_path):
    """Each hostile pickle, as a Paddle .distcp data file and as the .metadata file, run in its own (forked)
    process so that a SIGSEGV shows: every entry point refuses it naming the file, and no code runs."""
    import json

    cases = {}
    for i, (case, raw) in enumerate(_hostile_pickles().items()):
        for target in ("0_0.distcp", "0.metadata"):
            ck = tmp_path / f"{i}-{target}" / "pd"
            ck.mkdir(parents=True)
            _paddle_ckpt(ck)
            (ck / target).write_bytes(raw)
            cases[str(ck)] = (case, target)
    r = subprocess.run([PY, "-c", _PICKLE_PROBE, json.dumps(list(cases))], capture_output=True, text=True,
                       timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    status = json.loads(r.stdout.strip().splitlines()[-1])
    failures = []
    for ck, (case, target) in cases.items():
        if status[ck] != 0:
            failures.append(f"{case} in {target}: the process died (wait status {status[ck]})")
            continue
        res = json.loads(Path(ck + ".json").read_text())
        lines = [ln for ln in res[3].splitlines() if ln.strip()]
        if not (res[0].split(":")[0] in ("UnsafePickleError", "CheckpointFormatError") and target in res[0]):
            failures.append(f"{case} in {target}: load gave {res[0]!r}")
        # inspect reads only the metadata: a hostile data file shows at convert (which reads it)
        codes = [2, 2] if target == "0.metadata" else [0, 2]
        if res[1:3] != codes or len(lines) != codes.count(2) or not all(target in ln for ln in lines) \
                or "Traceback" in res[3]:
            failures.append(f"{case} in {target}: CLI {res[1:3]} {lines}")
        if (Path(ck) / "PWNED").exists() or (tmp_path / "PWNED").exists() or Path(ck + ".out").exists():
            failures.append(f"{case} in {target}: ran code or wrote output")
    assert not failures, "\n".join(failures)


def test_restricted_unpickler_still_reads_plain_arrays(tmp_path):
    import pickle

    import numpy as np

    from oarlock.checkpoint.formats.paddle_pickle import restricted_load

    arrays = {"f": np.arange(12, dtype=np.float32).reshape(3, 4), "F": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
              "u16": np.arange(5, dtype=np.uint16), "be": np.arange(3, dtype=">i4"), "b": np.array([True, False]),
              "s": np.float16(1.5), "e": np.zeros((0, 3), np.int8)}
    (tmp_path / "a.pkl").write_bytes(pickle.dumps({"x": arrays, "n": [arrays["f"]] * 2}, protocol=4))
    got = restricted_load(tmp_path / "a.pkl")
    for k, v in arrays.items():
        assert got["x"][k].dtype == v.dtype and np.array_equal(got["x"][k], v), k
    assert got["n"][0] is got["n"][1] and np.array_equal(got["n"][0], arrays["f"])


# ---------------------------------------------------------------- 4. async saves are not lost at exit

def test_a_failed_async_save_nobody_waited_for_is_reported_once_at_exit(tmp_path):
    """The destination is a regular file: the background planning refuses it. Nobody calls ``wait()``, so the exit
    hook reports the failure: once on stderr (logging unconfigured), naming the path and the reason; the file is
    left as it was."""
    target = tmp_path / "file"
    target.write_text("hi")
    script = textwrap.dedent(f"""
        import torch
        from oarlock.checkpoint import save_state_dict
        save_state_dict({{"w": torch.ones(3)}}, {str(target)!r}, async_save=True)
    """)
    r = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.stderr.count("FAILED") == 1, r.stderr
    assert f"async save to {target} FAILED" in r.stderr and "not a directory" in r.stderr, r.stderr
    assert target.read_text() == "hi"


def test_async_save_on_the_last_line_of_a_script_is_committed(tmp_path):
    ck = tmp_path / "ckpt"
    script = textwrap.dedent(f"""
        import torch
        from oarlock.checkpoint import save_state_dict
        state = {{"w": torch.arange(24 * 1024 * 1024, dtype=torch.float32), "b": torch.ones(3)}}
        save_state_dict(state, {str(ck)!r}, async_save=True)
    """)
    r = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "FAILED" not in r.stderr, r.stderr
    out = {"w": torch.zeros(24 * 1024 * 1024), "b": torch.zeros(3)}
    load_state_dict(out, ck)
    assert torch.equal(out["w"], torch.arange(24 * 1024 * 1024, dtype=torch.float32))
    assert torch.equal(out["b"], torch.ones(3))


def test_async_save_failing_in_the_background_is_reported_at_exit(tmp_path):
    ck = tmp_path / "ckpt"
    script = textwrap.dedent(f"""
        import errno, os, torch
        from oarlock.checkpoint import save_state_dict
        from oarlock.checkpoint.runtime import save
        def full(*a, **k):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        save.write_safetensors = full
        save_state_dict({{"w": torch.ones(3)}}, {str(ck)!r}, async_save=True)
    """)
    r = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=300)
    assert f"async save to {ck} FAILED" in r.stderr and "No space left on device" in r.stderr, r.stderr
    assert not ck.exists() and os.listdir(tmp_path) == []


# ---------------------------------------------------------------- 7. one rank fails: every rank raises

def test_one_damaged_rank_fails_every_rank_alike(multirank):
    """4 gloo ranks, each reading only its own file; rank 2's file is truncated, or its read fails: before the
    fix the other ranks returned success and the job hung at its next collective."""
    outcome = multirank("_hostile_scenarios", world=4)
    outcome.check()


# ---------------------------------------------------------------- 6. mixed or damaged data never loads

def _two_file_checkpoint(path: Path, value: float) -> None:
    """An oarlock checkpoint of ``w`` (4 x 4, all ``value``) and ``b`` split over two data files (tp=2)."""
    from oarlock.checkpoint.convert import convert_checkpoint
    from safetensors.torch import save_file

    src = path.parent / f".src-{value}.safetensors"
    save_file({"model.layers.0.mlp.down_proj.weight": torch.full((4, 4), value), "b": torch.full((3,), value)},
              src)
    convert_checkpoint(src, path, tp=2)


def test_a_data_file_of_another_save_is_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    save_state_dict({"w": torch.full((3, 4), 1.0)}, a)
    save_state_dict({"w": torch.full((3, 4), 2.0)}, b)  # same layout, another save
    os.replace(b / "rank-00000.safetensors", a / "rank-00000.safetensors")
    out = {"w": torch.zeros(3, 4)}
    with pytest.raises(CheckpointFormatError, match=r"rank-00000.safetensors: data file of save .* mixes files of "
                                                    "two saves"):
        load_state_dict(out, a)
    assert torch.equal(out["w"], torch.zeros(3, 4))
    _two_file_checkpoint(tmp_path / "c", 1.0)
    _two_file_checkpoint(tmp_path / "d", 2.0)
    os.replace(tmp_path / "d" / "rank-00001.safetensors", tmp_path / "c" / "rank-00001.safetensors")
    from oarlock.checkpoint.convert import export_hf

    with pytest.raises(CheckpointFormatError, match="rank-00001.safetensors: data file of save"):
        export_hf(tmp_path / "c", tmp_path / "hf")


def test_same_layout_restart_validates_against_metadata(tmp_path):
    import json

    ck = tmp_path / "ck"
    save_state_dict({"w": torch.full((3, 4), 1.0)}, ck)
    meta = listed_metadata(ck)
    meta["tensors"]["w"]["global_shape"] = [6, 4]
    meta["tensors"]["w"]["shards"][0]["local_shape"] = [6, 4]
    (ck / "metadata.json").write_text(json.dumps(meta))
    out = {"w": torch.zeros(3, 4)}
    with pytest.raises(CheckpointError, match="'w'"):
        load_state_dict(out, ck)
    assert torch.equal(out["w"], torch.zeros(3, 4))
    os.unlink(ck / "metadata.json")
    with pytest.raises(CheckpointFormatError, match="metadata.json: missing; the oarlock data files"):
        load_state_dict(out, ck)
    assert torch.equal(out["w"], torch.zeros(3, 4))


def test_a_truncated_file_is_found_before_any_target_byte_is_written(tmp_path):
    ck = tmp_path / "ck"
    _two_file_checkpoint(ck, 7.0)
    f = ck / "rank-00001.safetensors"
    os.truncate(f, os.path.getsize(f) - 4)
    out = {"model.layers.0.mlp.down_proj.weight": torch.zeros(4, 4), "b": torch.zeros(3)}
    with pytest.raises(CheckpointFormatError, match="rank-00001.safetensors"):
        load_state_dict(out, ck)
    assert all(torch.equal(t, torch.zeros_like(t)) for t in out.values())


def test_overlapping_header_offsets_are_refused(tmp_path):
    import json
    import struct

    from oarlock.checkpoint.storage.safetensors import read_header

    hdr = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
           "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    hb = json.dumps(hdr).encode()
    hb += b" " * (-len(hb) % 8)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(hb)) + hb + bytes(12))
    with pytest.raises(CheckpointFormatError, match="model.safetensors: invalid safetensors file: .*`?b"):
        load_state_dict({"a": torch.zeros(2), "b": torch.zeros(2)}, tmp_path)
    with open(tmp_path / "model.safetensors", "rb") as fh:  # the own check, without the library's
        import unittest.mock

        with unittest.mock.patch("oarlock.checkpoint.storage.safetensors._library_check"):
            with pytest.raises(CheckpointFormatError, match="tensors 'a' and 'b' overlap"):
                read_header(tmp_path / "model.safetensors", fh.fileno())


def test_a_load_racing_a_replacement_sees_one_save_or_fails(tmp_path, monkeypatch):
    """The checkpoint is replaced by another save right after the load read its metadata: the load raises (the
    data files are of another save) and writes nothing; it never returns rows of both."""
    from oarlock.checkpoint.runtime import load as load_mod
    from oarlock.checkpoint.convert import convert_checkpoint

    ck = tmp_path / "ck"
    _two_file_checkpoint(ck, 1.0)
    _two_file_checkpoint(tmp_path / "next", 2.0)
    real = load_mod.open_checkpoint

    def open_then_replace(*a, **k):
        reader = real(*a, **k)
        convert_checkpoint(tmp_path / "next", ck, tp=2)  # another job publishes a new save meanwhile
        return reader

    monkeypatch.setattr(load_mod, "open_checkpoint", open_then_replace)
    out = {"model.layers.0.mlp.down_proj.weight": torch.zeros(4, 4), "b": torch.zeros(3)}
    with pytest.raises(CheckpointFormatError, match="mixes files of two saves .*replaced while being read"):
        load_state_dict(out, ck)
    assert all(torch.equal(t, torch.zeros_like(t)) for t in out.values())


# ---------------------------------------------------------------- 8. bad inputs name the key or the file

def test_key_named_like_the_safetensors_metadata_block_saves_and_loads(tmp_path):
    """A key ``__metadata__`` is an ordinary key of an oarlock checkpoint: stored under another tensor name in the
    data file (safetensors reserves the name for its header block), loaded back bit-exactly, also after ``convert
    --to oarlock --tp 2``. A HuggingFace export, whose tensor names are the keys, refuses it before writing,
    naming the key and the AOA rename that exports it."""
    from safetensors import safe_open

    from oarlock.checkpoint.convert import convert_checkpoint, export_hf
    from oarlock.checkpoint.formats.huggingface_writer import save_hf_checkpoint

    m = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    sd = {"__metadata__": m.clone(), "w": torch.full((2,), 7.0), "__metadata__.s": torch.tensor(3.5)}
    save_state_dict(sd, tmp_path / "ck")
    with safe_open(tmp_path / "ck" / "rank-00000.safetensors", "pt") as f:  # the safetensors library's view
        stored = {n: f.get_tensor(n) for n in f.keys()}
    assert "__metadata__" not in stored and any(torch.equal(t, m) for t in stored.values())
    for src in ("ck", "tp2"):
        if src == "tp2":
            convert_checkpoint(tmp_path / "ck", tmp_path / "tp2", tp=2, tp_rules={"__metadata__": 0})
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        report = load_state_dict(out, tmp_path / src)
        assert report.missing_keys == [] and report.unexpected_keys == []
        for k, v in sd.items():
            assert torch.equal(out[k], v), (src, k)
    assert run_cli("verify", tmp_path / "tp2").returncode == 0
    msg = r"key '__metadata__': a HuggingFace checkpoint stores each tensor under its key.*__metadata__ -> NEW_NAME"
    with pytest.raises(CheckpointError, match=msg):
        export_hf(tmp_path / "ck", tmp_path / "hf")
    save_state_dict({"w": torch.ones(2)}, tmp_path / "ok")
    with pytest.raises(CheckpointError, match=msg):  # a rename onto the name
        export_hf(tmp_path / "ok", tmp_path / "hf", aoa_config={"aoa_statements": ["w -> __metadata__"]})
    with pytest.raises(CheckpointError, match=msg):
        save_hf_checkpoint(iter([("__metadata__", torch.ones(2))]), tmp_path / "hf")
    r = run_cli("convert", tmp_path / "ck", tmp_path / "hf", "--to", "hf")
    assert r.returncode == 2 and "key '__metadata__'" in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path)) == ["ck", "ok", "tp2"]
    export_hf(tmp_path / "ck", tmp_path / "hf", aoa_config={"aoa_statements": ["__metadata__ -> m"]})
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert sorted(f.keys()) == ["__metadata__.s", "m", "w"] and torch.equal(f.get_tensor("m"), m)


def test_unsupported_dtype_names_the_key(tmp_path):
    with pytest.raises(CheckpointError, match="key 'z': dtype torch.complex128 is not supported"):
        save_state_dict({"w": torch.ones(2), "z": torch.ones(2, dtype=torch.complex128)}, tmp_path / "ck")
    assert os.listdir(tmp_path) == []


def test_disk_full_names_the_file_and_tensor(tmp_path, monkeypatch):
    import errno

    from oarlock.checkpoint.convert import export_hf

    save_state_dict({"w": torch.ones(2), "v": torch.ones(3)}, tmp_path / "src")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    monkeypatch.setattr(os, "copy_file_range", full)
    with pytest.raises(CheckpointError, match=r"rank-00000.safetensors: cannot write the header: No space left on "
                                              r"device \(the disk is full\)"):
        save_state_dict({"w": torch.ones(2)}, tmp_path / "ck")
    with pytest.raises(CheckpointError, match=r"model.safetensors: cannot write the header: No space left"):
        export_hf(tmp_path / "src", tmp_path / "hf")
    assert sorted(os.listdir(tmp_path)) == ["src"]  # nothing half-written was published or left behind


def test_hub_cache_snapshot_links_into_blobs_are_allowed(tmp_path):
    """A HuggingFace hub cache keeps files in ``blobs/`` and links them from ``snapshots/REV/``: that layout loads;
    a link from the snapshot to anywhere else is still refused."""
    from safetensors.torch import save_file

    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    save_file({"w": torch.arange(6.0)}, repo / "blobs" / "f00d")
    os.symlink("../../blobs/f00d", snap / "model.safetensors")
    out = {"w": torch.zeros(6)}
    load_state_dict(out, snap)
    assert torch.equal(out["w"], torch.arange(6.0))
    save_file({"w": torch.ones(6)}, tmp_path / "elsewhere.safetensors")
    os.unlink(snap / "model.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", snap / "model.safetensors")
    with pytest.raises(CheckpointFormatError, match="'model.safetensors' resolves to .*outside the checkpoint"):
        load_state_dict(out, snap)


def test_a_missing_array_among_many_small_reads_is_found_before_any_target_byte_is_written(tmp_path):
    """A reshard of many small listed shards reads each file as one span: every item of every file is checked
    (here one stored array is gone from the file) before the first copy into a target."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    ck = tmp_path / "ck"
    full = {f"k{i}": torch.arange(32, dtype=torch.float32).reshape(8, 4) + 100 * i for i in range(8)}
    # uneven row halves, given as two ShardedWeights of one key: listed shards, named entries of one file
    save_state_dict({k: [ShardedWeight(k, t[:3].clone(), (3, 4), (8, 4), (0, 0)),
                         ShardedWeight(k, t[3:].clone(), (5, 4), (8, 4), (3, 0))]
                     for k, t in full.items()}, ck)
    files = sorted(p.name for p in ck.glob("*.safetensors"))
    assert files == ["rank-00000.safetensors"]
    out = {k: ShardedWeight(k, torch.zeros(8, 2), (8, 2), (8, 4), (0, 2)) for k in full}
    load_state_dict(out, ck)  # the intact checkpoint: 16 items, one file, read as one span
    assert all(torch.equal(out[k].local_tensor, t[:, 2:]) for k, t in full.items())
    f = ck / files[0]
    with safe_open(str(f), "pt") as fh:
        meta = fh.metadata()
        kept = {n: fh.get_tensor(n) for n in fh.keys() if n != "k5@3,0"}
    assert len(kept) == 15
    save_file(kept, str(f), metadata=meta)  # the same save id, one array less
    out = {k: ShardedWeight(k, torch.zeros(8, 2), (8, 2), (8, 4), (0, 2)) for k in full}
    with pytest.raises(CheckpointFormatError, match=r"rank-00000\.safetensors: tensor 'k5@3,0' is missing"):
        load_state_dict(out, ck)
    assert all(torch.equal(sw.local_tensor, torch.zeros(8, 2)) for sw in out.values())


def test_a_load_looks_only_at_the_data_files_it_reads(tmp_path, monkeypatch):
    """Which data files a rank can open is asked of the files its own reads touch, not of every data file of the
    save again: a file the load does not read is looked at once, by the open's check that every data file of the
    metadata exists (itself one ``stat`` per data file: see issue 26's note)."""
    from pathlib import Path as P

    from oarlock.checkpoint import ShardedWeight
    from oarlock.checkpoint.convert import convert_checkpoint
    from safetensors.torch import save_file

    key = "model.layers.0.mlp.down_proj.weight"  # row-parallel: split along dim 1 over the tp ranks
    full = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    save_file({key: full}, tmp_path / "src.safetensors")
    convert_checkpoint(tmp_path / "src.safetensors", tmp_path / "ck", tp=4)
    files = sorted(p.name for p in (tmp_path / "ck").glob("rank-*.safetensors"))
    assert len(files) == 4
    asked: list[str] = []
    real = P.is_file
    monkeypatch.setattr(P, "is_file", lambda self: (asked.append(self.name), real(self))[1])
    out = ShardedWeight(key, torch.zeros(4, 2), (4, 2), (4, 8), (0, 2))  # columns 2:4: one stored shard
    load_state_dict({key: out}, tmp_path / "ck", strict=False)
    assert torch.equal(out.local_tensor, full[:, 2:4])
    data_asked = [n for n in asked if n.startswith("rank-")]
    # columns 2:4 are tp rank 1's; rank 0's file is also this process's own (the warm-start check looks at it)
    unread = [f for f in files if f not in ("rank-00000.safetensors", "rank-00001.safetensors")]
    assert sorted(n for n in data_asked if n in unread) == unread, data_asked  # once each
