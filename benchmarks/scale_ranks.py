"""Many ranks, many small shards: does a rank's cost follow what it reads, or the world size? oarlock vs DCP.

Real processes on this machine (gloo, CPU): ``--tensors`` tensors of ``ROWS x COLS`` float32 (default 1,200 of
64x48, 8 MiB in all) saved as DTensors ``[Shard(0)]`` from 4 ranks and from 16 ranks, then loaded into
``[Shard(1)]`` on 8 ranks, so every loading rank needs a piece of every stored shard. For each library, in one
run: bookkeeping bytes on disk (oarlock: ``metadata.json``, the block digests files and the data files'
safetensors headers; DCP: its ``.metadata`` plus nothing else, its data files having no headers), the save's time,
and the 16 -> 8 load's
slowest rank (time between barriers), and the Python memory of one more (untimed) load per library, the
largest rank's ``tracemalloc`` peak (plans, read items and per-item objects; the targets are made before tracing).
oarlock's load is also run on the path of loads of millions of read items (``oarlock-streamed``: the planner's
templates held, each file's items made when it is checked and when it is read), forced on this load.
Every loaded tensor is compared with the values the 16-rank save wrote
(recomputed from the seed on the loading rank): bit-exact or the run fails. The libraries take turns: repetition
``r`` starts with the ``r``-th library (rotating), so none always runs first.

Usage: python benchmarks/scale_ranks.py [--tensors N] [--reps R] [--dir DIR] [--append-results] [--smoke]
(``--smoke``: 8 tensors saved on 1 and 2 ranks, loaded on 3, one repetition: checks the script runs; its figures
mean nothing.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROWS, COLS = 64, 48


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tensor_value(i: int) -> torch.Tensor:
    """The global value of tensor ``i`` (every rank computes it from the seed: no data is shared)."""
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(ROWS, COLS, generator=g)


def rotated(libs: tuple[str, ...], r: int) -> tuple[str, ...]:
    """``libs`` rotated to start with the ``r``-th (modulo their number): repetition ``r``'s order."""
    k = r % len(libs)
    return libs[k:] + libs[:k]


def rank_main(rank: int, world: int, port: int, job: str, root: str, n: int, reps: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from oarlock.checkpoint import load_state_dict, save_state_dict

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    root = Path(root)
    res: dict = {"rank": rank, "times": {}}

    def timed(name, fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        res["times"].setdefault(name, []).append(time.perf_counter() - t0)

    if job.startswith("save"):
        state = {f"layers.{i}.w": distribute_tensor(tensor_value(i), mesh, [Shard(0)]) for i in range(n)}
        for r in range(reps):
            for lib in rotated(("oarlock", "dcp"), r):
                d = root / f"{job}-{lib}-{r}"
                if lib == "dcp":
                    timed(lib, lambda: dcp.save(state, checkpoint_id=str(d)))
                else:
                    timed(lib, lambda: save_state_dict(state, d))
    else:  # load the larger world's save into [Shard(1)] on this world
        src = job.split(":")[1]
        shape = compute_local_shape_and_global_offset((ROWS, COLS), mesh, [Shard(1)])[0]

        def targets() -> dict:
            return {f"layers.{i}.w": DTensor.from_local(torch.zeros(shape), mesh, [Shard(1)],
                                                        shape=torch.Size((ROWS, COLS)), stride=(COLS, 1))
                    for i in range(n)}

        from oarlock.checkpoint.runtime import executor

        threshold = executor.STREAM_MIN_ITEMS
        libs = ("oarlock", "oarlock-streamed", "dcp")
        for r in range(reps):
            for lib in rotated(libs, r):
                # oarlock-streamed: the path of loads of STREAM_MIN_ITEMS read items and more (the planner's
                # templates, each file's items made when it is checked and when it is read), forced on this load's
                # 19,200 items
                executor.STREAM_MIN_ITEMS = 0 if lib == "oarlock-streamed" else threshold
                tgt = targets()
                d = root / f"{src}-{lib.split('-')[0]}-0"
                if lib == "dcp":
                    timed(lib, lambda: dcp.load(tgt, checkpoint_id=str(d)))
                else:
                    timed(lib, lambda: load_state_dict(tgt, d))
                if r == 0:
                    for i in range(n):
                        want = distribute_tensor(tensor_value(i), mesh, [Shard(1)]).to_local()
                        if not torch.equal(tgt[f"layers.{i}.w"].to_local(), want):
                            raise AssertionError(f"{lib}: tensor {i} differs after the load on rank {rank}")
        import tracemalloc

        for lib in libs:
            # one more load, untimed, under tracemalloc: the Python memory the load allocates beyond its targets
            # (plans, read items, per-item views; both libraries keep theirs as Python objects). The targets are
            # made before tracing starts.
            executor.STREAM_MIN_ITEMS = 0 if lib == "oarlock-streamed" else threshold
            tgt = targets()
            d = root / f"{src}-{lib.split('-')[0]}-0"
            dist.barrier()
            tracemalloc.start()
            if lib == "dcp":
                dcp.load(tgt, checkpoint_id=str(d))
            else:
                load_state_dict(tgt, d)
            res.setdefault("traced", {})[lib] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            del tgt
        executor.STREAM_MIN_ITEMS = threshold
    (root / f"result-{job.replace(':', '_')}-{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def launch(world: int, job: str, root: Path, n: int, reps: int) -> list[dict]:
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(world), "--port", str(port),
                               "--job", job, "--dir", str(root), "--tensors", str(n), "--reps", str(reps)], env=env)
             for r in range(world)]
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise SystemExit(f"{job} on {world} ranks failed (exit {p.returncode})")
    return [json.loads((root / f"result-{job.replace(':', '_')}-{r}.json").read_text()) for r in range(world)]


def bookkeeping(d: Path) -> int:
    """Bytes of a checkpoint that are not tensor data: oarlock's metadata.json, its block digests files (format 4)
    and each safetensors file's 8-byte length and JSON header; DCP's .metadata."""
    total = 0
    for f in d.iterdir():
        if f.name in ("metadata.json", ".metadata") or f.suffix == ".xxh3":
            total += f.stat().st_size
        elif f.suffix == ".safetensors":
            with open(f, "rb") as fh:
                total += 8 + struct.unpack("<Q", fh.read(8))[0]
    return total


def slowest(results: list[dict], lib: str) -> float:
    """Median over repetitions of the slowest rank's time."""
    reps = len(results[0]["times"][lib])
    return statistics.median(max(r["times"][lib][k] for r in results) for k in range(reps))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=1200)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--append-results", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="8 tensors, saves on 1 and 2 ranks, load on 3, one "
                    "repetition: checks the script runs")
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--world", type=int, default=None)
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--job", default=None)
    args = ap.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args.world, args.port, args.job, args.dir, args.tensors, args.reps)
        return 0
    if args.smoke:
        args.tensors, args.reps = 8, 1
    root = Path(args.dir or tempfile.mkdtemp(prefix="oarlock-scale-ranks-"))
    root.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    (lo, hi), nl = (1, 2), 3
    if not args.smoke:
        (lo, hi), nl = (4, 16), 8
    saves = {w: launch(w, f"save{w}", root, args.tensors, args.reps) for w in (lo, hi)}
    loads = launch(nl, f"load:save{hi}", root, args.tensors, args.reps)
    load_after = os.getloadavg()
    rows = []
    book = {lib: {w: bookkeeping(root / f"save{w}-{lib}-0") for w in (lo, hi)} for lib in ("oarlock", "dcp")}
    flags = " --smoke" if args.smoke else ""
    lines = [f"`python benchmarks/scale_ranks.py --tensors {args.tensors} --reps {args.reps}{flags}` "
             f"({time.strftime('%Y-%m-%d')}; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
             f"{args.tensors} tensors of {ROWS}x{COLS} fp32, DTensor [Shard(0)] saved on {lo} and {hi} gloo ranks, "
             f"loaded as [Shard(1)] on {nl}; slowest rank, median of the repetitions, the libraries taking turns "
             "to go first; bit-exact)", "",
             "| | oarlock | DCP | oarlock / DCP |", "|---|---:|---:|---:|"]
    for w in (lo, hi):
        rows.append((f"bookkeeping bytes, {w} ranks", book["oarlock"][w], book["dcp"][w]))
    rows.append((f"bookkeeping {hi} / {lo} ranks", book["oarlock"][hi] / book["oarlock"][lo],
                 book["dcp"][hi] / book["dcp"][lo]))
    for w in (lo, hi):
        rows.append((f"save on {w} ranks (s)", slowest(saves[w], "oarlock"), slowest(saves[w], "dcp")))
    rows.append((f"load {hi} -> {nl} ranks, slowest rank (s)", slowest(loads, "oarlock"), slowest(loads, "dcp")))
    rows.append((f"load {hi} -> {nl}: Python memory of the load, largest rank (MiB, tracemalloc peak)",
                 max(r["traced"]["oarlock"] for r in loads) / 2**20, max(r["traced"]["dcp"] for r in loads) / 2**20))
    for name, a, b in rows:
        fa = f"{a:,}" if isinstance(a, int) else f"{a:.3f}"
        fb = f"{b:,}" if isinstance(b, int) else f"{b:.3f}"
        lines.append(f"| {name} | {fa} | {fb} | {a / b:.2f} |")
    streamed = [(f"load {hi} -> {nl} ranks, slowest rank (s)", slowest(loads, "oarlock-streamed"),
                 slowest(loads, "oarlock")),
                (f"load {hi} -> {nl}: Python memory of the load, largest rank (MiB)",
                 max(r["traced"]["oarlock-streamed"] for r in loads) / 2**20,
                 max(r["traced"]["oarlock"] for r in loads) / 2**20)]
    lines += ["", "The path of loads of millions of read items (`executor.STREAM_MIN_ITEMS` and more: the planner's "
              "templates held, each file's items made when it is checked and when it is read), forced on this load, "
              "against the listed path it takes by default:", "",
              "| | oarlock streamed | oarlock listed | streamed / listed |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {a:.3f} | {b:.3f} | {a / b:.2f} |" for name, a, b in streamed]
    text = "\n".join(lines)
    print(text)
    if args.append_results and not args.smoke:
        from _results import write_section  # benchmarks/_results.py: this script's own section

        write_section(__file__, "scale_ranks: many ranks, many small shards (issue 26)", "\n" + text + "\n")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
