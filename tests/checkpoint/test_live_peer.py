"""Disaggregated live resharding: two separately launched jobs (a trainer and an engine, each with its own default
process group) join one group with join_group and sync weights; a sender that dies mid-sync makes every survivor
raise within the group's timeout (no hang) with its targets marked torn. Processes run _live_peer_worker.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def launch(tmp_path: Path, mode: str, limit: float) -> tuple[dict[int, dict], list[int], float]:
    tport, eport, jport = free_ports(3)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1] / "src"), str(HERE.parent)])}
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(HERE / "_live_peer_worker.py"), str(r), str(tport), str(eport),
                               str(jport), str(tmp_path), mode], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in range(4)]
    codes = []
    try:
        for p in procs:
            p.wait(timeout=max(limit - (time.monotonic() - t0), 1))
            codes.append(p.returncode)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    elapsed = time.monotonic() - t0
    results = {}
    for r in range(4):
        f = tmp_path / f"rank-{r}.json"
        if f.exists():
            results[r] = json.loads(f.read_text())
    return results, codes, elapsed


@pytest.mark.multiproc
def test_trainer_and_engine_jobs_join_and_sync(tmp_path):
    results, codes, _ = launch(tmp_path, "ok", 240)
    assert codes == [0, 0, 0, 0], (codes, results)
    for r in range(4):
        assert "error" not in results[r], results[r]["error"]
        assert results[r]["reused"] is True
    for r in (2, 3):
        assert results[r]["equal"] is True
        assert results[r]["first"] == results[r]["received"] == 64 * 20 * 4  # exactly its TP slice
        assert results[r]["rounds"] > 1  # 4 KiB buckets: many rounds


@pytest.mark.multiproc
def test_dead_sender_makes_every_rank_raise_and_marks_torn(tmp_path):
    results, codes, elapsed = launch(tmp_path, "kill", 200)
    assert codes[1] == 3 and 1 not in results
    for r in (0, 2, 3):
        assert "error" not in results[r], results[r].get("error")
        assert results[r]["raised"] and "live reshard failed" in results[r]["raised"], results[r]
    for r in (2, 3):
        assert results[r]["torn"] is True
    assert elapsed < 150, f"survivors took {elapsed:.0f} s to give up"
