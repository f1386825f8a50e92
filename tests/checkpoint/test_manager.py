"""CheckpointManager: rotation, the latest pointer under SIGKILL at every protocol point, exact resume."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from oarlock.checkpoint import (CheckpointError, CheckpointManager, OptimizerState, RankLocal, RNGState,
                                sharded_state_dict)
from oarlock.checkpoint.lifecycle.manager import CRASH_ENV, CRASH_POINTS


def _state(step: int, n: int = 8) -> dict:
    # values derived from the step alone, so the expected content of any step is known independently
    return {"w": torch.arange(n, dtype=torch.float32) + 1000 * step, "b": torch.full((3, 2), float(step)),
            "step": step}


def _check_step(root: Path, step: int) -> None:
    m = CheckpointManager(root)
    got = {"w": torch.zeros(8), "b": torch.zeros(3, 2), "step": None}
    assert m.load_latest(got, strict=False) == step  # the subprocess saves also hold "pad"
    ref = _state(step)
    assert torch.equal(got["w"], ref["w"]) and torch.equal(got["b"], ref["b"])
    assert got["step"] == step


def test_keep_last_and_pointer(tmp_path):
    m = CheckpointManager(tmp_path / "ck", keep_last=2)
    assert m.latest() is None
    assert m.load_latest({"w": torch.zeros(8)}) is None
    for s in (10, 20, 30, 40):
        m.save(s, _state(s))
        assert m.latest() == s
    assert m.steps() == [30, 40]
    assert sorted(os.listdir(tmp_path / "ck")) == ["latest", "step-00000030", "step-00000040"]
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-00000040"
    _check_step(tmp_path / "ck", 40)
    m.save(25, _state(25))  # an older step number saved later is the latest (the pointer decides)
    assert m.latest() == 25 and m.steps() == [25, 40]
    with pytest.raises(CheckpointError, match="keep_last"):
        CheckpointManager(tmp_path / "x", keep_last=0)


def test_async_save_commits_pointer(tmp_path):
    m = CheckpointManager(tmp_path / "ck", keep_last=1)
    st = _state(1)
    m.save(1, st, async_save=True)
    st["w"].add_(5)  # the snapshot was taken before save returned
    m.wait()
    m.save(2, _state(2), async_save=True)
    m.wait()
    assert m.steps() == [2] and m.latest() == 2
    _check_step(tmp_path / "ck", 2)


_SCRIPT = textwrap.dedent("""
    import sys, torch
    from oarlock.checkpoint import CheckpointManager
    root, start, stop, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    m = CheckpointManager(root, keep_last=2)
    for s in range(start, stop + 1):
        m.save(s, {"w": torch.arange(8, dtype=torch.float32) + 1000 * s, "b": torch.full((3, 2), float(s)),
                   "step": s, "pad": torch.zeros(n)})
""")


def _run(root: Path, start: int, stop: int, crash: str | None = None, n: int = 1) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop(CRASH_ENV, None)
    if crash:
        env[CRASH_ENV] = crash
    return subprocess.run([sys.executable, "-c", _SCRIPT, str(root), str(start), str(stop), str(n)], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_sigkill_at_every_protocol_point(tmp_path, point):
    root = tmp_path / "ck"
    r = _run(root, 1, 2)
    assert r.returncode == 0, r.stderr
    r = _run(root, 3, 3, crash=point)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr)
    # the pointer moves only after step 3 is committed: before that step 2 is the latest, after it step 3
    committed_new = CRASH_POINTS.index(point) >= CRASH_POINTS.index("after_pointer")
    expect = 3 if committed_new else 2
    assert CheckpointManager(root).latest() == expect
    _check_step(root, expect)
    # the next save cleans every leftover and honours keep_last
    r = _run(root, 4, 4)
    assert r.returncode == 0, r.stderr
    m = CheckpointManager(root, keep_last=2)
    assert m.latest() == 4
    names = sorted(os.listdir(root))
    assert [n for n in names if n.startswith(".")] == [], names
    assert m.steps() == [3, 4] if point != "before_save" else [2, 4]
    _check_step(root, 4)


def test_sigkill_while_writing_data(tmp_path):
    root = tmp_path / "ck"
    assert _run(root, 1, 2).returncode == 0
    env = dict(os.environ)
    env.pop(CRASH_ENV, None)
    # 64 MiB of padding keeps the write busy long enough to be killed inside save_state_dict
    p = subprocess.Popen([sys.executable, "-c", _SCRIPT, str(root), "3", "3", str(16 * 1024 * 1024)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    tmp = []
    while time.monotonic() < deadline and p.poll() is None:
        tmp = [n for n in os.listdir(root) if n.startswith(".step-00000003.")]
        if tmp:
            break
        time.sleep(0.002)
    p.send_signal(signal.SIGKILL)
    p.wait()
    if not tmp:
        pytest.skip("the save finished before it could be killed")
    assert CheckpointManager(root).latest() in (2, 3)
    _check_step(root, CheckpointManager(root).latest())
    assert _run(root, 4, 4).returncode == 0
    assert [n for n in os.listdir(root) if n.startswith(".")] == []
    _check_step(root, 4)


class _Position:
    """A data loader's position (stateful object)."""

    def __init__(self):
        self.index = 0

    def state_dict(self):
        return {"index": self.index}

    def load_state_dict(self, sd):
        self.index = sd["index"]


def _train(model, opt, sched, pos, steps: int) -> list[float]:
    """Steps that consume every RNG the RNGState helper covers: torch (data, dropout), numpy and Python."""
    losses = []
    for _ in range(steps):
        g = torch.Generator().manual_seed(pos.index)  # the data at this position
        x = torch.randn(4, 6, generator=g)
        noise = torch.tensor(np.random.randn(4, 6), dtype=torch.float32) * 0.01
        scale = random.uniform(0.5, 1.5)
        h = torch.nn.functional.dropout(model(x + noise), p=0.3, training=True)
        loss = (h * scale).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        pos.index += 1
        losses.append(loss.item())
    return losses


def _fresh(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(6, 5)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched, _Position()


def test_scheduler_and_rng_resume_reproduces_losses(tmp_path):
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    model, opt, sched, pos = _fresh(0)
    _train(model, opt, sched, pos, 3)
    msd = sharded_state_dict(model)
    m = CheckpointManager(tmp_path / "ck", keep_last=2)
    m.save(3, {"model": msd, "optim": OptimizerState(opt, msd), "sched": sched,
               "data": RankLocal(pos), "rng": RNGState(), "step": 3})
    expected = _train(model, opt, sched, pos, 3)  # the uninterrupted run's next three losses

    torch.manual_seed(123), np.random.seed(123), random.seed(123)  # another process, other streams
    model2, opt2, sched2, pos2 = _fresh(99)
    msd2 = sharded_state_dict(model2)
    state = {"model": msd2, "optim": OptimizerState(opt2, msd2), "sched": sched2,
             "data": RankLocal(pos2), "rng": RNGState(), "step": None}
    assert CheckpointManager(tmp_path / "ck").load_latest(state) == 3
    assert state["step"] == 3 and pos2.index == 3 and sched2.last_epoch == 3
    assert _train(model2, opt2, sched2, pos2, 3) == expected


@pytest.mark.multiproc
def test_two_ranks_sharded_state_and_per_rank_rng(multirank):
    """2 ranks: sharded rows + a per-rank RNG through CheckpointManager (sync and async saves, keep_last=2); a fresh
    manager resumes each rank's own rows and RNG stream (scenario in _integrity_scenarios.py)."""
    outcome = multirank("_integrity_scenarios", 2)
    assert outcome.names == ["scenario_manager_sharded_rows_and_per_rank_rng"]
    outcome.check()
    ck = multirank.root / "scenario_manager_sharded_rows_and_per_rank_rng" / "ck"
    assert CheckpointManager(ck).steps() == [2, 3]


def test_one_committed_test_for_the_manager_and_the_commands(tmp_path):
    """The manager's step listing and the commands' manager-root resolution share one test of "committed": a step
    holding an incomplete-save marker and a step that is a symbolic link to a committed one are both skipped by
    both (a link could point anywhere: nothing outside the root is opened)."""
    from oarlock.checkpoint.lifecycle.manager import CheckpointManager
    from oarlock.checkpoint.storage import is_committed, resolve_manager_root

    m = CheckpointManager(tmp_path / "run")
    m.save(1, {"w": torch.ones(2)})
    m.save(2, {"w": torch.full((2,), 2.0)})
    root = tmp_path / "run"
    (root / "step-00000002" / ".oarlock-incomplete").touch()  # as if step 2's save had not committed
    elsewhere = tmp_path / "elsewhere"
    m2 = CheckpointManager(elsewhere)
    m2.save(9, {"w": torch.full((2,), 9.0)})
    (root / "step-00000009").symlink_to(elsewhere / "step-00000009", target_is_directory=True)
    assert is_committed(root / "step-00000001") and not is_committed(root / "step-00000002")
    assert not is_committed(root / "step-00000009") and is_committed(elsewhere / "step-00000009")
    assert m.steps() == [1] and m.latest() == 1
    assert resolve_manager_root(root) == (root / "step-00000001", "step-00000001")
