"""Exact training resume across layouts on 4 gloo ranks (one launch; rank body in _optim_worker.py).

Layout pairs (issue 6): DP2 ZeRO-1 -> DP4 ZeRO-1, TP2 -> TP1, DP2xTP2 (ZeRO-1 over DP) -> TP4, plain -> FSDP2
(``fully_shard`` on CPU with gloo). The uninterrupted run in layout A is the reference: B's losses after the
load must equal A's step by step to 1e-6 relative (fp32).
"""

import json
import math
import socket

import pytest
import torch.multiprocessing as mp

import _optim_worker as W

pytestmark = pytest.mark.multiproc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("optim_dist")
    mp.start_processes(W.run, args=(4, _free_port(), str(root)), nprocs=4, start_method="spawn", join=True)
    return [json.loads((root / f"result.{r}.json").read_text()) for r in range(4)]


@pytest.mark.parametrize("name", [f"{a}-{b}" for a, b, _ in W.SCENARIOS])
def test_resume_in_another_layout_matches_uninterrupted_run(results, name):
    for rank, res in enumerate(results):
        r = res[name]
        assert r["ok"], f"rank {rank}:\n{r['error']}"
        assert len(r["a"]) == len(r["b"]) == W.M
        for step, (a, b) in enumerate(zip(r["a"], r["b"]), start=W.K):
            assert math.isclose(b, a, rel_tol=1e-6, abs_tol=0.0), \
                f"rank {rank} step {step}: resumed {b!r}, uninterrupted {a!r} (all: {r['b']} vs {r['a']})"
    worst = max(abs(b - a) / abs(a) for res in results for a, b in zip(res[name]["a"], res[name]["b"]))
    print(f"{name}: largest relative loss difference {worst:.2e}")
