"""Distributed load data movement: shared filesystem vs node-local disks vs PaddlePaddle FlexCheckpoint.

Workload (the one of checkpoint_reshard.py): 1 GiB fp32, 32 tensors [4096, 2048] saved on 4 CPU ranks (gloo)
from a 2x2 mesh [Shard(0), Shard(1)] and loaded as [Shard(1), Replicate()] (every rank loads 512 MiB; every
stored slice is needed by two ranks). Three variants, side by side in one run:

1. shared filesystem: oarlock (``comm_method="auto"``: direct byte-range reads) vs torch.distributed.checkpoint;
2. node-local disks (ranks 0, 1 see files 0, 1; ranks 2, 3 see files 2, 3: hard-linked per-node directories):
   oarlock ``grouped_send_recv`` vs oarlock ``broadcast``; each file is read once and slices are shipped;
3. PaddlePaddle 3.3.1 FlexCheckpoint (``comm_method="broadcast"``) on the same workload, in .paddle-venv
   (scripts/paddle_env.sh), by benchmarks/_paddle_flex_load.py; skipped with a note if Paddle is unavailable.

Loads run cold (page cache dropped, needs root) and hot, timed between barriers (slowest rank), best of
``--reps``; each repetition starts with another case (the order rotates), so no library always loads first. Bytes read / sent / received per rank come from oarlock's LoadReport.

Usage: python benchmarks/checkpoint_comm.py [--dir DIR] [--reps N] [--no-paddle] [--smoke] [--append-results]
(``--smoke``: 4 tensors of [256, 128], one repetition, no Paddle, the page cache left alone: checks the script
runs; its figures mean nothing.)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_reshard import COLS, N_TENSORS, ROWS, _drop_caches  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NODE = {0: 0, 1: 0, 2: 1, 3: 1}


def rank_main(rank: int, world: int, port: int, root: str, reps: int,
              sizes: tuple[int, int, int] = (N_TENSORS, ROWS, COLS), drop: bool = True) -> None:
    """One rank: saves, then every load case cold and hot. ``sizes``: tensors, rows, columns; ``drop``: whether
    the cold rows drop the page cache (the smoke run leaves a shared machine's cache alone)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from oarlock.checkpoint import load_state_dict, save_state_dict

    warnings.filterwarnings("ignore")
    os.environ["OARLOCK_PROGRESS"] = "0"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    root = Path(root)
    mesh = init_device_mesh("cpu", (2, 2))
    src_pl, dst_pl = [Shard(0), Shard(1)], [Shard(1), Replicate()]
    g = torch.Generator().manual_seed(rank)
    n_tensors, rows, cols = sizes
    src = {f"layers.{i}.weight": DTensor.from_local(torch.randn(rows // 2, cols // 2, generator=g), mesh, src_pl,
                                                    shape=torch.Size((rows, cols)), stride=(cols, 1))
           for i in range(n_tensors)}
    save_state_dict(src, root / "oar")
    dcp.save(src, checkpoint_id=str(root / "dcp"))
    del src
    gc.collect()
    if rank == 0:
        files = sorted(p.name for p in (root / "oar").glob("rank-*.safetensors"))
        for n in (0, 1):
            d = root / f"node{n}"
            d.mkdir()
            # each node's two data files with what belongs to them (their block checksums, rank-*.safetensors.xxh3)
            for f in [g.name for f in files[2 * n:2 * n + 2] for g in (root / "oar").glob(f + "*")] + ["metadata.json"]:
                os.link(root / "oar" / f, d / f)
    dist.barrier()

    local_shape = compute_local_shape_and_global_offset((rows, cols), mesh, dst_pl)[0]

    def targets():
        return {f"layers.{i}.weight": DTensor.from_local(torch.zeros(*local_shape), mesh,
                                                         dst_pl, shape=torch.Size((rows, cols)), stride=(cols, 1))
                for i in range(n_tensors)}

    cases = [("shared FS", "oarlock direct", lambda t: load_state_dict(t, root / "oar")),
             ("shared FS", "DCP", lambda t: dcp.load(t, checkpoint_id=str(root / "dcp"))),
             ("node-local", "oarlock grouped_send_recv",
              lambda t: load_state_dict(t, root / f"node{NODE[rank]}", comm_method="grouped_send_recv")),
             ("node-local", "oarlock broadcast",
              lambda t: load_state_dict(t, root / f"node{NODE[rank]}", comm_method="broadcast"))]
    res: dict = {"rank": rank, "rows": {}, "moved": {}, "checksums": {}}
    cold_ok = True
    for r in range(reps):
        # each repetition starts with another case, so no library always loads first
        for variant, lib, fn in cases[r % len(cases):] + cases[:r % len(cases)]:
            for temp in ("cold", "hot"):
                gc.collect()
                tgt = targets()
                if temp == "cold":
                    cold_ok = drop and _drop_caches(rank) and cold_ok
                dist.barrier()
                t0 = time.perf_counter()
                rep = fn(tgt)
                dist.barrier()
                res["rows"].setdefault(f"{variant}|{lib}|{temp}", []).append(time.perf_counter() - t0)
                if rep is not None:
                    res["moved"][f"{variant}|{lib}"] = [rep.bytes_read, rep.bytes_sent, rep.bytes_received,
                                                        rep.comm_method]
                res["checksums"][f"{variant}|{lib}"] = float(sum(v.to_local().double().sum() for v in tgt.values()))
                del tgt
    res["cold_ok"] = cold_ok
    (root / f"result-{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def run_paddle(scratch: Path, reps: int) -> tuple[dict | None, str]:
    """Run the Paddle driver in .paddle-venv; returns (per-rank results of rank 0, note)."""
    py = REPO / ".paddle-venv" / "bin" / "python"
    if not py.exists():
        rc = subprocess.run(["bash", str(REPO / "scripts" / "paddle_env.sh")], capture_output=True).returncode
        if rc != 0 or not py.exists():
            return None, "PaddlePaddle not installed (scripts/paddle_env.sh failed)"
    d = scratch / "paddle"
    d.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    cmd = [str(py), "-m", "paddle.distributed.launch", "--nproc_per_node", "4", "--log_dir", str(d / "log"),
           str(REPO / "benchmarks" / "_paddle_flex_load.py"), str(d), str(reps)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if p.returncode != 0:
        tail = (p.stdout + p.stderr)[-2000:]
        return None, f"Paddle run failed (exit {p.returncode}): {tail}"
    results = [json.loads((d / f"paddle-result-{r}.json").read_text()) for r in range(4)]
    return {"cold": min(results[0]["rows"]["cold"]), "hot": min(results[0]["rows"]["hot"]),
            "cold_ok": all(r["cold_ok"] for r in results)}, "ok"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one, removed)")
    ap.add_argument("--reps", type=int, default=2, help="repetitions of every row (the best counts)")
    ap.add_argument("--no-paddle", action="store_true", help="skip the PaddlePaddle rows")
    ap.add_argument("--append-results", action="store_true", help="append the tables to benchmarks/RESULTS.md")
    ap.add_argument("--smoke", action="store_true", help="tiny tensors, one repetition, no Paddle, page cache "
                    "not dropped: checks the script runs")
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    sizes = (N_TENSORS, ROWS, COLS)
    if args.smoke:
        args.reps, args.no_paddle, args.append_results, sizes = 1, True, False, (4, 256, 128)

    scratch = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="oarlock-comm-"))
    scratch.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(rank_main, args=(4, port, str(scratch), args.reps, sizes, not args.smoke), nprocs=4,
                           start_method="spawn")
        results = [json.loads((scratch / f"result-{r}.json").read_text()) for r in range(4)]
        for d in ("oar", "dcp", "node0", "node1"):  # free the disk before Paddle writes its copy
            shutil.rmtree(scratch / d, ignore_errors=True)
        paddle, note = (None, "skipped (--no-paddle)") if args.no_paddle else run_paddle(scratch, args.reps)
    finally:
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)
    cold_ok = all(r["cold_ok"] for r in results)
    best = {k: min(v) for k, v in results[0]["rows"].items()}
    anchors = {"oarlock direct": "DCP", "oarlock grouped_send_recv": "Paddle broadcast",
               "oarlock broadcast": "Paddle broadcast"}
    rows = [("shared FS", "oarlock direct"), ("shared FS", "DCP"), ("node-local", "oarlock grouped_send_recv"),
            ("node-local", "oarlock broadcast")]
    t = {(v, lib, temp): best[f"{v}|{lib}|{temp}"] for v, lib in rows for temp in ("cold", "hot")}
    if paddle is not None:
        for temp in ("cold", "hot"):
            t[("Paddle 3.3.1", "Paddle broadcast", temp)] = paddle[temp]
    lines = ["| variant | method | cold s | hot s | anchor | speed-up vs anchor, cold | hot | "
             "MiB read / sent / received per rank (ranks 0-3) |", "|---|---|---:|---:|---|---:|---:|---|"]

    def anchor_time(lib, temp):
        a = anchors.get(lib)
        for (v2, l2, t2), x in t.items():
            if l2 == a and t2 == temp:
                return x
        return None

    total = sizes[0] * sizes[1] * sizes[2] * 4  # bytes of the checkpoint's tensors
    for (v, lib) in rows + ([("Paddle 3.3.1", "Paddle broadcast")] if paddle is not None else []):
        moved = ""
        key = f"{v}|{lib}"
        if key in results[0]["moved"]:
            moved = "; ".join("{:.0f} / {:.0f} / {:.0f}".format(*(x / 2**20 for x in r["moved"][key][:3]))
                              for r in results)
        elif lib == "DCP":
            moved = f"{total / 2 / 2**20:.0f} read by each rank (own byte ranges), 0 sent"
        elif lib == "Paddle broadcast":
            moved = f"{total / 4 / 2**20:.0f} read by each rank (whole own file), every slice broadcast to all 3 others"
        sp = []
        for temp in ("cold", "hot"):
            a = anchor_time(lib, temp)
            sp.append(f"{a / t[(v, lib, temp)]:.2f}x" if a else "")
        lines.append(f"| {v} | {lib} | {t[(v, lib, 'cold')]:.2f} | {t[(v, lib, 'hot')]:.2f} | "
                     f"{anchors.get(lib, '')} | {sp[0]} | {sp[1]} | {moved} |")
    same = all(len(set(r["checksums"].values())) == 1 for r in results)
    why = "--smoke" if args.smoke else "not root"
    notes = [f"Cold-cache rows: page cache {'dropped' if cold_ok else f'NOT dropped ({why})'} before each load.",
             f"Loaded data identical across all oarlock and DCP rows (per-rank checksums): {same}.",
             f"Paddle: {note if paddle is None else 'ran (Tensor.cuda/pin_memory patched to no-ops on CPU), '}"
             f"{'' if paddle is None else 'its loaded data checked against the generator on every rank'}."]
    text = "\n".join(lines + [""] + notes)
    print(text)
    if args.append_results:
        cmd = "python benchmarks/checkpoint_comm.py " + " ".join(argv if argv is not None else sys.argv[1:])
        from _results import write_section  # benchmarks/_results.py: this script's own section

        write_section(__file__, "FlexCheckpoint distributed loads: shared FS, node-local disks, PaddlePaddle (issue 7)", f""
                    f"Command: `{cmd.strip()}` ({time.strftime('%Y-%m-%d', time.gmtime())}, 4 gloo ranks on "
                    f"{os.cpu_count()} cores, torch {torch.__version__}; best of {args.reps} per row). 1 GiB fp32, "
                    "32 x [4096, 2048] saved as 2x2 mesh [Shard(0), Shard(1)], loaded as [Shard(1), Replicate()]. "
                    "Node-local: ranks 0-1 see files 0-1, ranks 2-3 see files 2-3.\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
