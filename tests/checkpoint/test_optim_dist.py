"""Exact training resume across layouts on 4 gloo ranks (one launch; rank body in _optim_worker.py).

Layout pairs (issue 6): DP2 ZeRO-1 -> DP4 ZeRO-1, TP2 -> TP1, DP2xTP2 (ZeRO-1 over DP) -> TP4, plain -> FSDP2
(``fully_shard`` on CPU with gloo), and DP2 ZeRO-1 -> TP3 on 3 of the 4 ranks (the demo's path). The uninterrupted run in layout A is the reference: B's losses after the
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


def test_resume_in_another_layout_matches_uninterrupted_run(tmp_path):
    """One launch for every layout pair (a parametrized module fixture would launch once per xdist worker)."""
    mp.start_processes(W.run, args=(4, _free_port(), str(tmp_path)), nprocs=4, start_method="spawn", join=True)
    results = [json.loads((tmp_path / f"result.{r}.json").read_text()) for r in range(4)]
    failures = []
    for a_kind, b_kind, *_ in W.SCENARIOS:
        name = f"{a_kind}-{b_kind}"
        for rank, res in enumerate(results):
            r = res[name]
            if r.get("idle"):
                continue
            if not r["ok"]:
                failures.append(f"{name} rank {rank}:\n{r['error']}")
                continue
            assert len(r["a"]) == len(r["b"]) == W.M
            for step, (a, b) in enumerate(zip(r["a"], r["b"]), start=W.K):
                if not math.isclose(b, a, rel_tol=1e-6, abs_tol=0.0):
                    failures.append(f"{name} rank {rank} step {step}: resumed {b!r}, uninterrupted {a!r} "
                                    f"(all: {r['b']} vs {r['a']})")
        if all(res[name]["ok"] for res in results):
            worst = max(abs(b - a) / abs(a) for res in results if not res[name].get("idle")
                        for a, b in zip(res[name]["a"], res[name]["b"]))
            print(f"{name}: largest relative loss difference {worst:.2e}")
    assert not failures, "\n".join(failures)
