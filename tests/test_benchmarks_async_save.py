"""Smoke test of benchmarks/async_save.py: the ``--quick`` run on 4 gloo ranks completes and every library's
checkpoint loads back to the values the state held at the call (checked inside the ranks against clones); the
sizes the workload is built from add up. Nothing is timed or compared for speed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from testkit import load_benchmark

pytest.importorskip("torch.distributed.checkpoint.staging")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("async_save")


def test_workload_sizes(bench):
    for mib in (8, 512, 100):
        shapes = bench.tensor_shapes(mib)
        assert len(shapes) >= 4 and all(r % bench.WORLD == 0 for r, _ in shapes)
        total = sum(r * c * 4 for r, c in shapes)
        assert abs(total - mib * 2**20) <= len(shapes) * bench.WORLD * bench.COLS * 4


@pytest.mark.multiproc
def test_quick_run(bench, tmp_path):
    # a subprocess: the spawned ranks import the script by its path, not under this test's module name
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "async_save.py"), "--quick", "--device", "cpu",
                        "--dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    rows = [line for line in out.splitlines() if line.startswith("| oarlock") or line.startswith("| dcp-")]
    assert [r.split("|")[1].strip() for r in rows] == list(bench.LIBS)
    assert all(r.rstrip().endswith("| True |") for r in rows), rows  # saved values exact, every library
