"""Checkpoint stall of asynchronous saves: oarlock's ``async_save`` vs DCP's ``dcp.async_save`` (issue 27).

Workload: 4 gloo ranks, ``--size-mib`` (default 512) MiB of fp32 DTensors ``[Shard(0)]`` on a 1-D mesh of the 4
ranks (tensors of 8 MiB each, at least 4 tensors). Every launch warms each library up with one unmeasured save
(oarlock then reuses its plan and staging buffers; DCP its stager's cached storages), times a compute loop alone,
then for each library one measured save into a fresh directory, all in the same processes (the order of the
libraries rotates from launch to launch):

* **stall**: time until the save call returns (slowest rank);
* **snapshot wait**: the loop's first step waits for the snapshot before it updates the saved state in place
  (oarlock ``handle.wait_staged()``, DCP ``staging_completion.result()``; zero where the call itself staged);
* **loop slowdown**: mean step time of the compute loop while the save is in flight, over the mean step time
  alone (mean over ranks). A step is ``--matmul``-sized matrix products (CPU, or the GPU's current stream)
  followed by an in-place update of one row of every saved tensor (the optimizer step, after the snapshot);
* **loop time lost**: the steps run while the save was in flight took this much longer in all than as many steps
  alone (mean over ranks): the slowdown times its duration, what the job pays beside the stall;
* **commit**: time from the call until the checkpoint is committed (slowest rank; a watcher thread waits on the
  save's completion).

Libraries: ``oarlock`` (``async_save``); ``dcp-thread`` (``dcp.async_save`` with
``AsyncCheckpointerType.THREAD`` and its default stager: staging inside the call); ``dcp-stager``
(``AsyncCheckpointerType.THREAD`` with a ``DefaultStager`` whose ``StagingOptions`` give its shortest stall:
asynchronous staging, plus pinned memory and non-blocking copies when CUDA is used; shared memory off, which only
serves the process checkpointer). DCP's process checkpointer is not run (it hung on CPU/gloo, see issue 27).

Plan caching, each library with and without: oarlock reuses the previous save's plan when the state's layout is
unchanged (``oarlock``); ``oarlock-nocache`` clears its plan cache (``save.plan_cache``) before the call, so it
plans as a first save does. DCP caches plans only when asked (``DefaultSavePlanner(enable_plan_caching=True)``):
the ``-cached`` DCP rows pass such a planner (warmed up by their unmeasured save), the others DCP's default
planner, which plans every save.

On CUDA (``--device cuda``, default when available) every rank's tensors live on the GPU (rank % device count);
oarlock stages into reused pinned buffers with non-blocking copies on a side stream; the process group is
``cpu:gloo,cuda:gloo`` (several ranks may share one GPU). The loaded checkpoints are checked against the saved
values (clones taken before the save) once per launch. The machine's load average is printed with the table.

Usage: python benchmarks/async_save.py [--size-mib 512] [--launches 3] [--device cpu|cuda] [--dir DIR]
       [--quick] [--append-results]
(``--quick``: 8 MiB, one launch, a few steps: checks that the script runs; its figures mean nothing.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

WORLD = 4
COLS = 1024
TENSOR_MIB = 8
LIBS = ("oarlock", "oarlock-nocache", "dcp-thread", "dcp-thread-cached", "dcp-stager", "dcp-stager-cached")
DCP_LIBS = tuple(lib for lib in LIBS if lib.startswith("dcp"))


def launch_order(i: int) -> tuple[str, ...]:
    """The order of the libraries in launch ``i``: launches 0, 1, 2 start with oarlock, dcp-thread, dcp-stager;
    launches 3, 4, 5 with the other caching variant of each, so neither library (nor either variant) always
    goes first."""
    k = (2 * i + (i // 3) % 2) % len(LIBS)
    return LIBS[k:] + LIBS[:k]


def tensor_shapes(size_mib: int, itemsize: int = 4) -> list[tuple[int, int]]:
    """Global shapes of the saved tensors: ``size_mib`` MiB of elements of ``itemsize`` bytes (fp32 by default) in
    tensors of about 8 MiB (at least 4), rows a multiple of the world size."""
    n = max(4, size_mib // TENSOR_MIB)
    rows = max(WORLD, (size_mib * 2**20 // (n * COLS * itemsize)) // WORLD * WORLD)
    return [(rows, COLS)] * n


class Loop:
    """The compute loop: ``a @ b`` products, then a one-row in-place update of every saved tensor."""

    def __init__(self, device: torch.device, n: int, state: dict):
        g = torch.Generator().manual_seed(0)
        self.a = torch.randn(n, n, generator=g).to(device)
        self.b = torch.randn(n, n, generator=g).to(device)
        self.device = device
        self.state = state

    def step(self, before_update=None) -> float:
        t0 = time.perf_counter()
        c = self.a
        for _ in range(4):
            c = torch.mm(c, self.b)
            c.div_(c.abs().max().clamp_min(1.0))
        if before_update is not None:
            before_update()
        for v in self.state.values():
            v.to_local()[:1].add_(1.0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0


def rank_main(rank: int, world: int, port: int, root: str, size_mib: int, device_kind: str, steps: int,
              matmul: int, check: bool, order: tuple[str, ...] = LIBS, dtype: torch.dtype = torch.float32) -> None:
    """One rank of a launch (also called in-process with ``world=1`` by scripts/gpu_check.py): writes its figures
    to ``root/result-{rank}.json``. ``dtype``: of the saved tensors (fp32 for this script's tables)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from oarlock.checkpoint import async_save, load_state_dict
    from oarlock.checkpoint.runtime.save import plan_cache

    warnings.filterwarnings("ignore")
    cuda = device_kind == "cuda"
    torch.set_num_threads(max(1, (os.cpu_count() or WORLD) // world))
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
        backend = "cpu:gloo,cuda:gloo"
    else:
        dev = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh(dev.type, (world,))
    root = Path(root)
    g = torch.Generator().manual_seed(100 + rank)
    state = {}
    for i, (rows, cols) in enumerate(tensor_shapes(size_mib, dtype.itemsize)):
        local = torch.randn(rows // world, cols, generator=g).to(dev, dtype)
        state[f"layers.{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], shape=torch.Size((rows, cols)),
                                                         stride=(cols, 1), run_check=False)
    loop = Loop(dev, matmul, state)
    opts = StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
                          use_non_blocking_copy=cuda)
    stager = DefaultStager(opts)

    def start(lib: str, path: Path):
        """Start a save; returns ``(wait_snapshot, done_event, plan_reused)`` (``plan_reused``: a callable for
        oarlock, None for DCP, which does not say)."""
        done = threading.Event()
        if lib.startswith("oarlock"):
            if lib == "oarlock-nocache":  # forget every plan: this save plans as a first save does
                plan_cache.clear()
            h = async_save(state, path)
            # a callback, as for DCP's futures: a watcher thread started here would put its start-up in the stall
            h.add_done_callback(lambda _: done.set())
            return h.wait_staged, done, lambda: h.plan_reused
        # DCP's plan cache is class-level, filled by the -cached variant's warm-up save and used only by a planner
        # that enables it; None: DCP's default planner, which plans every save
        planner = DefaultSavePlanner(enable_plan_caching=True) if lib.endswith("-cached") else None
        if lib.startswith("dcp-thread"):
            fut = dcp.async_save(state, checkpoint_id=str(path), async_checkpointer_type=AsyncCheckpointerType.THREAD,
                                 planner=planner)
            fut.add_done_callback(lambda _: done.set())
            return (lambda: None), done, None
        resp = dcp.async_save(state, checkpoint_id=str(path), async_checkpointer_type=AsyncCheckpointerType.THREAD,
                              async_stager=stager, planner=planner)
        resp.upload_completion.add_done_callback(lambda _: done.set())
        return resp.staging_completion.result, done, None

    # warm-up: one unmeasured save each (plans, staging buffers, the side process group), the loop itself
    for lib in LIBS:
        wait_snap, done, _ = start(lib, root / f"warm-{lib}")
        wait_snap()
        done.wait()
        dist.barrier()
        if rank == 0:  # twelve saves kept to the end would need twelve times the state on disk
            shutil.rmtree(root / f"warm-{lib}", ignore_errors=True)
    for _ in range(3):
        loop.step()
    dist.barrier()
    alone = [loop.step() for _ in range(steps)]
    res: dict = {"alone": statistics.mean(alone), "libs": {}}
    for lib in order:
        path = root / f"{lib}"
        before = {k: v.to_local().clone() for k, v in state.items()} if check else None
        dist.barrier()
        t0 = time.perf_counter()
        wait_snap, done, reused = start(lib, path)
        stall = time.perf_counter() - t0
        committed: list[float] = []
        threading.Thread(target=lambda: (done.wait(), committed.append(time.perf_counter() - t0)),
                         daemon=True).start()
        blocked = [0.0]

        def snapshot_wait():
            t = time.perf_counter()
            wait_snap()
            blocked[0] = time.perf_counter() - t

        times = [loop.step(snapshot_wait)]
        while not done.is_set() or len(times) < 2:
            times.append(loop.step())
        done.wait()
        while not committed:
            time.sleep(0.001)
        res["libs"][lib] = {"stall": stall, "snapshot_wait": blocked[0], "beside": statistics.mean(times),
                            "steps": len(times), "commit": committed[0], "busy": sum(times),
                            "plan_reused": None if reused is None else reused()}
        dist.barrier()
        if check:  # what was saved is what the state held at the call
            got = {k: DTensor.from_local(torch.zeros_like(v.to_local()), mesh, [Shard(0)], shape=v.shape,
                                         stride=v.stride(), run_check=False) for k, v in state.items()}
            if lib.startswith("oarlock"):
                load_state_dict(got, path)
            else:
                dcp.load(got, checkpoint_id=str(path))
            res["libs"][lib]["exact"] = all(torch.equal(got[k].to_local().cpu(), before[k].cpu()) for k in state)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    stager.close()
    (root / f"result-{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def launch(size_mib: int, device: str, steps: int, matmul: int, scratch: Path, check: bool,
           order: tuple[str, ...] = LIBS) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scratch.mkdir(parents=True, exist_ok=True)
    mp.start_processes(rank_main, args=(WORLD, port, str(scratch), size_mib, device, steps, matmul, check, order),
                       nprocs=WORLD, start_method="spawn")
    return [json.loads((scratch / f"result-{r}.json").read_text()) for r in range(WORLD)]


def summarize(per_rank: list[dict]) -> dict[str, dict[str, float]]:
    """One launch's figures per library: stall, snapshot wait and commit of the slowest rank; slowdown averaged
    over the ranks."""
    out = {}
    for lib in LIBS:
        rows = [r["libs"][lib] for r in per_rank]
        out[lib] = {"stall": max(x["stall"] for x in rows), "snapshot_wait": max(x["snapshot_wait"] for x in rows),
                    "slowdown": statistics.mean(x["beside"] / r["alone"] for x, r in zip(rows, per_rank)),
                    "commit": max(x["commit"] for x in rows), "steps": min(x["steps"] for x in rows),
                    # the loop's steps beside the save took this much longer in all than as many steps alone
                    "lost": statistics.mean(x["busy"] - x["steps"] * r["alone"] for x, r in zip(rows, per_rank)),
                    "exact": all(x.get("exact", True) for x in rows),
                    # oarlock: whether every rank reused the previous plan; DCP: None (it does not say)
                    "plan_reused": None if rows[0]["plan_reused"] is None else all(x["plan_reused"] for x in rows)}
    return out


def table(launches: list[dict[str, dict[str, float]]]) -> str:
    """Markdown table of the medians over launches, with oarlock / DCP ratios."""
    med = {lib: {k: statistics.median(L[lib][k] for L in launches) for k in ("stall", "snapshot_wait", "slowdown",
                                                                           "commit", "lost")} for lib in LIBS}
    lines = ["| library | plan | stall s | snapshot wait s | loop slowdown beside the save | loop time lost s | "
             "commit s | saved values exact |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for lib in LIBS:
        m = med[lib]
        exact = all(L[lib]["exact"] for L in launches)
        reused = {L[lib].get("plan_reused") for L in launches}
        plan = ("cached planner" if lib.endswith("-cached") else "default planner") if lib.startswith("dcp") else (
            "reused" if reused == {True} else "planned" if reused == {False} else "mixed")
        lines.append(f"| {lib} | {plan} | {m['stall']:.4f} | {m['snapshot_wait']:.3f} | {m['slowdown']:.2f}x | "
                     f"{m['lost']:.3f} | {m['commit']:.3f} | {exact} |")
    lines.append("")
    for ours, theirs, what in (("oarlock", [x for x in DCP_LIBS if x.endswith("-cached")], "plans cached"),
                               ("oarlock-nocache", [x for x in DCP_LIBS if not x.endswith("-cached")],
                                "no plan caching")):
        o = med[ours]
        best = min(theirs, key=lambda lib: med[lib]["stall"])
        d = med[best]
        lines.append(f"- {what}: {ours} / {best} (DCP's shortest stall): stall {o['stall'] / d['stall']:.3f}, "
                     f"slowdown excess {(o['slowdown'] - 1) / max(d['slowdown'] - 1, 1e-9):.2f} "
                     f"(of the slowdown beyond 1x), loop time lost {o['lost'] / max(d['lost'], 1e-9):.2f}, "
                     f"commit {o['commit'] / d['commit']:.2f}")
    per = ["", "Per launch (stall s / slowdown / commit s; the first library named ran first):", ""]
    for i, L in enumerate(launches):
        per.append(f"- launch {i + 1}: " + "; ".join(f"{lib} {L[lib]['stall']:.4f} / {L[lib]['slowdown']:.2f}x / "
                                                      f"{L[lib]['commit']:.3f}" for lib in L.get("order", LIBS)))
    return "\n".join(lines + per)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=512, help="MiB of fp32 DTensors saved (all ranks together)")
    ap.add_argument("--launches", type=int, default=3, help="launches of the 4 ranks (the median is reported)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="where the tensors live (default: cuda when available)")
    ap.add_argument("--steps", type=int, default=50, help="steps of the loop timed alone")
    ap.add_argument("--matmul", type=int, default=256, help="size of the loop's square matrix products")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one, removed)")
    ap.add_argument("--no-check", action="store_true", help="skip loading the checkpoints back")
    ap.add_argument("--append-results", action="store_true", help="append the table to benchmarks/RESULTS.md")
    ap.add_argument("--quick", action="store_true", help="8 MiB, one launch, few steps: checks the script runs")
    args = ap.parse_args(argv)
    if args.quick:
        args.size_mib, args.launches, args.steps, args.matmul = 8, 1, 3, 64
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available")
    scratch = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="oarlock-async-"))
    launches = []
    try:
        for i in range(args.launches):
            d = scratch / f"launch{i}"
            order = launch_order(i)
            launches.append(summarize(launch(args.size_mib, device, args.steps, args.matmul, d,
                                             not args.no_check, order)) | {"order": order})
            shutil.rmtree(d, ignore_errors=True)
    finally:
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)
    shapes = tensor_shapes(args.size_mib)
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    text = (f"Load average (1/5/15 min) at the end of the run: {load} on {os.cpu_count()} cores; device {device}; "
            f"{len(shapes)} x {list(shapes[0])} fp32 ({sum(r * c for r, c in shapes) * 4 / 2**20:.0f} MiB) "
            f"[Shard(0)] over {WORLD} ranks; median of {len(launches)} launch(es)\n\n" + table(launches))
    print(text)
    if args.append_results:
        cmd = "python benchmarks/async_save.py " + " ".join(argv if argv is not None else sys.argv[1:])
        from _results import write_section  # benchmarks/_results.py: this script's own section

        write_section(__file__, "Asynchronous save stall: oarlock async_save vs dcp.async_save (issue 27)", f""
                    f"Command: `{cmd.strip()}` ({time.strftime('%Y-%m-%d', time.gmtime())}, torch "
                    f"{torch.__version__}). Stall: until the call returns; snapshot wait: the loop's first step "
                    "waiting for the snapshot; slowdown: mean step time of the compute loop while the save is in "
                    "flight / alone; loop time lost: those steps' total time minus as many steps alone; commit: "
                    "from the call.\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
