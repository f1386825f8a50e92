"""Asynchronous saves (issue 27): plan reuse and its invalidation, the background snapshot (``wait_staged``), the
manager's asynchronous path, SIGKILL during background staging and writing, and the writeback overlap
(``sync_file_range``) against its fallback. Expected values are clones taken before the state changed or plain
torch tensors; files are compared byte for byte. Nothing here is timed."""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from multirank import each_scenario, launch_fixture
from oarlock.checkpoint import (CheckpointError, CheckpointManager, async_save, convert_checkpoint, export_hf,
                                load_state_dict, save_state_dict)
from oarlock.checkpoint.storage import safetensors as safetensors_io
from oarlock.checkpoint.runtime.save import plan_cache
from oarlock.checkpoint.storage import INCOMPLETE_MARKER

# the module (the package's ``async_save`` attribute is the function)
async_mod = importlib.import_module("oarlock.checkpoint.lifecycle.async_save")

launched = launch_fixture("_async_scenarios", worlds=(2,), timeout_s=300)


@pytest.mark.multiproc
@each_scenario("_async_scenarios", worlds=(2,))
def test_two_ranks_plan_reuse_and_async(launched, world, scenario):
    launched.check(scenario, world)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _load_equal(path: Path, want: dict) -> None:
    got = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in want.items()}
    load_state_dict(got, path)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(_bits(got[k]), _bits(v)), k
        else:
            assert got[k] == v, k


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(32, 16, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16),
            "i": torch.arange(5, dtype=torch.int64) * 10**12, "step": 1}


# ---------------------------------------------------------------- plan reuse

def test_plan_reused_until_a_key_shape_or_dtype_changes(tmp_path):
    plan_cache.clear()
    h0, m0 = plan_cache.hits, plan_cache.misses

    def save(sd, name):
        save_state_dict(sd, tmp_path / name)
        _load_equal(tmp_path / name, sd)
        return plan_cache.hits - h0, plan_cache.misses - m0

    sd = _state()
    assert save(sd, "a") == (0, 1)
    sd["w"].add_(1)
    sd["step"] = 2  # JSON values change every save; the plan does not
    assert save(sd, "b") == (1, 1)
    sd["x"] = torch.ones(3)  # a new key
    assert save(sd, "c") == (1, 2)
    assert save(sd, "d") == (2, 2)
    sd["x"] = torch.ones(4)  # a new shape
    assert save(sd, "e") == (2, 3)
    sd["x"] = torch.ones(4, dtype=torch.float64)  # a new dtype
    assert save(sd, "f") == (2, 4)
    del sd["x"]  # a key removed
    assert save(sd, "g") == (2, 5)
    save_state_dict(sd, tmp_path / "h", save_replicas=True)  # another write assignment rule: its own plan
    assert plan_cache.misses - m0 == 6
    _load_equal(tmp_path / "h", sd)


def test_reused_plan_writes_the_same_files_as_a_fresh_plan(tmp_path):
    sd = _state()
    plan_cache.clear()
    save_state_dict(sd, tmp_path / "fresh")
    save_state_dict(sd, tmp_path / "reused")
    assert plan_cache.hits >= 1
    a = load_file(tmp_path / "fresh" / "rank-00000.safetensors")
    b = load_file(tmp_path / "reused" / "rank-00000.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


def test_reused_plan_still_refuses_a_foreign_destination(tmp_path):
    """A reused plan checks the destination when rank 0 writes: the refusal names the entry, the destination is
    untouched and no temporary directory is left (sync and async)."""
    from oarlock.checkpoint import CheckpointDestinationError

    sd = _state()
    plan_cache.clear()
    save_state_dict(sd, tmp_path / "a")
    for mode in ("sync", "async"):
        dest = tmp_path / f"mine-{mode}"
        dest.mkdir()
        (dest / "notes.txt").write_text("keep me")
        with pytest.raises(CheckpointDestinationError, match="notes.txt"):
            if mode == "sync":
                save_state_dict(sd, dest)
            else:
                async_save(sd, dest).wait()
        assert os.listdir(dest) == ["notes.txt"] and (dest / "notes.txt").read_text() == "keep me"
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]
    assert plan_cache.hits >= 2


# ---------------------------------------------------------------- the background snapshot

def test_values_are_those_at_the_snapshot(tmp_path):
    plan_cache.clear()
    sd = _state()
    for i in range(3):  # the second and third saves reuse the plan and the staging buffers
        before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
        h = async_save(sd, tmp_path / f"s{i}")
        assert h.plan_reused == (i > 0)
        h.wait_staged()
        assert h.staged()
        sd["w"].mul_(-3).add_(7)  # right after the snapshot: not in the checkpoint
        sd["b"].add_(1)
        sd["i"].add_(1)
        sd["step"] += 1
        h.wait()
        _load_equal(tmp_path / f"s{i}", before)
    assert h.staged_bytes == sum(v.numel() * v.element_size() for v in sd.values() if isinstance(v, torch.Tensor))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned staging on a side stream)")
def test_cuda_snapshot_in_reused_pinned_buffers(tmp_path):
    g = torch.Generator().manual_seed(4)
    dev = {"w": torch.randn(1024, 512, generator=g).cuda(), "b": torch.randn(64, generator=g).cuda().half()}
    kept = None
    for i in range(3):
        dev["w"].add_(i)  # queued on the current stream before the call: in the snapshot
        before = {k: v.cpu() for k, v in dev.items()}
        h = async_save(dev, tmp_path / f"g{i}")
        h.wait_staged()
        for v in dev.values():
            v.mul_(-2)
        h.wait()
        assert h.pinned_bytes == h.staged_bytes == sum(v.numel() * v.element_size() for v in dev.values())
        got = {k: torch.zeros_like(v) for k, v in before.items()}
        load_state_dict(got, tmp_path / f"g{i}")
        assert all(torch.equal(_bits(got[k]), _bits(before[k])) for k in before)
        ptrs = sorted(b.data_ptr() for b in async_mod._buffers.values())
        assert kept is None or ptrs == kept  # the same pinned buffers every save
        kept = ptrs


def test_the_stall_ends_before_the_snapshot_and_a_premature_update_fails_the_save(tmp_path, monkeypatch):
    """async_save returns while the snapshot is held back; an in-place update before wait_staged() fails the save
    (nothing is published) instead of writing a torn state; the next save works."""
    gate = threading.Event()
    real = async_mod._copy_cpu

    def held(buf, t):
        assert gate.wait(60)
        real(buf, t)

    monkeypatch.setattr(async_mod, "_copy_cpu", held)
    sd = _state()
    h = async_save(sd, tmp_path / "torn")
    assert not h.staged()
    with pytest.raises(TimeoutError):
        h.wait_staged(0.01)
    sd["w"].add_(1)  # too early
    gate.set()
    with pytest.raises(CheckpointError, match=r"key 'w'.*updated in place before its snapshot.*wait_staged"):
        h.wait()
    assert not (tmp_path / "torn").exists() and os.listdir(tmp_path) == []
    monkeypatch.setattr(async_mod, "_copy_cpu", real)
    h = async_save(sd, tmp_path / "ok")
    h.wait()
    _load_equal(tmp_path / "ok", sd)


def test_the_call_fixes_the_state_dict_before_its_shards_are_described(tmp_path, monkeypatch):
    """The shards are described in the background; what the call fixed is saved: an entry rebound to another
    tensor, a key added and a JSON value changed after the call do not reach the checkpoint."""
    gate = threading.Event()
    real = async_mod.collect_leaves
    monkeypatch.setattr(async_mod, "collect_leaves", lambda *a, **k: gate.wait(60) and real(*a, **k))
    sd = _state()
    sd["sched"] = {"lr": [0.1, 0.2]}
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items() if k != "sched"}
    h = async_save(sd, tmp_path / "c")
    sd["w"] = torch.zeros(32, 16)  # rebound, not updated in place: the call's tensor is saved
    sd["extra"] = torch.ones(3)
    sd["sched"]["lr"].append(0.3)
    sd["step"] = 99
    gate.set()
    h.wait()
    _load_equal(tmp_path / "c", before)
    got = {"sched": {"lr": None}, "extra": torch.zeros(3)}
    report = load_state_dict(got, tmp_path / "c", strict=False)
    assert got["sched"]["lr"] == [0.1, 0.2] and "extra" in report.missing_keys, (got, report.missing_keys)


def test_done_callbacks_run_once_finished_and_at_once_after(tmp_path, caplog):
    """A callback added while the save runs is called when it has committed; one added afterwards at once; a
    callback's exception is logged and the others still run."""
    gate = threading.Event()
    real = async_mod.collect_leaves
    calls: list[tuple[str, bool]] = []
    import oarlock.checkpoint.lifecycle.async_save as mod

    mod.collect_leaves = lambda *a, **k: gate.wait(60) and real(*a, **k)
    try:
        h = async_save(_state(), tmp_path / "c")
        h.add_done_callback(lambda hh: calls.append(("early", hh.done() and (tmp_path / "c" / "metadata.json").exists())))
        h.add_done_callback(lambda hh: 1 / 0)
        ran = threading.Event()
        h.add_done_callback(lambda hh: calls.append(("second", hh is h)) or ran.set())
        assert calls == []
        gate.set()
        h.wait()
    finally:
        mod.collect_leaves = real
    assert ran.wait(60)  # the callbacks run on the writer thread right after it marks the save finished
    h.add_done_callback(lambda hh: calls.append(("late", True)))
    assert calls == [("early", True), ("second", True), ("late", True)], calls
    assert "done callback" in caplog.text and "ZeroDivisionError" in caplog.text


def test_manager_async_three_saves_keep_last_two(tmp_path):
    m = CheckpointManager(tmp_path / "ck", keep_last=2)
    sd = _state()
    saved = {}
    for step in (1, 2, 3):
        sd["step"] = step
        saved[step] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
        m.save(step, sd, async_save=True)
        sd["w"].add_(100)  # the loop goes on at once: the manager returned after the snapshot
        sd["i"].sub_(1)
    m.wait()
    assert m.steps() == [2, 3] and m.latest() == 3
    assert sorted(os.listdir(tmp_path / "ck")) == ["latest", "step-00000002", "step-00000003"]
    for step in (2, 3):
        _load_equal(m.path(step), saved[step])


_KILL_SCRIPT = textwrap.dedent("""
    import importlib, os, signal, sys, torch
    A = importlib.import_module("oarlock.checkpoint.lifecycle.async_save")
    import oarlock.checkpoint.storage.safetensors as S
    from oarlock.checkpoint import CheckpointManager
    root, where = sys.argv[1], sys.argv[2]
    def state(s):
        return {"w": torch.arange(1 << 20, dtype=torch.float32) + 1000 * s, "b": torch.full((3, 2), float(s)),
                "step": s}
    m = CheckpointManager(root, keep_last=2)
    m.save(1, state(1), async_save=True)
    m.wait()
    if where == "staging":  # killed between the copies of the snapshot
        real, n = A._copy_cpu, [0]
        def copy(buf, t):
            n[0] += 1
            if n[0] == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            real(buf, t)
        A._copy_cpu = copy
    else:  # killed half-way through the data of the rank file
        real = S._write_all
        def write(fd, mv, pos):
            if pos > 0 and len(mv) > 4096:
                real(fd, mv[:len(mv) // 2], pos)
                os.kill(os.getpid(), signal.SIGKILL)
            return real(fd, mv, pos)
        S._write_all = write
    m.save(2, state(2), async_save=True)
    m.wait()
    print("not killed")
""")


@pytest.mark.parametrize("where", ["staging", "writing"])
def test_sigkill_during_background_staging_or_writing(tmp_path, where):
    root = tmp_path / "ck"
    r = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, str(root), where], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stdout, r.stderr)
    m = CheckpointManager(root, keep_last=2)
    assert m.latest() == 1 and m.steps() == [1]
    assert not (root / "step-00000002").exists()
    _load_equal(m.path(1), {"w": torch.arange(1 << 20, dtype=torch.float32) + 1000, "b": torch.full((3, 2), 1.0),
                            "step": 1})
    left = [p for p in root.iterdir() if p.name.startswith(".step-00000002.")]
    if where == "writing":  # the partial directory is there, hidden and marked incomplete: it does not load
        assert len(left) == 1 and (left[0] / INCOMPLETE_MARKER).exists(), left
        with pytest.raises(CheckpointError):
            load_state_dict({"w": torch.zeros(1 << 20)}, left[0])
    m.save(3, {"w": torch.arange(1 << 20, dtype=torch.float32), "b": torch.zeros(3, 2), "step": 3})
    assert m.steps() == [1, 3] and not [n for n in os.listdir(root) if n.startswith(".")]


# ---------------------------------------------------------------- writeback overlapped with writing

@pytest.fixture
def writeback_calls(monkeypatch):
    """Counts the kernel writeback requests (the real sync_file_range still runs) and makes them frequent."""
    calls: list[tuple[int, int, int]] = []
    safetensors_io._start_writeback(-1, 0, 0)  # resolve the ctypes function (a no-op on fd -1)
    real = safetensors_io._sync_file_range
    if not real:
        pytest.skip("no sync_file_range on this platform")

    def counting(fd, off, n, flags):
        calls.append((fd, off, n))
        return real(fd, off, n, flags)

    monkeypatch.setattr(safetensors_io, "_sync_file_range", counting)
    monkeypatch.setattr(safetensors_io, "_WRITEBACK_BYTES", 4096)
    return calls


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _hf_source(d: Path) -> Path:
    g = torch.Generator().manual_seed(1)
    d.mkdir()
    save_file({"model.layers.0.mlp.down_proj.weight": torch.randn(64, 96, generator=g),
               "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g),
               "model.norm.weight": torch.randn(64, generator=g)}, str(d / "model.safetensors"))
    return d


def test_writeback_and_its_fallback_write_identical_files(tmp_path, writeback_calls, monkeypatch):
    import oarlock.checkpoint.convert.export as convert_mod  # the module convert_checkpoint runs in

    monkeypatch.setattr(convert_mod, "new_save_id", lambda: "0" * 32)  # the one varying header entry
    src = _hf_source(tmp_path / "hf")
    g = torch.Generator().manual_seed(2)
    tensors = {"a": torch.randn(300, 50, generator=g), "b": torch.randn(9, generator=g).to(torch.bfloat16)}

    def write_all(out: Path) -> None:
        out.mkdir()
        safetensors_io.write_safetensors(out / "direct.safetensors", tensors)
        convert_checkpoint(src, out / "tp2", tp=2, show_progress=False)
        export_hf(out / "tp2", out / "hf", show_progress=False)

    write_all(tmp_path / "with")
    assert writeback_calls, "sync_file_range was never called"
    for fd, off, n in writeback_calls:
        assert off >= 0 and n > 0
    monkeypatch.setattr(safetensors_io, "_sync_file_range", False)  # the fallback: fsync at close only
    before = len(writeback_calls)
    write_all(tmp_path / "without")
    assert len(writeback_calls) == before
    a, b = _tree(tmp_path / "with"), _tree(tmp_path / "without")
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a), [k for k in a if a.get(k) != b.get(k)]
    got = load_file(tmp_path / "with" / "direct.safetensors")
    assert all(torch.equal(_bits(got[k]), _bits(v)) for k, v in tensors.items())


def test_writeback_ranges_follow_out_of_order_puts(tmp_path, writeback_calls):
    """Tensors put out of file order (as convert does, key by key over several files): every range handed to
    the kernel is one that was written, and together they cover the data section."""
    g = torch.Generator().manual_seed(3)
    ts = {f"t{i}": torch.randn(512, generator=g) for i in range(6)}
    with safetensors_io.SafetensorsWriter(tmp_path / "x.safetensors",
                                          [(k, tuple(v.shape), v.dtype) for k, v in ts.items()]) as w:
        for k in ["t3", "t0", "t5", "t1", "t4", "t2"]:
            w.put(k, ts[k])
        spans = sorted((off + w.base, off + w.base + 2048) for off, _, _ in w.where.values())
    got = sorted((off, off + n) for _, off, n in writeback_calls)
    covered = []
    for a, b in got:
        assert any(s <= a and b <= e for s, e in _merge(spans)), (a, b)
        covered.append((a, b))
    assert _merge(covered) == _merge(spans)
    assert all(torch.equal(load_file(tmp_path / "x.safetensors")[k], v) for k, v in ts.items())


@pytest.mark.parametrize("finish", ["close", "abandon"])
def test_writeback_requests_finish_before_the_file_is_closed(tmp_path, writeback_calls, monkeypatch, finish):
    """Writeback requests run on a background thread; a slow one must still see the writer's own file (its
    descriptor neither closed nor reused), also when the file is abandoned after an error."""
    import time

    counting = safetensors_io._sync_file_range
    seen: list = []

    def slow(fd, off, n, flags):
        time.sleep(0.02)  # the writer reaches close() while requests are still queued
        try:
            seen.append(os.fstat(fd).st_ino)
        except OSError as e:
            seen.append(e)
        return counting(fd, off, n, flags)

    monkeypatch.setattr(safetensors_io, "_sync_file_range", slow)
    ts = {f"t{i}": torch.full((2048,), float(i)) for i in range(5)}
    path = tmp_path / "x.safetensors"
    with pytest.raises(RuntimeError, match="stop here") if finish == "abandon" else contextlib.nullcontext():
        with safetensors_io.SafetensorsWriter(path, [(k, tuple(v.shape), v.dtype) for k, v in ts.items()]) as w:
            for k, v in ts.items():
                w.put(k, v)
            ino = os.fstat(w.fd).st_ino
            if finish == "abandon":
                raise RuntimeError("stop here")
    assert len(seen) >= 4 and seen == [ino] * len(seen), seen
    if finish == "close":
        assert all(torch.equal(load_file(path)[k], v) for k, v in ts.items())


def _merge(spans):
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are a Linux feature")
def test_the_writer_runs_at_a_lower_priority_and_the_stager_does_not(tmp_path, monkeypatch):
    """The writer thread (writes, hashing, fsync) is niced by ``background_nice()`` so a training loop sharing the
    CPUs slows less; the stage thread (planning and the snapshot the loop waits for) keeps the caller's priority."""
    monkeypatch.delenv("OARLOCK_ASYNC_NICE", raising=False)  # the default (read when the thread starts)
    h = async_save(_state(), tmp_path / "a")
    h.wait()
    threads = {t.name: t.native_id for t in threading.enumerate()}
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert async_mod.background_nice() == 8  # the default, OARLOCK_ASYNC_NICE unset in the tests
    assert os.getpriority(os.PRIO_PROCESS, threads["oarlock-async-save"]) == min(19, base + 8)
    assert os.getpriority(os.PRIO_PROCESS, threads["oarlock-async-stage"]) == base
