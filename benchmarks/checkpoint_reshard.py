"""oarlock FlexCheckpoint vs torch.distributed.checkpoint (DCP): save, same-layout load, reshard load.

Workload (shared/design/environment.md): 1 GiB fp32 = 32 tensors of 4096x2048 on 4 CPU ranks (gloo), saved from
a 2x2 mesh [Shard(0), Shard(1)] and loaded as [Shard(0), Shard(1)] (same layout) and as [Shard(1), Replicate()]
(reshard). Loads run with a cold page cache (``sync; echo 3 > /proc/sys/vm/drop_caches``, needs root; skipped
with a note otherwise) and hot. Every row is timed between barriers (slowest rank) in the same run for both
libraries; the table reports oarlock / DCP ratios. Peak RSS per rank is sampled every millisecond during each
load; "above targets" is the peak minus the RSS after the target tensors were allocated and zeroed.

Then the planner: 100,000 saved shards planned against 256 simulated ranks (pure planning, no files), with
DCP's own planning function (``create_read_items_for_chunk_list``) on the same chunks as the anchor.

Checksum verification (on by default in oarlock loads) is measured in the same run: every oarlock load is also
timed with ``verify_checksums=False`` ("oarlock-noverify"), and a second table gives verify / no-verify per load.
Below it, the floor of that overhead on this machine: one thread reading rank 0's data file from a hot page cache
against hashing all its blocks (a load verifies every block before it writes a byte of a target, so with the CPU
as the limit verification adds at least hash time / read time).
The saves are compared with a floor in the same run: each rank's bytes written plainly into one file and fsynced,
with and without early writeback (``sync_file_range``); the save order rotates between repetitions and each save
replaces the previous one of its library, so all write into freed space (see the comment in ``rank_main``).
The machine's load average is printed beside the tables.

Usage: python benchmarks/checkpoint_reshard.py [--dir DIR] [--reps N] [--save-reps N] [--quick] [--append-results]
(``--quick``: 4 small tensors, one repetition, no planner benchmark: checks that the script works, times nothing
worth reporting.)
"""

from __future__ import annotations

import argparse
import gc
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

N_TENSORS, ROWS, COLS = 32, 4096, 2048
QUICK_SIZES = (4, 512, 256)
LIBS = ("dcp", "oarlock", "oarlock-noverify")  # the last: oarlock with verify_checksums=False


def _find_sync_file_range():
    """libc's ``sync_file_range`` through ctypes (Linux), else None: the floor's early writeback (the standard
    library has no binding for it)."""
    try:
        import ctypes
        import ctypes.util

        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).sync_file_range
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        return fn
    except (OSError, AttributeError):
        return None


_libc_sync_file_range = _find_sync_file_range()


# ---------------------------------------------------------------- memory sampling

class PeakRSS:
    """This process's peak resident set size (bytes) over a ``with`` block: Linux's high-water mark (``VmHWM``),
    reset on entry by writing ``5`` to ``/proc/self/clear_refs``, so nothing runs beside the timed work. Where that
    reset is not allowed, a thread samples ``/proc/self/statm`` every millisecond instead (it takes the GIL 1,000
    times a second, which slows multi-threaded loads measurably on 2 cores)."""

    def __init__(self):
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.peak = 0
        self._stop = threading.Event()
        self._t = None

    def now(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    @staticmethod
    def _hwm() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise OSError("no VmHWM")

    def __enter__(self):
        self.peak = self.now()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._hwm()
        except OSError:
            self._t = threading.Thread(target=self._run, daemon=True)
            self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.001)

    def __exit__(self, *exc):
        if self._t is not None:
            self._stop.set()
            self._t.join()
        else:
            self.peak = max(self.peak, self._hwm())
        self.peak = max(self.peak, self.now())


# ---------------------------------------------------------------- rank body

def _drop_caches(rank: int) -> bool:
    import torch.distributed as dist

    ok = True
    if rank == 0:
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        except OSError:
            ok = False
    flag = [ok]
    dist.broadcast_object_list(flag, src=0)
    return flag[0]


def rank_main(rank: int, world: int, port: int, root: str, reps: int, quick: bool = False, save_reps: int = 8) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from oarlock.checkpoint import load_state_dict, save_state_dict

    global N_TENSORS, ROWS, COLS
    if quick:
        N_TENSORS, ROWS, COLS = QUICK_SIZES
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    root = Path(root)
    mesh = init_device_mesh("cpu", (2, 2))
    src_pl, dst_pl = [Shard(0), Shard(1)], [Shard(1), Replicate()]
    res: dict = {"rank": rank, "rows": {}, "rss": {}}

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    g = torch.Generator().manual_seed(rank)
    src = {f"layers.{i}.weight": DTensor.from_local(torch.randn(ROWS // 2, COLS // 2, generator=g), mesh, src_pl,
                                                    shape=torch.Size((ROWS, COLS)), stride=(COLS, 1))
           for i in range(N_TENSORS)}
    def raw_save(d: Path, early_writeback: bool) -> None:
        """A floor of any save with the same durability: this rank's tensor bytes written into one file with
        plain writes and fsynced (no format, no metadata, no checksums, no coordination); ``early_writeback``
        also asks the kernel to start writing each tensor's bytes to disk right after they are written (Linux
        ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, called here through libc directly), so the final fsync has
        less left: which of the two is faster depends on the disk, and the floor is the faster."""
        d.mkdir(exist_ok=True)
        with open(d / f"rank{rank}.bin", "wb", buffering=0) as f:
            pos = 0
            for v in src.values():
                mv = memoryview(v.to_local().numpy()).cast("B")
                f.write(mv)
                if early_writeback and _libc_sync_file_range is not None:
                    _libc_sync_file_range(f.fileno(), pos, len(mv), 2)
                pos += len(mv)
            os.fsync(f.fileno())

    # ---- saves: the order of the libraries rotates from one repetition to the next, and each library's previous
    # save is deleted (untimed) before its next, so every save writes into space a save just freed: on a thin
    # provisioned virtual disk, writing never-used blocks is several times slower than rewriting freed ones, and
    # without this the library that happened to write first, or into fresh space, paid for it
    save_libs = ["dcp", "oarlock", "raw", "raw-writeback"]
    for r in range(save_reps):
        for lib in save_libs[r % len(save_libs):] + save_libs[:r % len(save_libs)]:
            d = root / f"{lib}_save"
            dist.barrier()
            if rank == 0 and d.exists():
                shutil.rmtree(d)
            if lib == "dcp":
                t = timed(lambda: dcp.save(src, checkpoint_id=str(d)))
            elif lib.startswith("raw"):
                t = timed(lambda: raw_save(d, lib == "raw-writeback"))
            else:
                t = timed(lambda: save_state_dict(src, d))
            res["rows"].setdefault(("save", lib), []).append(t)
    del src
    gc.collect()
    ckpt = {"dcp": root / "dcp_save", "oarlock": root / "oarlock_save"}
    if rank == 0:  # the loads below verify what this save recorded
        assert "checksums" in json.loads((ckpt["oarlock"] / "metadata.json").read_text())["extra"]

    def targets(pl):
        return {f"layers.{i}.weight": DTensor.from_local(torch.zeros(*_local_shape(pl, mesh)), mesh, pl,
                                                         shape=torch.Size((ROWS, COLS)), stride=(COLS, 1))
                for i in range(N_TENSORS)}

    cold_ok = True
    for layout, pl in (("same-layout load", src_pl), ("reshard load", dst_pl)):
        for lib in LIBS:
            for temp in ("cold", "hot"):
                for r in range(reps):
                    gc.collect()
                    base0 = PeakRSS().now()
                    tgt = targets(pl)
                    if temp == "cold":
                        cold_ok = _drop_caches(rank) and cold_ok
                    with PeakRSS() as rss:
                        base = rss.now()
                        if lib == "dcp":
                            t = timed(lambda: dcp.load(tgt, checkpoint_id=str(ckpt[lib])))
                        else:
                            t = timed(lambda: load_state_dict(tgt, ckpt["oarlock"],
                                                              verify_checksums=lib == "oarlock"))
                    res["rows"].setdefault((f"{layout} ({temp})", lib), []).append(t)
                    tb = sum(v.to_local().numel() * 4 for v in tgt.values())
                    res["rss"].setdefault((f"{layout} ({temp})", lib), []).append(
                        {"peak": rss.peak - base0, "above_targets": rss.peak - base, "target_bytes": tb})
                    if r == 0 and temp == "hot":  # correctness: every tensor equals the saved data in both
                        res.setdefault("checksums", {})[(layout, lib)] = float(
                            sum(v.to_local().double().sum() for v in tgt.values()))
                    del tgt
    res["cold_ok"] = cold_ok
    res["rows"] = {f"{k[0]}|{k[1]}": v for k, v in res["rows"].items()}
    res["rss"] = {f"{k[0]}|{k[1]}": v for k, v in res["rss"].items()}
    res["checksums"] = {f"{k[0]}|{k[1]}": v for k, v in res.get("checksums", {}).items()}
    (root / f"result-{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def _local_shape(pl, mesh):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset((ROWS, COLS), mesh, pl)[0]


# ---------------------------------------------------------------- planner benchmark

def planner_benchmark() -> list[tuple[str, float, float, str]]:
    """(case, oarlock seconds, DCP seconds, note) for 100,000 saved shards x 256 simulated ranks."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    from oarlock.checkpoint import ShardDesc, plan_load
    from oarlock.checkpoint.metadata import CheckpointMetadata, ShardMeta, TensorMeta

    rows = []
    # (a) one key, 100,000 row shards (e.g. a huge embedding saved by 100k writers) -> 256 row blocks
    n = 100_000
    meta = CheckpointMetadata("oarlock")
    meta.tensors["emb"] = TensorMeta("emb", (n, 64), "float32",
                                     [ShardMeta((i, 0), (1, 64), f"rank-{i % 1024:05d}.safetensors", "emb")
                                      for i in range(n)])
    blk = n // 256
    reqs = {r: [ShardDesc("emb", (blk if r < 255 else n - 255 * blk, 64), (n, 64), (r * blk, 0), "float32")]
            for r in range(256)}
    t0 = time.perf_counter()
    plans = plan_load(meta, reqs)
    t_oar = time.perf_counter() - t0
    assert sum(len(p.items) for p in plans.values()) == n
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size((n, 64)),
                               [ChunkStorageMetadata(torch.Size((i, 0)), torch.Size((1, 64))) for i in range(n)])
    t0 = time.perf_counter()
    for r in range(256):
        q = reqs[r][0]
        create_read_items_for_chunk_list("emb", md, [ChunkStorageMetadata(torch.Size(q.global_offset),
                                                                          torch.Size(q.local_shape))])
    t_dcp = time.perf_counter() - t0
    rows.append(("1 key x 100,000 row shards -> 256 ranks", t_oar, t_dcp, "all 256 ranks planned in one process"))

    # (b) 400 keys saved on a 25x10 grid (100,000 shards) -> every rank one box of a 16x16 grid of every key
    keys = 400
    meta = CheckpointMetadata("oarlock")
    mds = {}
    for k in range(keys):
        key = f"layers.{k}.w"
        t = TensorMeta(key, (2500, 1000), "float32")
        chunks = []
        for i in range(25):
            for j in range(10):
                t.shards.append(ShardMeta((i * 100, j * 100), (100, 100), f"rank-{(i * 10 + j):05d}.safetensors", key))
                chunks.append(ChunkStorageMetadata(torch.Size((i * 100, j * 100)), torch.Size((100, 100))))
        meta.tensors[key] = t
        mds[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size((2500, 1000)), chunks)

    def box(r):
        i, j = divmod(r, 16)
        r0, r1 = i * 2500 // 16, (i + 1) * 2500 // 16
        c0, c1 = j * 1000 // 16, (j + 1) * 1000 // 16
        return (r0, c0), (r1 - r0, c1 - c0)

    reqs = {r: [ShardDesc(f"layers.{k}.w", box(r)[1], (2500, 1000), box(r)[0], "float32") for k in range(keys)]
            for r in range(256)}
    t0 = time.perf_counter()
    plans = plan_load(meta, reqs)
    t_oar = time.perf_counter() - t0
    t0 = time.perf_counter()
    dcp_items = 0
    for r in range(256):
        off, shp = box(r)
        ch = [ChunkStorageMetadata(torch.Size(off), torch.Size(shp))]
        for k in range(keys):
            dcp_items += len(create_read_items_for_chunk_list(f"layers.{k}.w", mds[f"layers.{k}.w"], ch))
    t_dcp = time.perf_counter() - t0
    assert sum(len(p.items) for p in plans.values()) == dcp_items
    rows.append(("400 keys x 250 grid shards (100,000) -> 256 ranks", t_oar, t_dcp, f"{dcp_items} read items"))
    return rows


# ---------------------------------------------------------------- verification floor

def verification_floor(ckpt: Path, reps: int = 5) -> tuple[float, float, int]:
    """One thread, hot page cache, rank 0's data file: the best time to read it whole into memory
    (``os.preadv``, what a load does) and to hash all its blocks as load verification does
    (``file_checksums``: XXH3 through mapped blocks). ``hash / read`` is the least any verify-before-write
    scheme can add per byte in one thread, when the CPU is the limit. Returns (read s, hash s, bytes)."""
    from oarlock.checkpoint.integrity import file_checksums

    f = sorted(ckpt.glob("*.safetensors"))[0]
    size = f.stat().st_size
    buf = torch.empty(size, dtype=torch.uint8)
    buf.zero_()
    mv = memoryview(buf.numpy())
    fd = os.open(f, os.O_RDONLY)
    try:
        read_s = hash_s = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            os.preadv(fd, [mv], 0)
            read_s = min(read_s, time.perf_counter() - t0)
            t0 = time.perf_counter()
            file_checksums(f)
            hash_s = min(hash_s, time.perf_counter() - t0)
    finally:
        os.close(fd)
    return read_s, hash_s, size


# ---------------------------------------------------------------- driver

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one, removed)")
    ap.add_argument("--reps", type=int, default=2, help="repetitions of every row (the best counts)")
    ap.add_argument("--save-reps", type=int, default=8, help="repetitions of the saves (cheap, and the disk is noisy: "
                    "the best and the median are reported)")
    ap.add_argument("--append-results", action="store_true", help="append the tables to benchmarks/RESULTS.md")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repetition, no planner benchmark: only "
                                                         "checks that the script runs")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps = args.save_reps = 1
    import torch.multiprocessing as mp

    scratch = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="oarlock-bench-"))
    scratch.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(rank_main, args=(4, port, str(scratch), args.reps, args.quick, args.save_reps), nprocs=4,
                           start_method="spawn")
        results = [json.loads((scratch / f"result-{r}.json").read_text()) for r in range(4)]
        floor = verification_floor(scratch / "oarlock_save")
    finally:
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)
    cold_ok = all(r["cold_ok"] for r in results)
    lines = ["| operation | oarlock s | DCP s | oarlock / DCP |", "|---|---:|---:|---:|"]
    # rows of "oarlock-noverify" are reported in their own table
    ops = []
    for k in results[0]["rows"]:
        op = k.split("|")[0]
        if op not in ops and "|raw" not in k:
            ops.append(op)
    for op in ops:
        o = min(results[0]["rows"][f"{op}|oarlock"])
        d = min(results[0]["rows"][f"{op}|dcp"])
        lines.append(f"| {op}{'' if cold_ok or 'cold' not in op else ' (cache NOT dropped: not root)'} | "
                     f"{o:.3f} | {d:.3f} | {o / d:.2f} |")
    saves = {lib: results[0]["rows"][f"save|{lib}"] for lib in ("dcp", "oarlock", "raw", "raw-writeback")}
    best = {lib: min(v) for lib, v in saves.items()}
    med = {lib: statistics.median(v) for lib, v in saves.items()}
    floor_lib = min(("raw", "raw-writeback"), key=lambda lib: best[lib])
    lines += ["", f"Saves, all {args.save_reps} repetitions (the order rotates; each save replaces that library's "
              "previous one, so every save writes into freed space):", "",
              "| save | best s | median s | DCP / it (best) | DCP / it (median) | every repetition, s |",
              "|---|---:|---:|---:|---:|---|"]
    for lib, label in (("dcp", "DCP"), ("oarlock", "oarlock"), ("raw", "floor: plain writes, fsync"),
                       ("raw-writeback", "floor: writes with early writeback, fsync")):
        lines.append(f"| {label} | {best[lib]:.3f} | {med[lib]:.3f} | {best['dcp'] / best[lib]:.2f} | "
                     f"{med['dcp'] / med[lib]:.2f} | {' '.join(f'{x:.2f}' for x in saves[lib])} |")
    lines += ["", f"Save floor (the faster raw variant, best): {best[floor_lib]:.3f} s. DCP / floor = "
              f"{best['dcp'] / best[floor_lib]:.2f}: a save as durable as DCP's (every byte fsynced) can be faster "
              f"than DCP by about that much here, no more; oarlock / floor = {best['oarlock'] / best[floor_lib]:.2f}."]
    ver = ["| load | oarlock (verify) s | oarlock (no verify) s | verify / no verify |", "|---|---:|---:|---:|"]
    for op in ops:
        if "load" in op:
            o = min(results[0]["rows"][f"{op}|oarlock"])
            n = min(results[0]["rows"][f"{op}|oarlock-noverify"])
            ver.append(f"| {op} | {o:.3f} | {n:.3f} | {o / n:.2f} |")
    read_s, hash_s, fbytes = floor
    ver += ["", f"Floor, one thread, hot cache, rank 0's data file ({fbytes / 2**20:.0f} MiB): read into memory "
            f"{read_s * 1e3:.1f} ms ({fbytes / read_s / 1e9:.1f} GB/s), hash every block {hash_s * 1e3:.1f} ms "
            f"({fbytes / hash_s / 1e9:.1f} GB/s): verify-before-write adds at least {hash_s / read_s:.2f} of the "
            "read time when the CPU is the limit."]
    mem = ["| load | lib | target MiB/rank | peak RSS above targets, max over ranks (MiB) | largest slice (MiB) |",
           "|---|---|---:|---:|---:|"]
    rows_, cols_ = (QUICK_SIZES[1], QUICK_SIZES[2]) if args.quick else (ROWS, COLS)
    slice_mib = {"same-layout load": (rows_ // 2) * (cols_ // 2) * 4 / 2**20,
                 "reshard load": (rows_ // 2) * (cols_ // 2) * 4 / 2**20}
    for op in ops:
        if "load" not in op:
            continue
        for lib in ("oarlock", "oarlock-noverify", "dcp"):
            above = max(max(x["above_targets"] for x in r["rss"][f"{op}|{lib}"]) for r in results) / 2**20
            tb = results[0]["rss"][f"{op}|{lib}"][0]["target_bytes"] / 2**20
            mem.append(f"| {op} | {lib} | {tb:.0f} | {above:.1f} | {slice_mib[op.split(' (')[0]]:.0f} |")
    same = all(abs(r["checksums"][f"{layout}|oarlock"] - r["checksums"][f"{layout}|dcp"]) == 0
               for r in results for layout in ("same-layout load", "reshard load"))
    plan = []
    if not args.quick:
        plan = ["| planner case | oarlock s | DCP s | oarlock / DCP | note |", "|---|---:|---:|---:|---|"]
        for case, o, d, note in planner_benchmark():
            plan.append(f"| {case} | {o:.2f} | {d:.2f} | {o / d:.2f} | {note} |")
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    text = "\n".join([f"Load average (1/5/15 min) at the end of the run: {load} on {os.cpu_count()} cores", ""]
                     + lines + ["", f"Loaded data identical between oarlock and DCP (per-rank checksums): {same}", "",
                                "Checksum verification overhead (same run, same checkpoint):", ""] + ver + [""]
                     + mem + [""] + plan)
    print(text)
    if args.append_results:
        res = Path(__file__).resolve().parent / "RESULTS.md"
        cmd = "python benchmarks/checkpoint_reshard.py " + " ".join(argv if argv is not None else sys.argv[1:])
        with open(res, "a") as f:
            f.write(f"\n## FlexCheckpoint core: save / load / reshard vs torch.distributed.checkpoint\n\n"
                    f"Command: `{cmd.strip()}` ({time.strftime('%Y-%m-%d', time.gmtime())}, 4 gloo ranks on "
                    f"{os.cpu_count()} cores, torch {torch.__version__}; best of {args.reps} per load row, {args.save_reps} saves per library). "
                    "1 GiB fp32, 32 x [4096, 2048], saved as 2x2 mesh [Shard(0), Shard(1)]; reshard load into "
                    "[Shard(1), Replicate()].\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
