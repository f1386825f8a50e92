"""scripts/gpu_check.sh (issue 40, docs/gpu.md) without a GPU: the dry run goes through every section's CPU plumbing
and writes a report naming every section with its skip reason, and a section that overruns is killed and reported
as such, so the script cannot rot between the rare runs on a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ["header", "tests", "flashmask", "memory", "async_save", "reshard"]


def _driver():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(out: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), *args, str(out)], cwd=REPO, env=e,
                          capture_output=True, text=True, timeout=400)


def test_budgets_fit_in_eight_minutes():
    gc = _driver()
    assert [n for n, _, _ in gc.SECTIONS] == SECTIONS
    assert sum(b + gc.GRACE_S for _, _, b in gc.SECTIONS) <= gc.TOTAL_S <= 8 * 60 - 2
    assert 'timeout -k 5 478 ' in (REPO / "scripts" / "gpu_check.sh").read_text()


@pytest.mark.slow
def test_dry_run_reports_every_section_with_its_skip_reason(tmp_path):
    out = tmp_path / "out"
    r = _run(out, "--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr
    fig = json.loads((out / "figures.json").read_text())
    report = (out / "report.md").read_text()
    assert fig["meta"]["dry_run"] is True and list(fig["sections"]) == SECTIONS
    assert report.startswith("# oarlock GPU check (dry run)")
    block = (out / "results-section.md").read_text()  # what goes into benchmarks/RESULTS.md
    assert "## GPU check (issue 40)" in block and "`bash scripts/gpu_check.sh --dry-run OUTDIR`" in block
    for name in SECTIONS:
        d = fig["sections"][name]
        assert f"## {name}: " in report and f"| {name} | {d['status']} |" in report
        assert d["errors"] == [] and d["failed"] == [], (name, d["errors"], d["failed"])
        assert (out / "logs" / f"{name}.log").is_file()
        if name == "header":
            assert d["status"] == "ok"
            continue
        assert d["status"] == "skipped", (name, d["status"])
        reason = d["reason"]
        assert reason.startswith("no CUDA") or (name == "reshard" and reason.startswith("not built")), reason
        assert f"skipped: {reason}" in report
    sec = fig["sections"]
    # the header resolved every torch API the GPU paths use, on this torch
    apis = sec["header"]["tables"]["torch_apis"]
    assert len(apis) == len(_driver().API_CHECKS) and all(a["present"] for a in apis), apis
    # the CPU plumbing ran: the CUDA cases were collected, the kernels checked, the allocator scenario and the saves
    assert len(sec["tests"]["figures"]["cases"]) >= 10
    assert all("::" in c for c in sec["tests"]["figures"]["cases"])
    kernels = sec["flashmask"]["tables"]["kernels"]
    assert len(kernels) == 3 and all(k["out_err"] < 1e-4 and k["finite"] for k in kernels), kernels
    assert len(sec["flashmask"]["tables"]["flex"]) == 3 and sec["flashmask"]["tables"]["joined"]
    defrag = sec["memory"]["figures"]["defrag"]
    assert defrag["pointers_stable"] and defrag["data_intact"] and defrag["granules_remapped"] > 0
    assert {r["mode"] for r in sec["memory"]["tables"]["simulated"]} == {"caching", "expandable", "remap"}
    assert all(v["exact"] for v in sec["async_save"]["figures"]["per_library"].values())
    if sec["reshard"]["reason"].startswith("no CUDA"):
        assert sec["reshard"]["figures"]["bit_exact"] is True


def test_a_section_past_its_budget_is_killed_and_reported(tmp_path):
    out = tmp_path / "out"
    r = _run(out, "--dry-run", "--only", "header,memory", "--budget", "header=2", "--grace", "1",
             env={"GPU_CHECK_HANG": "header"})
    assert r.returncode == 0, r.stdout + r.stderr
    fig = json.loads((out / "figures.json").read_text())
    head = fig["sections"]["header"]
    assert head["status"] == "timeout" and head["reason"].startswith("killed after 3 s"), head
    assert head["seconds"] < 15
    assert fig["sections"]["memory"]["status"] == "skipped"  # the next section still ran
    assert "| header | timeout |" in (out / "report.md").read_text()
