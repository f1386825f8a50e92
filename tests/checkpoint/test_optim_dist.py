"""Exact training resume across layouts on 4 gloo ranks (one launch; one test per layout pair, the scenarios live
in _optim_scenarios.py).

Layout pairs (issue 6): DP2 ZeRO-1 -> DP4 ZeRO-1, TP2 -> TP1, DP2xTP2 (ZeRO-1 over DP) -> TP4, plain -> FSDP2
(``fully_shard`` on CPU with gloo), and DP2 ZeRO-1 -> TP3 on 3 of the 4 ranks (the demo's path). The uninterrupted
run in layout A is the reference: B's losses after the load must equal A's step by step to 1e-6 relative (fp32).
"""

import pytest

import _optim_scenarios as S
from multirank import each_scenario, launch_fixture, scenario_names

pytestmark = pytest.mark.multiproc

launched = launch_fixture("_optim_scenarios", worlds=(4,), timeout_s=300, threads=1)


@each_scenario("_optim_scenarios", worlds=(4,))
def test_resume_in_another_layout_matches_uninterrupted_run(launched, world, scenario):
    launched.check(scenario, world)
    runs = [v for v in launched.values(scenario, world) if not v.get("idle")]
    assert runs and all(len(v["a"]) == len(v["b"]) == S.M for v in runs), runs
    worst = max(abs(b - a) / abs(a) for v in runs for a, b in zip(v["a"], v["b"]))
    print(f"{scenario}: largest relative loss difference {worst:.2e}")


def test_every_layout_pair_has_a_scenario():
    assert scenario_names("_optim_scenarios") == [f"scenario_{a}_to_{b}" for a, b, *_ in S.SCENARIOS]
    assert len(S.SCENARIOS) == 5
