"""The multirank harness itself: a failure names the scenario, the rank and the failing assertion; a scenario past
its time limit and a rank that dies are named too; selection by world size and by `needs`."""

import pytest

from multirank import run_scenarios, scenario_names, with_needs

MOD = "_multirank_selftest"


def test_names_follow_definition_order_world_and_needs():
    assert "scenario_only_at_world_3" not in scenario_names(MOD, 2)
    assert "scenario_only_at_world_3" in scenario_names(MOD, 3)
    assert with_needs(MOD, ["scenario_after_a_failure_still_runs"], 2) == [
        "scenario_passes_and_returns", "scenario_after_a_failure_still_runs"]


@pytest.mark.multiproc
def test_reports_failure_skip_and_timeout_by_scenario_and_rank(tmp_path):
    names = ["scenario_passes_and_returns", "scenario_fails_on_rank_1", "scenario_skips",
             "scenario_after_a_failure_still_runs", "scenario_hangs_on_rank_0", "scenario_never_reached"]
    outcome = run_scenarios(MOD, 2, tmp_path, names)
    assert outcome.values("passes_and_returns") == [{"rank": r, "gathered": [0, 10], "shared": True}
                                                    for r in range(2)]
    outcome.check("passes_and_returns")
    outcome.check("after_a_failure_still_runs")
    assert outcome.values("after_a_failure_still_runs") == ["after_a_failure_still_runs"] * 2
    with pytest.raises(AssertionError) as e:
        outcome.check("fails_on_rank_1")
    msg = str(e.value)
    assert msg.startswith("1 scenario run(s) failed:\nfails_on_rank_1 @ rank 1 of 2: AssertionError: rank 1 sees "
                          "value 42, wanted 41\n"), msg
    assert "@ rank 0" not in msg
    with pytest.raises(pytest.skip.Exception, match="skips: nothing to check here"):
        outcome.check("skips")
    with pytest.raises(AssertionError) as e:
        outcome.check("hangs_on_rank_0")
    msg = str(e.value)
    assert "hangs_on_rank_0 @ rank 0 of 2: still running hangs_on_rank_0 after" in msg and "(limit 3 s)" in msg, msg
    with pytest.raises(AssertionError, match=r"never_reached @ rank [01] of 2: "):
        outcome.check("never_reached")
    with pytest.raises(AssertionError, match="was not launched"):
        outcome.check("only_at_world_3")


@pytest.mark.multiproc
def test_reports_the_scenario_a_dead_rank_was_running(tmp_path):
    outcome = run_scenarios(MOD, 2, tmp_path, ["scenario_passes_and_returns", "scenario_rank_1_dies"])
    outcome.check("passes_and_returns")
    with pytest.raises(AssertionError) as e:
        outcome.check("rank_1_dies")
    msg = str(e.value)
    assert "rank_1_dies @ rank 1 of 2: the rank process died while running rank_1_dies (" in msg, msg
    assert "(exit code 3)" in msg, msg


@pytest.mark.multiproc
def test_command_line_returns_although_a_scenario_left_a_child_process(tmp_path):
    """`python multirank.py FILE WORLD ROOT NAMES`: the report on stdout, exit 0; a child process a scenario started
    is stopped with its rank (it used to keep the caller's pipes open, so subprocess.run never returned)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    r = subprocess.run([sys.executable, str(here / "multirank.py"), str(here / "_multirank_selftest.py"), "2",
                        str(tmp_path), "passes_and_returns", "leaves_a_child_process"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == ["passes_and_returns: ok", "leaves_a_child_process: ok"], r.stdout
    import json

    pids = [json.loads((tmp_path / f"outcome.{i}.json").read_text())["scenario_leaves_a_child_process"]["value"]
            for i in range(2)]
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        if not os.path.isdir("/proc"):
            raise AssertionError(f"child process {pid} of a rank still runs")
        with open(f"/proc/{pid}/stat") as f:  # a zombie awaiting its reaper is gone too
            assert f.read().split()[2] == "Z", f"child process {pid} of a rank still runs"
    r = subprocess.run([sys.executable, str(here / "multirank.py"), str(here / "_multirank_selftest.py"), "2",
                        str(tmp_path / "b"), "fails_on_rank_1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "fails_on_rank_1 @ rank 1 of 2: AssertionError: rank 1 sees value 42" in r.stdout


@pytest.mark.multiproc
def test_launch_shared_by_workers_runs_once(tmp_path):
    """Two Launches on one directory (two pytest-xdist workers): the second reads the first's record."""
    from multirank import Launches

    prepared = []
    a, b = (Launches(MOD, tmp_path, {2: ["scenario_passes_and_returns"]}, lambda root, w: prepared.append(w), {})
            for _ in range(2))
    a.check("passes_and_returns", 2)
    b.check("passes_and_returns", 2)
    assert prepared == [2]
    assert b.values("passes_and_returns", 2) == a.values("passes_and_returns", 2) == [
        {"rank": r, "gathered": [0, 10], "shared": True} for r in range(2)]
