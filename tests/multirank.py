"""Run named scenarios on N gloo ranks and report which scenario failed on which rank, with its traceback.

A scenario module defines functions ``scenario_<name>(ctx)``; :func:`run_scenarios` spawns ``world`` processes
that join one gloo group and run the scenarios in order, each in its own directory ``ctx.root`` (shared by the
ranks; ``ctx.shared`` is the directory common to every scenario, where the parent may have prepared inputs). A scenario passes on a rank when it returns; anything it raises fails it there. After each scenario the
ranks exchange their outcomes (so a rank that failed early cannot leave the others waiting in the next scenario),
and the parent raises one ``AssertionError`` listing every ``scenario @ rank`` that failed with its traceback.
Values a scenario returns (JSON data) come back in :attr:`Outcome.values`.

Usage (the ``multirank`` fixture of ``tests/conftest.py`` wraps it)::

    outcome = multirank("_my_scenarios", world=4)   # a module next to the test, or any importable module
    outcome.check()                                  # AssertionError naming scenario, rank and traceback
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import socket
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

TIMEOUT_S = 120  # a collective waiting this long for a rank that is gone fails instead of hanging


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scenario_names(module: str) -> list[str]:
    """The scenario functions of ``module`` (``scenario_*``), in definition order."""
    mod = importlib.import_module(module)
    return [n for n in vars(mod) if n.startswith("scenario_") and callable(getattr(mod, n))]


def _rank_main(rank: int, world: int, port: int, module: str, names: list[str], root: str, path: list[str]) -> None:
    import torch.distributed as dist

    sys.path[:0] = [p for p in path if p not in sys.path]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OARLOCK_PROGRESS="0")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    out: dict[str, Any] = {}
    try:
        mod = importlib.import_module(module)
        for name in names:
            ctx = SimpleNamespace(rank=rank, world=world, root=Path(root) / name, shared=Path(root))
            if rank == 0:
                ctx.root.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            try:
                value = getattr(mod, name)(ctx)
                out[name] = {"ok": True, "value": value}
            except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
                out[name] = {"ok": False, "error": traceback.format_exc()}
            try:  # every rank finishes the scenario before the next starts
                dist.all_gather_object([None] * world, out[name]["ok"])
            except Exception:  # the group is broken (a rank died or timed out): stop here
                out["__aborted__"] = {"ok": False, "error": f"process group broken after {name}:\n"
                                      + traceback.format_exc()}
                break
    finally:
        Path(root, f"outcome.{rank}.json").write_text(json.dumps(out, default=repr))
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    # The outcome is recorded: leave without running interpreter/C++ teardown, where gloo's background threads
    # sometimes abort the process ("terminate called without an active exception") after all work succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@dataclass
class Outcome:
    """Per scenario and rank: ``ok`` and the returned value or the traceback."""

    names: list[str]
    world: int
    ranks: list[dict[str, Any]] = field(default_factory=list)

    def failures(self) -> list[str]:
        out = []
        for name in self.names + ["__aborted__"]:
            for r, res in enumerate(self.ranks):
                got = res.get(name)
                if got is None and name != "__aborted__":
                    out.append(f"{name} @ rank {r}: did not run")
                elif got is not None and not got["ok"]:
                    out.append(f"{name} @ rank {r}:\n{got['error']}")
        return out

    def values(self, name: str) -> list[Any]:
        """What scenario ``name`` returned on each rank (None where it failed)."""
        return [res.get(name, {}).get("value") for res in self.ranks]

    def check(self) -> None:
        """Raises:
            AssertionError: listing every failed ``scenario @ rank`` with its traceback."""
        bad = self.failures()
        assert not bad, f"{len(bad)} scenario run(s) failed:\n" + "\n".join(bad)


def run_scenarios(module: str, world: int, root: str | os.PathLike, names: list[str] | None = None) -> Outcome:
    """Run ``names`` (default: every ``scenario_*`` of ``module``) on ``world`` gloo ranks (spawned processes)."""
    import torch.multiprocessing as mp

    names = names or scenario_names(module)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_rank_main, args=(world, _free_port(), module, names, str(root), list(sys.path)),
                       nprocs=world, start_method="spawn", join=True)
    ranks = []
    for r in range(world):
        f = root / f"outcome.{r}.json"
        ranks.append(json.loads(f.read_text()) if f.is_file() else {})
    return Outcome(names, world, ranks)
