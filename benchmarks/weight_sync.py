"""RL weight sync: a trainer's FSDP2 weights pushed into an inference engine's TP layout, in memory, side by side.

Workload (``--model``): ``dense``, a Llama-shaped model (fp32; ``--layers`` decoder layers of hidden 2048,
intermediate 5504, q/k/v/o, gate/up/down, two norms; about 202 MiB a layer, 1 GiB at the default 5 layers), or
``moe``, a Mixtral-shaped one (hidden 2048, q/k/v/o, a router [8, 2048], 8 experts of intermediate 1408 stacked as
gate/up [8, 1408, 2048] and down [8, 2048, 1408], two norms; about 340 MiB a layer). On gloo ranks (CPU):

* ``disagg``: trainer FSDP2 (``Shard(0)``) on ranks 0-1 -> engine TP2 on ranks 2-3 (q/k/v/gate/up split along
  their output rows, o/down along their input columns, norms and the router replicated; 4 ranks);
* ``coloc``: FSDP2 over the 4 ranks -> TP4 over the same 4 ranks;
* ``two-engines`` (6 ranks): the trainer of ``disagg`` on ranks 0-1 feeding, in one ``WeightSync.run()``, two
  engines that each want the whole model in their own TP2 layout (ranks 2-3 and ranks 4-5; the targets of one
  sync are DTensors on either engine's mesh, so one plan serves both), against the one-engine round (ranks 4-5
  want nothing) in the same 6-rank world; compared as seconds per GiB delivered into engine ranks.

Methods (``disagg`` and ``coloc``), each timed between barriers on every rank, the slowest rank's time per
repetition; each repetition runs every method once, in an order rotated by one from the repetition before (after
one untimed warm-up of each method):

A. ``gather+bcast``: every tensor gathered whole on trainer rank 0 (``dist.gather`` of the shards), broadcast
   whole to the engine ranks, each engine rank copying out its slice (the rank-0 funnel);
B. ``full_tensor+bcast``: per tensor ``DTensor.full_tensor()`` on the trainer ranks, broadcast from trainer rank
   0 to the engine ranks (colocated: each rank slices its own full tensor);
C. files, both fsyncing every file they write (oarlock always; DCP's ``FileSystemWriter(sync_files=True)``
   default): ``oarlock files`` = ``save_state_dict`` + ``load_state_dict`` with its default
   ``verify_checksums=True`` (every block read is hashed against the checksums written at save);
   ``oarlock files, unverified`` = the same with ``verify_checksums=False``, the settings of ``dcp files``
   (``dcp.save`` + ``dcp.load``, nothing verified). The timed region is the save, the load and the closing
   barrier; removing the checkpoint directory comes after the clock stops (for every method, clean-up is
   untimed);
D. ``reshard_state_dict`` (plans every call) and ``WeightSync.run()`` (replayed plan);
E. ``floor``: one ``batch_isend_irecv`` per (sender, receiver) pair of exactly the bytes the receiver needs from
   that sender, packed before the clock starts, and one copy of the bytes a rank needs from itself (colocated);
   ``floor + strided gathers`` adds the copies that column-split weights force on any sender (each o/down shard's
   rows gathered per receiver's column block).

Columns: seconds (median over repetitions of the slowest rank, with min-max), ratio to WeightSync and to the floor,
**MiB moved into each engine rank** (max over engine ranks; what the method really delivers, not the target size:
A and B broadcast whole tensors to every engine rank, a gather or ``full_tensor`` also lands (n-1)/n of every tensor
on each gathering rank; the file routes count the bytes the rank read from files (``/proc/self/io`` ``rchar``,
which gloo's socket traffic does not enter, plus for oarlock the blocks its verification hashed through memory
maps, ``LoadReport.bytes_hashed``); D counts ``ReshardReport.bytes_received - bytes_local``; E its receive
buffers), point-to-point/collective messages per engine rank, peak RSS above the rank's RSS at the method's start
(sampled every 2 ms; max over ranks). After every timed call of every method, each engine rank's targets are
compared bit for bit with the dense reference slices (untimed); a mismatch is printed (``MISMATCH: ...``) and the
script exits 1.

``--runs N`` repeats the whole measurement in N fresh sets of processes; the summary then gives, per method, the
median over runs of each run's median with the min-max over runs, and the ratios of those medians (with the
min-max of the per-run ratios). The load average is printed at the start and end of every run.

Usage: python benchmarks/weight_sync.py [--model dense|moe] [--layers N] [--reps N] [--runs N]
       [--only disagg|coloc|two-engines] [--methods SUBSTR,...] [--json OUT] [--smoke]
(``--smoke``: one small layer of hidden 256, one repetition, every config: checks the script runs and its checks
hold; its figures mean nothing.)
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

H, I = 2048, 5504
E_MOE, I_MOE = 8, 1408
COL = ("o_proj", "down_proj")
CONFIGS = {
    # name: (world size, trainer ranks, engine groups)
    "disagg": (4, [0, 1], [[2, 3]]),
    "coloc": (4, [0, 1, 2, 3], [[0, 1, 2, 3]]),
    "two-engines": (6, [0, 1], [[2, 3], [4, 5]]),
}


def model_shapes(layers: int, small: bool = False, model: str = "dense") -> dict[str, tuple[int, ...]]:
    """Global shapes of the model's tensors; ``small``: hidden 256 (the smoke run)."""
    out: dict[str, tuple[int, ...]] = {}
    if model == "moe":
        h, e, inter = (256, 4, 176) if small else (H, E_MOE, I_MOE)
    else:
        h, inter = (256, 688) if small else (H, I)
    for i in range(layers):
        p = f"layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[p + f"self_attn.{n}.weight"] = (h, h)
        if model == "moe":
            out[p + "mlp.router.weight"] = (e, h)
            out[p + "mlp.experts.gate_proj"] = (e, inter, h)
            out[p + "mlp.experts.up_proj"] = (e, inter, h)
            out[p + "mlp.experts.down_proj"] = (e, h, inter)
        else:
            out[p + "mlp.gate_proj.weight"] = (inter, h)
            out[p + "mlp.up_proj.weight"] = (inter, h)
            out[p + "mlp.down_proj.weight"] = (h, inter)
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
    return out


def engine_dim(key: str, shape: tuple[int, ...]) -> int | None:
    """The dimension an engine's TP splits ``key`` along (None: replicated). Output rows for q/k/v/gate/up, input
    columns for o/down (the last dimension), nothing for norms and the router; stacked experts keep their expert
    dimension whole."""
    if len(shape) == 1 or ".router." in key:
        return None
    if any(f".{c}" in key for c in COL):
        return len(shape) - 1
    return len(shape) - 2


def tp_placement(key: str, shape: tuple[int, ...]):
    from torch.distributed.tensor import Replicate, Shard

    d = engine_dim(key, shape)
    return [Replicate()] if d is None else [Shard(d)]


class RssPeak:
    """Peak resident set size above the value at start, sampled every 2 ms in a thread (bytes)."""

    def __init__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def __enter__(self):
        self.base = self.peak = self._rss()
        self.stop = False

        def run():
            while not self.stop:
                self.peak = max(self.peak, self._rss())
                time.sleep(0.002)

        self.t = threading.Thread(target=run, daemon=True)
        self.t.start()
        return self

    def __exit__(self, *exc):
        self.stop = True
        self.t.join()
        self.peak = max(self.peak, self._rss())

    @property
    def above(self) -> int:
        return self.peak - self.base


def rchar() -> int:
    """Bytes this process has read through read-family system calls (files and pipes; not gloo's sockets)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def rotated(items: list, r: int) -> list:
    """``items`` rotated left by ``r`` (modulo their number): repetition ``r``'s order."""
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


def rank_main(rank: int, world: int, port: int, config: str, layers: int, reps: int, out: str,
              methods_only: str | None, small: bool, model: str, corrupt: bool) -> None:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ["OARLOCK_PROGRESS"] = "0"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        rows, mismatches = _run_config(rank, world, config, layers, reps, methods_only, small, model, corrupt)
        got = [None] * world
        dist.all_gather_object(got, mismatches)
        if rank == 0:
            Path(out).write_text(json.dumps({"rows": rows, "mismatches": [m for g in got for m in g]}))
    finally:
        dist.destroy_process_group()


def _run_config(rank, world, config, layers, reps, methods_only, small, model, corrupt):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from oarlock.checkpoint import WeightSync, load_state_dict, reshard_state_dict, save_state_dict

    _, trainer_ranks, groups = CONFIGS[config]
    shapes = model_shapes(layers, small, model)
    tmesh = DeviceMesh("cpu", trainer_ranks)
    emeshes = [DeviceMesh("cpu", g) for g in groups]
    my_group = next((i for i, g in enumerate(groups) if rank in g), None)
    engine_ranks = groups[0]  # A and B (disagg, coloc): one engine
    emesh = emeshes[my_group] if my_group is not None else None
    in_t, in_e = rank in trainer_ranks, my_group is not None
    sources: dict = {}
    want: dict = {}
    for j, (k, s) in enumerate(shapes.items()):
        g = torch.Generator().manual_seed(j)
        whole = torch.randn(s, generator=g)
        if in_t:
            # each trainer rank keeps only its own shard (the dense tensor is dropped)
            sources[k] = DTensor.from_local(whole[_box(s, [Shard(0)], tmesh)].clone(), tmesh, [Shard(0)],
                                            shape=torch.Size(s), stride=torch.empty(s).stride())
        if in_e:
            want[k] = whole[_box(s, tp_placement(k, s), emesh)].clone()
        del whole

    def new_targets(active: bool) -> dict:
        if not (in_e and active):
            return {}
        return {k: DTensor.from_local(torch.zeros(want[k].shape), emesh, tp_placement(k, s), shape=torch.Size(s),
                                      stride=torch.empty(s).stride()) for k, s in shapes.items()}

    mismatches: list[str] = []

    def check(targets: dict, name: str, rep: int) -> None:
        if corrupt and rank == engine_ranks[0] and name == "D WeightSync.run" and rep == 0 and targets:
            t = next(iter(targets.values())).to_local()
            t.view(-1)[:1].view(torch.int32).bitwise_xor_(1)  # the hidden self-test: one bit flipped
        for k, v in targets.items():
            loc = v.to_local()
            if not torch.equal(loc, want[k]):
                bad = (loc != want[k]).nonzero()
                mismatches.append(f"{config} {name}, repetition {rep}, rank {rank}: key {k!r} differs from the "
                                  f"reference in {len(bad)} element(s), first at local index {bad[0].tolist()}")

    tgroup = dist.new_group(trainer_ranks)
    bgroup = dist.new_group(sorted({trainer_ranks[0], *engine_ranks}))
    tmp = Path(tempfile.mkdtemp(prefix="oarlock-ws-")) if rank == 0 else None
    root = Path(dist_broadcast_str(str(tmp) if tmp else "", dist))
    full_bytes = {k: torch.Size(s).numel() * 4 for k, s in shapes.items()}
    in_b = rank == trainer_ranks[0] or rank in engine_ranks

    # Each method returns (messages received, bytes moved into this rank from other ranks or from files).
    def m_gather(targets):
        msgs = moved = 0
        for k, s in shapes.items():
            whole = None
            if in_t:
                loc = sources[k].to_local().contiguous()
                parts = [torch.empty_like(loc) for _ in trainer_ranks] if rank == trainer_ranks[0] else None
                dist.gather(loc, parts, dst=trainer_ranks[0], group=tgroup)
                if parts is not None:
                    whole = torch.cat(parts)
                    moved += full_bytes[k] - loc.numel() * 4
                    msgs += len(trainer_ranks) - 1
            if in_b:
                buf = whole if whole is not None else torch.empty(s)
                dist.broadcast(buf, src=trainer_ranks[0], group=bgroup)
                if rank != trainer_ranks[0]:
                    moved += full_bytes[k]
                    msgs += 1
                if rank in engine_ranks:
                    targets[k].to_local().copy_(buf[_box(s, tp_placement(k, s), emesh)])
        return msgs, moved

    def m_full_tensor(targets):
        msgs = moved = 0
        for k, s in shapes.items():
            whole = None
            if in_t:
                whole = sources[k].full_tensor()
                moved += full_bytes[k] - sources[k].to_local().numel() * 4
                msgs += 1
            if config == "disagg" and in_b:
                buf = whole if whole is not None else torch.empty(s)
                dist.broadcast(buf, src=trainer_ranks[0], group=bgroup)
                if rank != trainer_ranks[0]:
                    moved += full_bytes[k]
                    msgs += 1
                whole = buf
            if rank in engine_ranks:
                targets[k].to_local().copy_(whole[_box(s, tp_placement(k, s), emesh)])
        return msgs, moved

    def files(verify: bool):
        def m_oarlock_files(targets):
            d = root / "oarlock"
            r0 = rchar()
            save_state_dict(sources, d)
            rep = load_state_dict(targets, d, strict=False, verify_checksums=verify)
            # read syscalls, plus the blocks the verification hashed through memory maps (not in rchar)
            return 0, rchar() - r0 + rep.bytes_hashed
        return m_oarlock_files

    def m_dcp(targets):
        d = root / "dcp"
        r0 = rchar()
        dcp.save(sources, checkpoint_id=str(d))
        dcp.load(targets, checkpoint_id=str(d))
        return 0, rchar() - r0

    def rm(name):
        def clean():
            if rank == 0:
                shutil.rmtree(root / name, ignore_errors=True)
        return clean

    def m_reshard(targets):
        rep = reshard_state_dict(sources, targets)
        return rep.messages_received, rep.bytes_received - rep.bytes_local

    syncs: dict = {}

    def sync_method(key: str):
        def m_sync(targets):
            sync = syncs.get(key)
            if sync is None or sync.targets is not targets:
                sync = syncs[key] = WeightSync(sources, targets)
                sync.run()  # the first run plans; the timed runs replay
            rep = sync.run()
            assert rep.plan_reused
            syncs[key + ":plan_share"] = rep.plan_seconds / max(rep.seconds, 1e-9)
            return rep.messages_received, rep.bytes_received - rep.bytes_local
        return m_sync

    def floor_method(need: dict, strided: bool):
        # the floor: exactly the bytes each receiver needs from each sender, packed before the clock starts
        send_bufs = [(torch.empty(n, dtype=torch.uint8), r) for (s, r), n in need.items() if s == rank and r != rank]
        recv_bufs = [(torch.empty(n, dtype=torch.uint8), s) for (s, r), n in need.items() if r == rank and s != rank]
        # the bytes a rank needs from its own sources (colocated) still cost one copy each
        self_bufs = [(torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8))
                     for (s, r), n in need.items() if s == rank and r == rank]
        n_eng = len(engine_ranks)

        def m_floor(targets):
            if strided and in_t:
                # the one copy a strided layout forces on a sender: each column-split weight's local rows gathered
                # per receiving rank's column block (what any sender of these slices must pack)
                for k, s in shapes.items():
                    d = engine_dim(k, s)
                    if d is not None and d != 0 and any(f".{c}" in k for c in COL):
                        for blk in sources[k].to_local().chunk(n_eng, dim=d):
                            blk.contiguous()
            for a, b in self_bufs:
                b.copy_(a)
            ops = [dist.P2POp(dist.isend, b, r) for b, r in send_bufs] + \
                  [dist.P2POp(dist.irecv, b, s) for b, s in recv_bufs]
            for w in dist.batch_isend_irecv(ops) if ops else ():
                w.wait()
            return len(recv_bufs), sum(b.numel() for b, _ in recv_bufs)
        return m_floor

    need_all = {}
    for g in groups:
        for key, n in _pair_bytes(shapes, trainer_ranks, g).items():
            need_all[key] = need_all.get(key, 0) + n
    need_one = _pair_bytes(shapes, trainer_ranks, groups[0])
    # (name, function, clean-up after the clock, whether its targets are checked, targets to use)
    shared = new_targets(True)
    if config == "two-engines":
        first_only = new_targets(my_group == 0)
        methods = [("D WeightSync.run, 1 engine", sync_method("one"), None, True, first_only),
                   ("D WeightSync.run, 2 engines", sync_method("two"), None, True, shared),
                   ("E floor, 1 engine", floor_method(need_one, False), None, False, first_only),
                   ("E floor, 2 engines", floor_method(need_all, False), None, False, shared)]
    else:
        methods = [("A gather+bcast", m_gather, None, True, shared),
                   ("B full_tensor+bcast", m_full_tensor, None, True, shared),
                   ("C oarlock files", files(True), rm("oarlock"), True, shared),
                   ("C oarlock files, unverified", files(False), rm("oarlock"), True, shared),
                   ("C dcp files", m_dcp, rm("dcp"), True, shared),
                   ("D reshard_state_dict", m_reshard, None, True, shared),
                   ("D WeightSync.run", sync_method("one"), None, True, shared),
                   ("E floor", floor_method(need_all, False), None, False, shared),
                   ("E floor + strided gathers", floor_method(need_all, True), None, False, shared)]
    if methods_only:
        methods = [m for m in methods if any(s.strip() in m[0] for s in methods_only.split(","))]

    def timed(fn, clean, targets):
        for v in targets.values():
            v.to_local().zero_()
        dist.barrier()
        with RssPeak() as rss:
            t0 = time.perf_counter()
            msgs, moved = fn(targets)
            dist.barrier()
            dt = time.perf_counter() - t0
        if clean is not None:  # clean-up after the clock stopped
            clean()
            dist.barrier()
        return dt, rss.above, msgs, moved

    for name, fn, clean, _, targets in methods:  # warm-up (plans, caches, first touch of the targets), untimed
        timed(fn, clean, targets)
    stats = {name: {"times": [], "peak": 0, "msgs": 0, "moved": 0} for name, *_ in methods}
    for r in range(reps):
        for name, fn, clean, checked, targets in rotated(methods, r):
            dt, peak, msgs, moved = timed(fn, clean, targets)
            st = stats[name]
            st["times"].append(dt)
            st["peak"] = max(st["peak"], peak)
            st["msgs"], st["moved"] = msgs, moved
            if checked:
                check(targets, name, r)
    plan_share = max((v for k, v in syncs.items() if k.endswith(":plan_share")), default=0.0)
    out_rows = []
    for name, fn, clean, checked, targets in methods:
        st = stats[name]
        target_bytes = sum(v.to_local().numel() * 4 for v in targets.values())
        got = [None] * world
        dist.all_gather_object(got, (st["times"], st["peak"], st["msgs"] if in_e else 0,
                                     st["moved"] if in_e else 0, target_bytes, plan_share))
        if rank == 0:
            per_rep = [max(g[0][i] for g in got) for i in range(len(st["times"]))]  # the slowest rank
            out_rows.append({"config": config, "method": name, "times": per_rep,
                             "peak_rss_above_mib": max(g[1] for g in got) / 2**20,
                             "messages_per_engine_rank": max(g[2] for g in got),
                             "moved_bytes_per_engine_rank": max(g[3] for g in got),
                             "target_bytes_per_engine_rank": max(g[4] for g in got),
                             "engine_bytes_total": sum(g[4] for g in got),
                             "checked": checked, "plan_share": max(g[5] for g in got)})
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return out_rows, mismatches


def dist_broadcast_str(s: str, dist) -> str:
    box = [s]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _box(shape, placements, mesh):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, off = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
    # computed for the calling rank's own coordinate by torch
    return tuple(slice(o, o + n) for o, n in zip(off, local))


def _pair_bytes(shapes, trainer_ranks, engine_ranks):
    """Bytes each (sender, receiver) pair must move: intersections of the trainer's Shard(0) blocks (even
    ``torch.chunk``) with each engine rank's TP box."""
    need: dict = {}
    for k, s in shapes.items():
        t_boxes = _all_boxes(s, 0, len(trainer_ranks))
        e_boxes = _all_boxes(s, engine_dim(k, s), len(engine_ranks))
        for ti, tb in enumerate(t_boxes):
            for ei, eb in enumerate(e_boxes):
                vol = 1
                for (a0, a1), (b0, b1) in zip(tb, eb):
                    vol *= max(0, min(a1, b1) - max(a0, b0))
                if vol:
                    key = (trainer_ranks[ti], engine_ranks[ei])
                    need[key] = need.get(key, 0) + vol * 4
    return need


def _all_boxes(shape, dim, n):
    if dim is None:
        return [tuple((0, d) for d in shape)] * n
    cuts = [0]
    size = -(-shape[dim] // n)
    for i in range(n):
        cuts.append(min(shape[dim], cuts[-1] + size))
    return [tuple((cuts[i], cuts[i + 1]) if d == dim else (0, shape[d]) for d in range(len(shape))) for i in range(n)]


def _load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def _spread(xs: list[float]) -> str:
    return f"{min(xs):.3f}-{max(xs):.3f}"


def print_run(config: str, rows: list[dict]) -> None:
    """One run's table: per method the median over repetitions (slowest rank) and the min-max."""
    med = {r["method"]: statistics.median(r["times"]) for r in rows}
    ws = med.get("D WeightSync.run", float("nan"))
    fl = med.get("E floor", float("nan"))
    if config == "two-engines":
        _print_two_engines(rows)
        return
    print(f"\n{config}: | method | seconds (median) | min-max | x WeightSync | x floor | MiB moved into each engine "
          f"rank | messages / engine rank | peak RSS above (MiB) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        m = med[r["method"]]
        print(f"| {r['method']} | {m:.3f} | {_spread(r['times'])} | {m / ws:.2f} | {m / fl:.2f} | "
              f"{r['moved_bytes_per_engine_rank'] / 2**20:.1f} | {r['messages_per_engine_rank']} | "
              f"{r['peak_rss_above_mib']:.0f} |")
    print(f"target MiB per engine rank: {rows[0]['target_bytes_per_engine_rank'] / 2**20:.1f}; WeightSync replay "
          f"planning+checks share: {max(r['plan_share'] for r in rows) * 100:.1f}%")


def _print_two_engines(rows: list[dict]) -> None:
    print("\ntwo-engines: | round | seconds (median) | min-max | MiB into engine ranks | s per GiB | x 1-engine "
          "per GiB |")
    print("|---|---:|---|---:|---:|---:|")
    per = {}
    for r in rows:
        m = statistics.median(r["times"])
        gib = r["engine_bytes_total"] / 2**30
        per[r["method"]] = m / gib
        base = per.get(r["method"].replace("2 engines", "1 engine"), m / gib)
        print(f"| {r['method']} | {m:.3f} | {_spread(r['times'])} | {gib * 1024:.1f} | {m / gib:.3f} | "
              f"{(m / gib) / base:.2f} |")


def summarize(runs: list[dict[str, list[dict]]]) -> list[str]:
    """Across whole runs: per method the median of the runs' medians with the min-max over runs, and the ratios
    to WeightSync and to the floor (ratio of medians; min-max of the per-run ratios)."""
    lines = []
    for config in CONFIGS:
        per_run = [r[config] for r in runs if config in r]
        if not per_run:
            continue
        names = [row["method"] for row in per_run[0]]
        meds = {n: [statistics.median(next(x for x in rr if x["method"] == n)["times"]) for rr in per_run]
                for n in names}
        lines.append(f"\n{config}, {len(per_run)} runs: | method | median of run medians (s) | min-max over runs | "
                     "x WeightSync (min-max) | x floor (min-max) |")
        lines.append("|---|---:|---|---|---|")
        ref = "D WeightSync.run" if config != "two-engines" else "D WeightSync.run, 1 engine"
        flo = "E floor" if config != "two-engines" else "E floor, 1 engine"
        for n in names:
            def ratio(other):
                if other not in meds:
                    return "n/a"
                each = [a / b for a, b in zip(meds[n], meds[other])]
                return (f"{statistics.median(meds[n]) / statistics.median(meds[other]):.2f} "
                        f"({min(each):.2f}-{max(each):.2f})")
            lines.append(f"| {n} | {statistics.median(meds[n]):.3f} | {_spread(meds[n])} | {ratio(ref)} | "
                         f"{ratio(flo)} |")
        if config == "two-engines":
            nbytes = {row["method"]: row["engine_bytes_total"] for row in per_run[0]}
            for n in names:
                one = n.replace("2 engines", "1 engine")
                if n == one or one not in meds:
                    continue
                each = [(a / nbytes[n]) / (b / nbytes[one]) for a, b in zip(meds[n], meds[one])]
                med = (statistics.median(meds[n]) / nbytes[n]) / (statistics.median(meds[one]) / nbytes[one])
                lines.append(f"{n}: seconds per engine byte x the 1-engine round's = {med:.2f} "
                             f"(per run {min(each):.2f}-{max(each):.2f})")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("dense", "moe"), default="dense")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: 5 dense, 3 moe)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--runs", type=int, default=1, help="whole-process repetitions (fresh ranks each); summary "
                    "over runs")
    ap.add_argument("--only", choices=tuple(CONFIGS), action="append",
                    help="run only this config (repeatable; default: disagg and coloc, plus two-engines)")
    ap.add_argument("--json")
    ap.add_argument("--methods", help="comma-separated substrings of method names to run (default: all)")
    ap.add_argument("--smoke", action="store_true", help="one layer of hidden 256, one repetition: checks the "
                    "script runs")
    ap.add_argument("--self-test-corrupt", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.layers is None:
        a.layers = 3 if a.model == "moe" else 5
    if a.smoke:
        a.layers, a.reps = 1, 1
    import torch.multiprocessing as mp

    configs = a.only or list(CONFIGS)
    total = sum(torch.Size(s).numel() * 4 for s in model_shapes(a.layers, a.smoke, a.model).values())
    print(f"model: {a.model}, {a.layers} layers, {total / 2**30:.2f} GiB fp32; {a.reps} repetitions, {a.runs} "
          f"run(s); load average at the start: {_load()}", flush=True)
    runs: list[dict[str, list[dict]]] = []
    mismatches: list[str] = []
    for run in range(a.runs):
        this: dict[str, list[dict]] = {}
        for config in configs:
            world = CONFIGS[config][0]
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            fd, out = tempfile.mkstemp(suffix=".json")
            os.close(fd)
            mp.spawn(rank_main, args=(world, port, config, a.layers, a.reps, out, a.methods, a.smoke, a.model,
                                      a.self_test_corrupt), nprocs=world)
            res = json.loads(Path(out).read_text())
            os.unlink(out)
            this[config] = res["rows"]
            mismatches += res["mismatches"]
            print(f"\nrun {run + 1}/{a.runs}, {config}: load average {_load()}", flush=True)
            print_run(config, res["rows"])
        runs.append(this)
    if a.runs > 1:
        print("\n".join(summarize(runs)))
    for m in mismatches:
        print(f"MISMATCH: {m}", file=sys.stderr)
    ok = not mismatches
    print(f"\nEvery checked method's targets equal, bit for bit, to the reference slices after every repetition: "
          f"{ok}")
    print(f"load average at the end: {_load()}")
    if a.json:
        Path(a.json).write_text(json.dumps(runs, indent=1))
    if not ok:
        print("the correctness check FAILED", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
