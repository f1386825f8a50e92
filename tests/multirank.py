"""Run named scenarios on N gloo ranks and report which scenario failed on which rank, with its traceback.

A scenario module defines functions ``scenario_<name>(ctx)``; :func:`run_scenarios` spawns ``world`` processes
that join one gloo group and run the scenarios in order, each in its own directory ``ctx.root`` (shared by the
ranks; ``ctx.shared`` is the directory common to every scenario, where the parent may have prepared inputs). A
scenario passes on a rank when it returns; anything it raises fails it there (``pytest.skip(reason)`` on every
rank skips it). After each scenario the ranks exchange their outcomes (so a rank that failed early cannot leave
the others waiting in the next scenario), and the parent raises one ``AssertionError`` listing every
``scenario @ rank`` that failed with its traceback. Values a scenario returns (JSON data) come back in
:meth:`Outcome.values`.

Each rank records its outcome after every scenario, and the name of the scenario it is running before it starts
one, so a rank that dies (a signal, an abort in C++) or a scenario that runs past its limit (default
:data:`SCENARIO_TIMEOUT_S`, per scenario :func:`timeout`; the parent kills the ranks) is reported by the name of
the scenario it was in. :func:`worlds` restricts a scenario to some world sizes; :func:`needs` names the
scenarios whose results (files under ``ctx.shared``, state in the rank process) it uses, so a ``-k`` selection
still runs them first.

Usage (the ``multirank`` fixture of ``tests/conftest.py`` wraps it)::

    outcome = multirank("_my_scenarios", world=4)   # a module next to the test, or any importable module
    outcome.check()                                  # AssertionError naming scenario, rank and traceback

One pytest test per scenario, the ranks launched once per session (shared by pytest-xdist workers)::

    launched = launch_fixture("_my_scenarios", worlds=(4,))

    @each_scenario("_my_scenarios", worlds=(4,))
    def test_my_scenarios(launched, world, scenario):
        launched.check(scenario, world)              # "<scenario> failed on rank 2 of 4: AssertionError: ..."

From another interpreter (a virtual environment with other packages)::

    python tests/multirank.py path/to/_writers.py WORLD ROOT [scenario ...]   # exit 1 and the report on failure
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

TIMEOUT_S = 120  # a collective waiting this long for a rank that is gone fails instead of hanging
SCENARIO_TIMEOUT_S = 600  # wall-clock limit of one scenario on any rank (the parent kills the ranks after it)
PREFIX = "scenario_"


# ---------------------------------------------------------------- scenario attributes

def worlds(*sizes: int) -> Callable:
    """Decorator: run this scenario only when the launch has one of these world sizes."""
    def mark(fn):
        fn.multirank_worlds = tuple(sizes)
        return fn
    return mark


def timeout(seconds: float) -> Callable:
    """Decorator: this scenario's wall-clock limit in seconds (default :data:`SCENARIO_TIMEOUT_S`)."""
    def mark(fn):
        fn.multirank_timeout_s = float(seconds)
        return fn
    return mark


def raised(fn) -> BaseException:
    """The exception ``fn()`` raises on this rank (for scenarios that check every rank fails the same way)."""
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the scenario inspects it
        return e
    raise AssertionError("no exception was raised on this rank")


def needs(*names: str) -> Callable:
    """Decorator: scenarios (``scenario_`` prefix optional) that must run before this one in the same launch."""
    def mark(fn):
        fn.multirank_needs = tuple(n if n.startswith(PREFIX) else PREFIX + n for n in names)
        return fn
    return mark


def _module(module: str):
    if module.endswith(".py"):  # a file: import it by name from its directory
        path = Path(module).resolve()
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        module = path.stem
    return importlib.import_module(module)


def scenario_names(module: str, world: int | None = None) -> list[str]:
    """The scenario functions of ``module`` (``scenario_*``), in definition order; with ``world``, only those that
    run at that world size."""
    mod = _module(module)
    out = []
    for n, fn in vars(mod).items():
        if n.startswith(PREFIX) and callable(fn):
            sizes = getattr(fn, "multirank_worlds", None)
            if world is None or sizes is None or world in sizes:
                out.append(n)
    return out


def scenario_id(name: str) -> str:
    """The name a report and a pytest id use: the function name without ``scenario_``."""
    return name[len(PREFIX):] if name.startswith(PREFIX) else name


def with_needs(module: str, names: list[str], world: int | None = None) -> list[str]:
    """``names`` plus every scenario they need (transitively), in definition order."""
    mod = _module(module)
    want, todo = set(), list(names)
    while todo:
        n = todo.pop()
        if n not in want:
            want.add(n)
            todo.extend(getattr(getattr(mod, n), "multirank_needs", ()))
    return [n for n in scenario_names(module, world) if n in want]


def link_files(src: str | os.PathLike, dst: str | os.PathLike, files) -> Path:
    """A directory ``dst`` holding hard links to ``files`` of ``src``: what one node's local disk would hold when
    several simulated nodes share this machine's disk (copies where the file system has no hard links)."""
    import shutil

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    # a rank writes its data file's block digests beside it (``F.xxh3``): they are on the same node's disk
    files = [g for f in files for g in (f, f + ".xxh3") if g == f or (src / g).exists()]
    for f in files:
        try:
            os.link(src / f, dst / f)
        except OSError:
            shutil.copy2(src / f, dst / f)
    return dst


# ---------------------------------------------------------------- the rank process

PORT_FILE = "rendezvous.port"


def _rendezvous(rank: int, world: int, root: str, timeout_s: float) -> Any:
    """The process group's store without a port race: rank 0 binds its TCPStore to a port the system picks (port
    0) and writes the port to a file in ``root``; the other ranks wait for that file and connect. (A port chosen
    free by the parent and bound by rank 0 later may be taken in between by another test's server, and ranks
    connecting to a foreign listener wait until the timeout.)"""
    import torch.distributed as dist

    path = Path(root, PORT_FILE)
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(str(store.port))
        os.replace(tmp, path)  # atomic: a reader sees no file or the whole port
        port = store.port
    else:
        deadline = time.monotonic() + timeout_s
        while not path.is_file():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not publish its rendezvous port in {path} within {timeout_s} s")
            time.sleep(0.02)
        port = int(path.read_text())
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    os.environ["MASTER_PORT"] = str(port)  # for code that reads the usual variables
    return store


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, default=repr))
    os.replace(tmp, path)  # the parent never reads half a file, even after a kill


def _rank_main(rank: int, world: int, module: str, names: list[str], root: str, path: list[str],
               timeout_s: float = TIMEOUT_S, threads: int | None = None, env: dict | None = None) -> None:
    sys.path[:0] = [p for p in path if p not in sys.path]
    os.environ.update(MASTER_ADDR="127.0.0.1", OARLOCK_PROGRESS="0", **(env or {}))
    import torch
    import torch.distributed as dist

    if threads:  # ranks sharing a few cores: spinning intra-op threads slow every collective down
        torch.set_num_threads(threads)
    out: dict[str, Any] = {}
    outcome, progress = Path(root, f"outcome.{rank}.json"), Path(root, f"progress.{rank}.json")
    try:
        dist.init_process_group("gloo", store=_rendezvous(rank, world, root, timeout_s), rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        try:  # a scenario may call pytest.skip
            import pytest

            skipped: Any = pytest.skip.Exception
        except ImportError:
            skipped = ()
        mod = _module(module)
        for name in names:
            ctx = SimpleNamespace(rank=rank, world=world, root=Path(root) / name, shared=Path(root),
                                  name=scenario_id(name))
            if rank == 0:
                ctx.root.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            _write_json(progress, {"name": name, "started": time.time()})
            t0 = time.perf_counter()
            try:
                value = getattr(mod, name)(ctx)
                out[name] = {"ok": True, "value": value}
            except skipped as e:
                out[name] = {"ok": True, "skipped": str(e.msg if hasattr(e, "msg") else e)}
            except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
                out[name] = {"ok": False, "error": traceback.format_exc()}
            out[name]["seconds"] = round(time.perf_counter() - t0, 2)
            _write_json(outcome, out)
            _write_json(progress, {"name": name, "started": time.time(), "done": True})
            try:  # every rank finishes the scenario before the next starts
                dist.all_gather_object([None] * world, out[name]["ok"])
            except Exception:  # the group is broken (a rank died or timed out): stop here
                out["__aborted__"] = {"ok": False, "error": f"process group broken after {name}:\n"
                                      + traceback.format_exc()}
                break
        _write_json(progress, {"name": None, "started": time.time()})
    except BaseException:  # noqa: BLE001 - setting up the rank failed (joining the group, importing the module)
        out["__aborted__"] = {"ok": False, "error": traceback.format_exc()}
    finally:
        _write_json(outcome, out)
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    # The outcome is recorded: leave without running interpreter/C++ teardown, where gloo's background threads
    # sometimes abort the process ("terminate called without an active exception") after all work succeeded.
    # Processes a scenario's libraries started (Megatron's async writer pool, ...) would outlive os._exit and keep
    # the launcher's stdout/stderr pipes open: stop them, as a normal interpreter exit would.
    _stop_children()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _stop_children() -> None:
    import multiprocessing

    children = multiprocessing.active_children()
    for p in children:
        p.terminate()
    for p in children:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


# ---------------------------------------------------------------- the parent

@dataclass
class Outcome:
    """Per scenario and rank: ``ok`` and the returned value or the traceback; ``lost``: per rank, why it stopped
    early (it died, or the parent killed it at a scenario's time limit), naming the scenario it was running."""

    names: list[str]
    world: int
    ranks: list[dict[str, Any]] = field(default_factory=list)
    lost: dict[int, str] = field(default_factory=dict)

    def _failures(self, names: list[str]) -> list[str]:
        out = []
        for name in names:
            for r, res in enumerate(self.ranks):
                got = res.get(name)
                if got is None and name != "__aborted__":
                    why = self.lost.get(r) or next((f"an earlier failure stopped rank {r}:\n{e['error']}"
                                                    for e in [res.get("__aborted__")] if e), "did not run")
                    out.append(f"{scenario_id(name)} @ rank {r} of {self.world}: {why}")
                elif got is not None and not got["ok"]:
                    tb = got["error"].rstrip()
                    out.append(f"{scenario_id(name)} @ rank {r} of {self.world}: {tb.splitlines()[-1]}\n{tb}")
        return out

    def failures(self) -> list[str]:
        return self._failures(self.names + ["__aborted__"])

    def values(self, name: str) -> list[Any]:
        """What scenario ``name`` returned on each rank (None where it failed)."""
        name = name if name in self.names else PREFIX + name
        return [res.get(name, {}).get("value") for res in self.ranks]

    def seconds(self, name: str) -> list[float | None]:
        """How long scenario ``name`` ran on each rank (informational, never asserted)."""
        name = name if name in self.names else PREFIX + name
        return [res.get(name, {}).get("seconds") for res in self.ranks]

    def check(self, name: str | None = None) -> None:
        """Check every scenario, or only ``name`` (``scenario_`` prefix optional): a scenario every rank skipped
        skips the calling test.

        Raises:
            AssertionError: listing every failed ``scenario @ rank`` with the failing assertion and traceback."""
        import pytest

        if name is None:
            bad = self.failures()
        else:
            name = name if name in self.names else PREFIX + name
            assert name in self.names, f"{scenario_id(name)} was not launched (launched: {self.names})"
            bad = self._failures([name])
            got = [res.get(name) or {} for res in self.ranks]
            if not bad and got and all("skipped" in g for g in got):
                pytest.skip(f"{scenario_id(name)}: {got[0]['skipped']}")
        assert not bad, f"{len(bad)} scenario run(s) failed:\n" + "\n".join(bad)


def run_scenarios(module: str, world: int, root: str | os.PathLike, names: list[str] | None = None, *,
                  timeout_s: float = TIMEOUT_S, threads: int | None = None, env: dict | None = None) -> Outcome:
    """Run ``names`` (default: every ``scenario_*`` of ``module`` for this ``world``) on ``world`` gloo ranks
    (spawned processes) in directory ``root``; ``timeout_s``: the process group's collective timeout,
    ``threads``: ``torch.set_num_threads`` in each rank, ``env``: extra environment variables of the ranks."""
    import torch.multiprocessing as mp

    mod = _module(module)
    module = mod.__name__
    names = names or scenario_names(module, world)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for f in [*root.glob("progress.*.json"), *root.glob("outcome.*.json"), *root.glob(PORT_FILE)]:  # of an earlier
        f.unlink()  # launch here
    limits = {n: getattr(getattr(mod, n), "multirank_timeout_s", SCENARIO_TIMEOUT_S) for n in names}
    proc = mp.start_processes(_rank_main, args=(world, module, names, str(root), list(sys.path),
                                                timeout_s, threads, env),
                              nprocs=world, start_method="spawn", join=False)
    lost: dict[int, str] = {}

    def running(r: int) -> tuple[str | None, float, bool]:
        """The scenario rank ``r`` is in, for how long, and whether it has finished it (waiting for the others)."""
        try:
            p = json.loads((root / f"progress.{r}.json").read_text())
            return p["name"], time.time() - p["started"], p.get("done", False)
        except (OSError, ValueError):
            return None, 0.0, False

    def where(r: int) -> str:
        name, t, done = running(r)
        if name is None:
            return "outside the scenarios"
        return f"waiting for the other ranks after {scenario_id(name)}" if done else \
            f"while running {scenario_id(name)} ({t:.0f} s)"

    while True:
        try:
            if proc.join(timeout=1.0, grace_period=5.0):
                break
        except Exception as e:  # a rank exited with an error or a signal; torch has stopped the others
            first = getattr(e, "error_index", -1)
            for r, p in enumerate(proc.processes):
                if r == first:
                    lost[r] = f"the rank process died {where(r)} (exit code {p.exitcode}): {e}"
                elif p.exitcode not in (0, None):
                    lost[r] = f"stopped {where(r)}, because rank {first} died"
            break
        over = [(r, n, t) for r in range(world) for n, t, done in [running(r)]
                if n is not None and not done and t > limits[n]]
        if over:
            for r, n, t in over:
                lost[r] = f"still running {scenario_id(n)} after {t:.0f} s (limit {limits[n]:.0f} s); killed"
            for r, p in enumerate(proc.processes):
                if p.is_alive():
                    lost.setdefault(r, f"killed {where(r)}, because rank {over[0][0]} ran past "
                                       f"{scenario_id(over[0][1])}'s time limit")
                    p.kill()
            for p in proc.processes:
                p.join()
            break
    ranks = []
    for r in range(world):
        f = root / f"outcome.{r}.json"
        ranks.append(json.loads(f.read_text()) if f.is_file() else {})
    return Outcome(names, world, ranks, {r: v for r, v in lost.items() if r >= 0})


# ---------------------------------------------------------------- pytest: one test per scenario

class Launches:
    """The launches of one scenario module for one test module, one per world size, each run once per session
    (lazily, at the first :meth:`check`) with the scenarios the session selected (plus what they need).

    Under pytest-xdist every worker collects the same tests and may run some of one launch's: the first worker
    that needs a launch runs it while holding a lock on its directory (shared by the session's workers) and
    records it; the others wait for that record and read it, so the ranks never launch twice.
    """

    def __init__(self, module: str, root: Path, selected: dict[int, list[str]], prepare: Callable | None,
                 kwargs: dict):
        self.module, self._root, self.selected, self.prepare, self.kwargs = module, root, selected, prepare, kwargs
        self._outcomes: dict[int, Outcome] = {}

    def root(self, world: int) -> Path:
        """The directory of the launch at ``world`` (``ctx.shared`` of its scenarios)."""
        return self._root / f"world{world}"

    def outcome(self, world: int) -> Outcome:
        """The launch at ``world``, run now if no worker of this session has run it yet."""
        import fcntl

        import pytest

        if world not in self._outcomes:
            root = self.root(world)
            root.mkdir(parents=True, exist_ok=True)
            record = root / "launch.json"
            with open(root.with_name(root.name + ".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (also if this worker dies)
                if not record.is_file():
                    try:
                        if self.prepare is not None:
                            self.prepare(root, world)
                        got = run_scenarios(self.module, world, root, self.selected[world], **self.kwargs)
                        data = {"outcome": {"names": got.names, "world": got.world, "ranks": got.ranks,
                                            "lost": got.lost}}
                    except pytest.skip.Exception as e:
                        data = {"skip": str(e.msg)}
                    except BaseException:  # noqa: BLE001 - every test of the launch reports it, not only the first
                        data = {"error": traceback.format_exc()}
                    _write_json(record, data)
            data = json.loads(record.read_text())
            if "skip" in data:
                pytest.skip(data["skip"])
            if "error" in data:
                raise RuntimeError(f"launching {self.module} on {world} ranks failed:\n{data['error']}")
            o = data["outcome"]
            self._outcomes[world] = Outcome(o["names"], o["world"], o["ranks"],
                                            {int(r): v for r, v in o["lost"].items()})
        return self._outcomes[world]

    def check(self, scenario: str, world: int | None = None) -> None:
        """:meth:`Outcome.check` of ``scenario`` in the launch at ``world`` (the only one if omitted)."""
        self.outcome(world if world is not None else next(iter(self.selected))).check(scenario)

    def values(self, scenario: str, world: int | None = None) -> list[Any]:
        return self.outcome(world if world is not None else next(iter(self.selected))).values(scenario)


def launch_fixture(module: str, worlds: tuple[int, ...] = (4,), *, prepare: Callable | None = None,
                   **kwargs) -> Callable:
    """A module-scoped pytest fixture (assign it to a module-level name) giving :class:`Launches` of ``module``.

    Only the scenarios of the tests that this session selected (``-k``, node ids; every test of the module that
    uses this fixture and is parametrized by :func:`each_scenario`) are launched, with the ones they need.
    ``prepare(root, world)`` runs in the parent before a launch (inputs for ``ctx.shared``); ``kwargs`` go to
    :func:`run_scenarios`."""
    import pytest

    @pytest.fixture(scope="module")
    def fixture(request, tmp_path_factory):
        wanted: dict[int, list[str]] = {w: [] for w in worlds}
        for item in request.session.items:
            spec = getattr(item, "callspec", None)
            if item.module is request.module and spec is not None and "scenario" in spec.params \
                    and request.fixturename in item.fixturenames:
                w = spec.params.get("world", worlds[0])
                if w in wanted:
                    wanted[w].append(spec.params["scenario"])
        selected = {w: with_needs(module, names, w) or scenario_names(module, w) for w, names in wanted.items()}
        base = tmp_path_factory.getbasetemp()
        if os.environ.get("PYTEST_XDIST_WORKER"):  # the session's directory, above the worker's own
            base = base.parent
        test_module = request.module.__name__.rpartition(".")[2]
        return Launches(module, base / f"multirank-{test_module}-{request.fixturename}", selected, prepare, kwargs)

    return fixture


def each_scenario(module: str, worlds: tuple[int, ...] = (4,)) -> Callable:
    """Decorator: parametrize a test by ``world`` and ``scenario`` (pytest id: the scenario's name, prefixed by
    the world size when there are several)."""
    import pytest

    params = [pytest.param(w, n, id=scenario_id(n) if len(worlds) == 1 else f"w{w}-{scenario_id(n)}")
              for w in worlds for n in scenario_names(module, w)]
    return pytest.mark.parametrize("world,scenario", params)


def main(argv: list[str] | None = None) -> int:
    """``python multirank.py MODULE WORLD ROOT [SCENARIO ...]``: run, print the report, exit 1 on any failure."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3:
        print(main.__doc__, file=sys.stderr)
        return 2
    module, world, root, names = args[0], int(args[1]), args[2], args[3:]
    names = [n if n.startswith(PREFIX) else PREFIX + n for n in names] or None
    import multirank  # run as a script: the rank processes must find _rank_main under this module's name

    outcome = multirank.run_scenarios(module, world, root, names)
    bad = outcome.failures()
    for name in outcome.names:
        print(f"{scenario_id(name)}: {'ok' if not outcome._failures([name]) else 'FAILED'}")
    if bad:
        print(f"{len(bad)} scenario run(s) failed:\n" + "\n".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
