"""RL weight sync: a trainer's FSDP2 weights pushed into an inference engine's TP layout, in memory, side by side.

Workload: a Llama-shaped model (fp32; ``--layers`` decoder layers of hidden 2048, intermediate 5504, q/k/v/o,
gate/up/down, two norms; about 202 MiB a layer, 1 GiB at the default 5 layers), on 4 gloo ranks (CPU):

* ``disagg``: trainer FSDP2 (``Shard(0)``) on ranks 0-1 -> engine TP2 on ranks 2-3 (q/k/v/gate/up row-split,
  o/down column-split, norms replicated);
* ``coloc``: FSDP2 over the 4 ranks -> TP4 over the same 4 ranks.

Methods, each timed between barriers (slowest rank), median of ``--reps``:

A. ``gather+bcast``: every tensor gathered whole on trainer rank 0 (``dist.gather`` of the shards), broadcast
   whole to the engine ranks, each engine rank copying out its slice (the rank-0 funnel);
B. ``full_tensor+bcast``: per tensor ``DTensor.full_tensor()`` on the trainer ranks, broadcast from trainer rank
   0 to the engine ranks (colocated: each rank slices its own full tensor);
C. files: ``oarlock`` save + load through a directory; ``dcp`` ``torch.distributed.checkpoint`` save + load;
D. ``reshard_state_dict`` (plans every call) and ``WeightSync.run()`` (replayed plan);
E. ``floor``: one ``batch_isend_irecv`` per (sender, receiver) pair of exactly the bytes the receiver needs from
   that sender, packed before the clock starts, and one copy of the bytes a rank needs from itself (colocated);
   ``floor + strided gathers`` adds the copies that column-split weights force on any sender (each o/down shard's
   rows gathered per receiver's column block).

Columns: wall seconds (median), ratio to WeightSync, bytes received per engine rank (max over engine ranks),
point-to-point/collective messages per engine rank, peak RSS above the rank's RSS at the method's start
(sampled every 2 ms; max over ranks). Every method's targets are checked equal to the dense reference slices.

Usage: python benchmarks/weight_sync.py [--layers N] [--reps N] [--only disagg|coloc] [--json OUT] [--smoke]
(``--smoke``: one layer of hidden 256, one repetition: checks the script runs; its figures mean nothing.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

H, I = 2048, 5504
ROW = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
COL = ("o_proj", "down_proj")


def model_shapes(layers: int, small: bool = False) -> dict[str, tuple[int, ...]]:
    """Global shapes of the model's tensors; ``small``: hidden 256, intermediate 688 (the smoke run)."""
    h, inter = (256, 688) if small else (H, I)
    out: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        p = f"layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[p + f"self_attn.{n}.weight"] = (h, h)
        out[p + "mlp.gate_proj.weight"] = (inter, h)
        out[p + "mlp.up_proj.weight"] = (inter, h)
        out[p + "mlp.down_proj.weight"] = (h, inter)
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
    return out


def tp_placement(key: str, shape: tuple[int, ...]):
    from torch.distributed.tensor import Replicate, Shard

    if len(shape) == 1:
        return [Replicate()]
    return [Shard(1)] if any(f".{c}." in key for c in COL) else [Shard(0)]


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


def rank_main(rank: int, world: int, port: int, layers: int, reps: int, only: str | None, out: str,
              methods_only: str | None = None, small: bool = False) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from oarlock.checkpoint import WeightSync, load_state_dict, reshard_state_dict, save_state_dict

    warnings.filterwarnings("ignore")
    os.environ["OARLOCK_PROGRESS"] = "0"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    shapes = model_shapes(layers, small)
    rows: list[dict] = []
    for config in ("disagg", "coloc"):
        if only and config != only:
            continue
        trainer_ranks = [0, 1] if config == "disagg" else [0, 1, 2, 3]
        engine_ranks = [2, 3] if config == "disagg" else [0, 1, 2, 3]
        tmesh = DeviceMesh("cpu", trainer_ranks)
        emesh = DeviceMesh("cpu", engine_ranks)
        in_t, in_e = rank in trainer_ranks, rank in engine_ranks
        full = {}
        sources: dict = {}
        for j, (k, s) in enumerate(shapes.items()):
            g = torch.Generator().manual_seed(j)
            full[k] = torch.randn(s, generator=g)
            if in_t:
                # each trainer rank keeps only its own shard (the dense tensor is dropped below)
                sources[k] = DTensor.from_local(full[k][_box(s, [Shard(0)], tmesh, rank)].clone(), tmesh, [Shard(0)],
                                                shape=torch.Size(s), stride=torch.empty(s).stride())
        want = {}
        if in_e:
            for k, s in shapes.items():
                want[k] = full[k][_box(s, tp_placement(k, s), emesh, rank)].clone()
        del full

        def new_targets() -> dict:
            if not in_e:
                return {}
            return {k: DTensor.from_local(torch.zeros(want[k].shape), emesh, tp_placement(k, s), shape=torch.Size(s),
                                          stride=torch.empty(s).stride()) for k, s in shapes.items()}

        def check(targets: dict, name: str) -> None:
            for k, v in targets.items():
                if not torch.equal(v.to_local(), want[k]):
                    raise AssertionError(f"{config} {name}: {k} differs from the reference")

        tgroup = dist.new_group(trainer_ranks)
        bgroup = dist.new_group(sorted({trainer_ranks[0], *engine_ranks}))
        tmp = Path(tempfile.mkdtemp(prefix="oarlock-ws-")) if rank == 0 else None
        root = Path(dist_broadcast_str(str(tmp) if tmp else "", dist))

        def m_gather(targets):
            msgs = 0
            for k, s in shapes.items():
                if in_t:
                    loc = sources[k].to_local().contiguous()
                    parts = [torch.empty_like(loc) for _ in trainer_ranks] if rank == trainer_ranks[0] else None
                    dist.gather(loc, parts, dst=trainer_ranks[0], group=tgroup)
                    whole = torch.cat(parts) if parts is not None else None
                else:
                    whole = None
                if rank == trainer_ranks[0] or in_e:
                    buf = whole if whole is not None else torch.empty(s)
                    dist.broadcast(buf, src=trainer_ranks[0], group=bgroup)
                    msgs += 1
                    if in_e:
                        targets[k].to_local().copy_(buf[_box(s, tp_placement(k, s), emesh, rank)])
            return msgs

        def m_full_tensor(targets):
            msgs = 0
            for k, s in shapes.items():
                whole = sources[k].full_tensor() if in_t else None
                if config == "disagg":
                    if rank == trainer_ranks[0] or in_e:
                        buf = whole if whole is not None else torch.empty(s)
                        dist.broadcast(buf, src=trainer_ranks[0], group=bgroup)
                        whole = buf
                msgs += 1
                if in_e:
                    targets[k].to_local().copy_(whole[_box(s, tp_placement(k, s), emesh, rank)])
            return msgs

        def m_oarlock_files(targets):
            d = root / "oarlock"
            save_state_dict(sources, d)
            load_state_dict(targets, d, strict=False)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(d)
            return 0

        def m_dcp(targets):
            d = root / "dcp"
            dcp.save(sources, checkpoint_id=str(d))
            dcp.load(targets, checkpoint_id=str(d))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(d)
            return 0

        def m_reshard(targets):
            rep = reshard_state_dict(sources, targets)
            return rep.messages_received

        sync_holder: dict = {}

        def m_sync(targets):
            sync = sync_holder.get("s")
            if sync is None or sync.targets is not targets:
                sync = sync_holder["s"] = WeightSync(sources, targets)
                sync.run()  # the first run plans; the timed runs replay
            rep = sync.run()
            assert rep.plan_reused
            sync_holder["plan_share"] = rep.plan_seconds / max(rep.seconds, 1e-9)
            return rep.messages_received

        # the floor: exactly the bytes each receiver needs from each sender, packed before the clock starts
        need = _pair_bytes(shapes, trainer_ranks, engine_ranks, tmesh, emesh)
        send_bufs = [(torch.empty(n, dtype=torch.uint8), r) for (s, r), n in need.items() if s == rank and r != rank]
        recv_bufs = [(torch.empty(n, dtype=torch.uint8), s) for (s, r), n in need.items() if r == rank and s != rank]

        # the bytes a rank needs from its own sources (colocated) still cost one copy each
        self_bufs = [(torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8))
                     for (s, r), n in need.items() if s == rank and r == rank]

        def m_floor(targets):
            for a, b in self_bufs:
                b.copy_(a)
            ops = [dist.P2POp(dist.isend, b, r) for b, r in send_bufs] + \
                  [dist.P2POp(dist.irecv, b, s) for b, s in recv_bufs]
            for w in dist.batch_isend_irecv(ops) if ops else ():
                w.wait()
            return len(recv_bufs)

        def m_floor_gathers(targets):
            # the floor plus the one copy a strided layout forces on a sender: each column-split weight's local rows
            # gathered per receiving rank's column block (what any sender of these slices must pack)
            if in_t:
                for k, s in shapes.items():
                    if len(s) == 2 and any(f".{c}." in k for c in COL):
                        loc = sources[k].to_local()
                        for blk in loc.chunk(len(engine_ranks), dim=1):
                            blk.contiguous()
            return m_floor(targets)

        methods = [("A gather+bcast", m_gather), ("B full_tensor+bcast", m_full_tensor),
                   ("C oarlock files", m_oarlock_files), ("C dcp files", m_dcp),
                   ("D reshard_state_dict", m_reshard), ("D WeightSync.run", m_sync), ("E floor", m_floor),
                   ("E floor + strided gathers", m_floor_gathers)]
        for name, fn in methods:
            if methods_only and not any(m.strip() in name for m in methods_only.split(",")):
                continue
            times, peaks, msgs = [], [], 0
            targets = new_targets()
            fn(targets)  # warm-up (plans, caches, first-touch of the targets), not timed
            for _ in range(reps):
                for v in targets.values():
                    v.to_local().zero_()
                dist.barrier()
                with RssPeak() as rss:
                    t0 = time.perf_counter()
                    msgs = fn(targets)
                    dist.barrier()
                    dt = time.perf_counter() - t0
                times.append(dt)
                peaks.append(rss.above)
            if not name.startswith("E floor"):
                check(targets, name)
            recv = sum(v.to_local().numel() * 4 for v in targets.values())
            got = [None] * world
            dist.all_gather_object(got, (statistics.median(times), max(peaks), msgs if in_e else 0,
                                         recv if in_e else 0, sync_holder.get("plan_share", 0.0)))
            if rank == 0:
                rows.append({"config": config, "method": name, "seconds": max(g[0] for g in got),
                             "peak_rss_above_mib": max(g[1] for g in got) / 2**20,
                             "messages_per_engine_rank": max(g[2] for g in got),
                             "target_bytes_per_engine_rank": max(g[3] for g in got),
                             "floor_bytes_per_engine_rank": max(n for (s, r), n in _per_receiver(need).items()),
                             "plan_share": max(g[4] for g in got)})
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _per_receiver(need):
    out = {}
    for (s, r), n in need.items():
        out[(0, r)] = out.get((0, r), 0) + n
    return out


def dist_broadcast_str(s: str, dist) -> str:
    box = [s]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _box(shape, placements, mesh, rank):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, off = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
    # computed for the calling rank's own coordinate by torch
    return tuple(slice(o, o + n) for o, n in zip(off, local))


def _pair_bytes(shapes, trainer_ranks, engine_ranks, tmesh, emesh):
    """Bytes each (sender, receiver) pair must move: intersections of the trainer's Shard(0) rows (even
    ``torch.chunk``) with each engine rank's TP box, replicated sources spread like the planner does (norms:
    trainer rank = receiver index modulo the trainer count)."""
    from torch.distributed.tensor import Shard

    need: dict = {}
    for k, s in shapes.items():
        t_boxes = _all_boxes(s, [Shard(0)], len(trainer_ranks))
        e_boxes = _all_boxes(s, tp_placement(k, s), len(engine_ranks))
        for ti, tb in enumerate(t_boxes):
            for ei, eb in enumerate(e_boxes):
                vol = 1
                for (a0, a1), (b0, b1) in zip(tb, eb):
                    vol *= max(0, min(a1, b1) - max(a0, b0))
                if vol:
                    key = (trainer_ranks[ti], engine_ranks[ei])
                    need[key] = need.get(key, 0) + vol * 4
    return need


def _all_boxes(shape, placements, n):
    from torch.distributed.tensor import Replicate

    if isinstance(placements[0], Replicate):
        return [tuple((0, d) for d in shape)] * n
    dim = placements[0].dim
    cuts = [0]
    size = -(-shape[dim] // n)
    for i in range(n):
        cuts.append(min(shape[dim], cuts[-1] + size))
    return [tuple((cuts[i], cuts[i + 1]) if d == dim else (0, shape[d]) for d in range(len(shape))) for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", choices=("disagg", "coloc"))
    ap.add_argument("--json")
    ap.add_argument("--methods", help="comma-separated substrings of method names to run (default: all)")
    ap.add_argument("--smoke", action="store_true", help="one layer of hidden 256, one repetition: checks the "
                    "script runs")
    a = ap.parse_args()
    if a.smoke:
        a.layers, a.reps = 1, 1
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(suffix=".json")
    mp.spawn(rank_main, args=(4, port, a.layers, a.reps, a.only, out, a.methods, a.smoke), nprocs=4)
    rows = json.loads(Path(out).read_text())
    os.unlink(out)
    total = sum(torch.Size(s).numel() * 4 for s in model_shapes(a.layers, a.smoke).values())
    print(f"model: {a.layers} layers, {total / 2**30:.2f} GiB fp32; load average: {os.getloadavg()}")
    for config in ("disagg", "coloc"):
        sub = [r for r in rows if r["config"] == config]
        if not sub:
            continue
        ws = next((r["seconds"] for r in sub if r["method"] == "D WeightSync.run"), float("nan"))
        print(f"\n{config}: | method | seconds (median) | x WeightSync | bytes recv / engine rank (MiB) | "
              f"messages / engine rank | peak RSS above (MiB) |")
        print("|---|---|---|---|---|---|")
        for r in sub:
            print(f"| {r['method']} | {r['seconds']:.3f} | {r['seconds'] / ws:.2f} | "
                  f"{r['target_bytes_per_engine_rank'] / 2**20:.0f} | {r['messages_per_engine_rank']} | "
                  f"{r['peak_rss_above_mib']:.0f} |")
        print(f"floor bytes per engine rank: {sub[0]['floor_bytes_per_engine_rank'] / 2**20:.0f} MiB; WeightSync "
              f"replay planning+checks share: {max(r['plan_share'] for r in sub) * 100:.1f}%")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
