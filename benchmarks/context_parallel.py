"""Context-parallel FlashMask: per-rank balance of three plans, and end-to-end steps against torch's own CP SDPA.

Part 1, balance (one process, no communication): for causal-document, shared-question and sliding-window masks
at each S, every rank's local attention (the kernel forward + backward of its rows against all keys, the work
``context_parallel_flashmask_attention`` does between its collectives) is timed under

* the mask-aware plan (``plan_context_parallel``, ``--chunks-per-rank`` chunks per rank, LPT over live tiles),
* a contiguous split (rank r owns the r-th S/W tokens),
* DualChunkSwap (Megatron's zigzag: rank r owns chunks r and 2W-1-r).

The slowest rank bounds a step, so the table gives max and mean per-rank time and max/mean (1.00 = balanced).

Part 2, end to end (``--world`` gloo ranks, or NCCL with ``--device cuda``): forward + backward of
``context_parallel_flashmask_attention(method="allgather")`` timed between barriers (slowest rank), per mask and plan; and on the
plain causal mask the same against ``torch.distributed.tensor.experimental.context_parallel`` (ring attention
with its load balancer) around ``scaled_dot_product_attention(is_causal=True)``. Both sides are timed the same
way: each timed step starts from fresh full-sequence Q, K, V and dOut on every rank (copied before the clock
starts) and includes cutting this rank's shard of them (oarlock: ``shard_sequence`` under the plan, computed once
per mask beforehand; torch: ``context_parallel``'s in-place buffer sharding), the forward and the backward. On CPU
torch's experimental CP has no sharding strategy for the CPU SDPA kernel (NotImplementedError): that row then says
so.

Part 3, all-gather vs ring (same ranks, mask-aware plan, causal-document / shared-question / sliding-window):
per-step forward and forward + backward wall time of ``method="allgather"`` and ``method="ring"`` (slowest rank,
between barriers) and their ratio ring / all-gather (< 1: the ring is faster); the bytes each rank sends per
step (point-to-point sends counted at the call, all-gather / reduce-scatter at their bandwidth-optimal
``(W - 1) / W`` of the gathered / reduced tensor); the K/V communication buffers a rank holds at once in the
backward (gathered K/V and full-sequence fp32 dK/dV for the all-gather, two blocks and two fp32 accumulators
for the ring: computed from the buffer sizes); on CUDA also the measured peak allocated memory of a step.

    PYTHONPATH=src python benchmarks/context_parallel.py [--seqlens 8192 16384] [--world 4] [--reps 3]
    PYTHONPATH=src python benchmarks/context_parallel.py --quick --no-write   # a seconds-long smoke run
    PYTHONPATH=src python benchmarks/context_parallel.py --methods-only       # part 3 alone

Appends the tables with the command to benchmarks/RESULTS.md unless --no-write. Ranks use 1 thread each (run on
an otherwise idle machine with at least ``--world`` cores).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from oarlock.attention import (ContextParallelPlan, causal_document_mask, context_parallel_flashmask_attention,
                               plan_context_parallel, shard_sequence, shared_question_mask, sliding_window_mask)
from oarlock.attention.context_parallel import dual_chunk_swap, local_mask
from oarlock.attention.flashmask import kernel_backward, kernel_forward

H, D = 4, 64


def masks(s: int) -> dict:
    f = s / 8192
    docs = [int(2538 * f), int(1742 * f), int(3213 * f)]  # the flashmask_cpu.py documents; the rest is one more
    q, a = int(1024 * f), [int(x * f) for x in (1200, 1200, 1000)]
    return {
        "causal_document": (causal_document_mask(docs, seqlen=s), True),
        "shared_question": (shared_question_mask([(q, a), (int(1000 * f), [int(1400 * f), int(1368 * f)])],
                                                 seqlen=s), True),
        "sliding_window": (sliding_window_mask(s, int(1024 * f)), True),
        "causal": (None, True),
    }


def plans(idx, causal: bool, s: int, world: int, chunks_per_rank: int) -> dict:
    chunk = s // (world * chunks_per_rank)
    return {
        "mask-aware": plan_context_parallel(idx, causal=causal, world_size=world, chunk_size=chunk,
                                            block_size=min(128, chunk), seqlen_q=s),
        "contiguous": ContextParallelPlan(s // world, s, (0,) * world, tuple((r,) for r in range(world))),
        "dual-chunk-swap": dual_chunk_swap(s, world_size=world),
    }


def best(fn, reps: int, setup=None) -> float:
    """Fastest of ``reps`` timed calls of ``fn`` after one untimed call. ``setup``: called untimed before each
    call, its result passed to ``fn`` (the fresh inputs a step consumes)."""
    def once() -> float:
        arg = () if setup is None else (setup(),)
        t = time.perf_counter()
        fn(*arg)
        return time.perf_counter() - t

    once()
    return min(once() for _ in range(reps))


def fresh_buffers(full, dev, transpose: bool = False):
    """An untimed ``setup`` for :func:`best`: copies of the full-sequence tensors on ``dev`` (``[B, H, S, D]`` when
    ``transpose``, torch SDPA's layout), made on every rank before the ranks start the clock together."""
    def setup():
        bufs = [(x.transpose(1, 2) if transpose else x).contiguous().to(dev, copy=True) for x in full]
        dist.barrier()
        return bufs

    return setup


def sparse_cases(seqlens):
    """``(S, q, k, v, dout, mask name, idx, causal)`` for every sequence length and sparse mask (seeded inputs)."""
    for s in seqlens:
        g = torch.Generator().manual_seed(0)
        q, k, v, dout = (torch.randn(1, s, H, D, generator=g) for _ in range(4))
        for name, (idx, causal) in masks(s).items():
            if name != "causal":
                yield s, q, k, v, dout, name, idx, causal


def balance(args) -> list[dict]:
    rows = []
    for s, q, k, v, dout, name, idx, causal in sparse_cases(args.seqlens):
        for pname, plan in plans(idx, causal, s, args.world, args.chunks_per_rank).items():
            perm = plan.token_permutation()
            kp, vp = k[:, perm].contiguous(), v[:, perm].contiguous()
            times = []
            for r in range(args.world):
                canon = local_mask(plan, idx, r, causal=causal)
                qr, dr = shard_sequence(plan, q, r), shard_sequence(plan, dout, r)

                def step(qr=qr, dr=dr, canon=canon):
                    out, lse = kernel_forward(qr, kp, vp, canon, causal=False, scale=D ** -0.5)
                    kernel_backward(dr, None, qr, kp, vp, out, lse, canon, causal=False, scale=D ** -0.5)

                times.append(best(step, args.reps))
            mean = sum(times) / len(times)
            rows.append(dict(mask=name, S=s, plan=pname, max=max(times), mean=mean, ratio=max(times) / mean,
                             est=plan.imbalance if pname == "mask-aware" else float("nan")))
            print(f"balance {name:16s} S={s:6d} {pname:16s} per-rank ms "
                  f"{' '.join(f'{t * 1e3:7.1f}' for t in times)}  max/mean {max(times) / mean:.2f}", flush=True)
    return rows


class _SentBytes:
    """Counts the bytes this rank sends through ``torch.distributed`` while active (wraps the entry points
    ``context_parallel_flashmask_attention`` calls at call time: ``batch_isend_irecv`` sends are counted in
    full, an all-gather as ``(W - 1)`` times its input, a reduce-scatter as ``(W - 1) / W`` of its input)."""

    def __init__(self, world: int):
        self.world, self.n, self._saved = world, 0, {}

    def __enter__(self):
        w = self.world

        def wrap(name, count):
            real = getattr(dist, name, None)
            if real is None:
                return
            self._saved[name] = real

            def counted(*a, **kw):
                self.n += count(*a, **kw)
                return real(*a, **kw)

            setattr(dist, name, counted)

        wrap("batch_isend_irecv", lambda ops: sum(o.tensor.nbytes for o in ops if o.op is dist.isend))
        for name in ("all_gather_single", "all_gather_into_tensor"):
            wrap(name, lambda out, inp, **kw: (w - 1) * inp.nbytes)
        for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
            wrap(name, lambda out, inp, **kw: (w - 1) * inp.nbytes // w)
        return self

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(dist, name, real)


def _kv_buffer_bytes(method: str, world: int, kv_local: int, grad_local: int) -> int:
    """K/V communication buffers one rank holds at once in the backward (the larger pass): all-gather: the
    gathered ``W`` blocks plus the full-sequence fp32 dK/dV it reduce-scatters; ring: the held and the incoming
    block plus the outgoing and the incoming fp32 accumulator."""
    if method == "allgather":
        return world * (kv_local + grad_local)
    return 2 * (kv_local + grad_local)


def _methods(rank, world, args, dev, sync, cuda) -> list[dict]:
    """Part 3: the two ways to move K/V, side by side, under the mask-aware plan."""
    rows = []
    for s, q, k, v, dout, name, idx, causal in sparse_cases(args.seqlens):
        plan = plans(idx, causal, s, world, args.chunks_per_rank)["mask-aware"]
        loc = [shard_sequence(plan, x, rank).to(dev) for x in (q, k, v, dout)]
        idx_d = idx.to(dev) if idx is not None else None
        kv_local = loc[1].nbytes + loc[2].nbytes
        grad_local = (loc[1].numel() + loc[2].numel()) * 4
        for method in ("allgather", "ring"):
            def fwd(method=method):
                xs = [x.detach().requires_grad_(True) for x in loc[:3]]
                context_parallel_flashmask_attention(*xs, idx_d, plan=plan, causal=causal, method=method)
                sync()
                dist.barrier()

            def fwd_bwd(method=method):
                xs = [x.detach().requires_grad_(True) for x in loc[:3]]
                out = context_parallel_flashmask_attention(*xs, idx_d, plan=plan, causal=causal, method=method)
                out.backward(loc[3])
                sync()
                dist.barrier()

            with _SentBytes(world) as sent_f:
                fwd()
            with _SentBytes(world) as sent_fb:
                fwd_bwd()
            peak = None
            if cuda:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                fwd_bwd()
                peak = torch.cuda.max_memory_allocated() - base
            row = dict(mask=name, S=s, method=method, fwd=best(fwd, args.reps), fwd_bwd=best(fwd_bwd, args.reps),
                       sent_fwd=sent_f.n, sent_step=sent_fb.n,
                       kv_buffers=_kv_buffer_bytes(method, world, kv_local, grad_local), cuda_peak=peak)
            # the slowest rank bounds the step: every rank reports, rank 0 keeps the maxima
            t = torch.tensor([row["fwd"], row["fwd_bwd"]], dtype=torch.float64, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            row["fwd"], row["fwd_bwd"] = float(t[0]), float(t[1])
            rows.append(row)
    return rows


def _e2e_rank(rank: int, world: int, port: int, args, q_out) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    sync = (lambda: torch.cuda.synchronize()) if cuda else (lambda: None)
    rows = [] if args.methods_only else _plans_e2e(rank, world, args, dev, sync)
    rows += _methods(rank, world, args, dev, sync, cuda)
    if rank == 0:
        q_out.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def _plans_e2e(rank, world, args, dev, sync) -> list[dict]:
    """Part 2: oarlock CP (all-gather) under each plan, and torch's context-parallel SDPA on the causal mask."""
    rows = []
    for s in args.seqlens:
        g = torch.Generator().manual_seed(0)
        q, k, v, dout = (torch.randn(1, s, H, D, generator=g) for _ in range(4))
        for name, (idx, causal) in masks(s).items():
            for pname, plan in plans(idx, causal, s, world, args.chunks_per_rank).items():
                idx_d = idx.to(dev) if idx is not None else None

                def step(full_bufs, plan=plan, idx_d=idx_d, causal=causal):
                    # this rank's shard, cut in the timed step as torch's context_parallel cuts its buffers
                    loc = [shard_sequence(plan, x, rank) for x in full_bufs]
                    xs = [x.detach().requires_grad_(True) for x in loc[:3]]
                    out = context_parallel_flashmask_attention(*xs, idx_d, plan=plan, causal=causal,
                                                               method="allgather")  # as recorded in RESULTS.md
                    out.backward(loc[3])
                    sync()
                    dist.barrier()

                t = best(step, args.reps, fresh_buffers((q, k, v, dout), dev))
                rows.append(dict(mask=name, S=s, impl=f"oarlock CP ({pname})", t=t))
            if name == "causal":
                rows.append(dict(mask=name, S=s, impl="torch context_parallel SDPA (ring, load-balanced)",
                                 t=_torch_cp(q, k, v, dout, world, dev, sync, args.reps)))
    return rows


def _torch_cp(q, k, v, dout, world, dev, sync, reps):
    """Seconds per forward+backward of torch's experimental context parallel SDPA, or the error text."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh(dev.type, (world,))

        def step(full_bufs):
            qq, kk, vv, dd = full_bufs  # sharded in place by context_parallel, inside the timed step
            with context_parallel(mesh, buffers=[qq, kk, vv, dd], buffer_seq_dims=[2, 2, 2, 2]):
                xs = [x.detach().requires_grad_(True) for x in (qq, kk, vv)]
                out = torch.nn.functional.scaled_dot_product_attention(*xs, is_causal=True)
                out.backward(dd)
            sync()
            dist.barrier()

        return best(step, reps, fresh_buffers((q, k, v, dout), dev, transpose=True))
    except Exception as e:  # noqa: BLE001 - reported in the table
        dist.barrier()
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def end_to_end(args) -> list[dict]:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = [ctx.Process(target=_e2e_rank, args=(r, args.world, port, args, q)) for r in range(args.world)]
    for p in procs:
        p.start()
    rows = q.get()
    for p in procs:
        p.join()
    for r in rows:
        if "method" in r:
            print(f"method {r['mask']:16s} S={r['S']:6d} {r['method']:9s} fwd {r['fwd'] * 1e3:9.1f} ms  fwd+bwd "
                  f"{r['fwd_bwd'] * 1e3:9.1f} ms  sent {r['sent_step'] / 2 ** 20:8.1f} MiB", flush=True)
            continue
        t = r["t"]
        print(f"e2e {r['mask']:16s} S={r['S']:6d} {r['impl']:50s} "
              f"{f'{t * 1e3:9.1f} ms' if isinstance(t, float) else t}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunks-per-rank", type=int, default=4)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--quick", action="store_true", help="S=2048, 1 rep: checks the script runs")
    ap.add_argument("--no-e2e", action="store_true", help="part 1 only")
    ap.add_argument("--methods-only", action="store_true", help="part 3 only (all-gather vs ring)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.seqlens, args.reps = [2048], 1
    torch.set_num_threads(1)
    bal = [] if args.methods_only else balance(args)
    rows = [] if args.no_e2e else end_to_end(args)
    e2e = [r for r in rows if "method" not in r]
    meth = [r for r in rows if "method" in r]
    t1 = ["| mask | S | plan | slowest rank ms | mean rank ms | max/mean measured | max/mean planned (live tiles) |",
          "|---|---|---|---|---|---|---|"]
    for r in bal:
        est = "" if r["est"] != r["est"] else f"{r['est']:.2f}"  # NaN: only the mask-aware plan has an estimate
        t1.append(f"| {r['mask']} | {r['S']} | {r['plan']} | {r['max'] * 1e3:.1f} | {r['mean'] * 1e3:.1f} | "
                  f"{r['ratio']:.2f} | {est} |")
    t2 = ["| mask | S | implementation | fwd+bwd ms (slowest rank) | vs oarlock mask-aware |", "|---|---|---|---|---|"]
    ref = {(r["mask"], r["S"]): r["t"] for r in e2e if r["impl"] == "oarlock CP (mask-aware)"}
    for r in e2e:
        t, base = r["t"], ref.get((r["mask"], r["S"]))
        cell = f"{t * 1e3:.1f}" if isinstance(t, float) else t
        ratio = f"{t / base:.2f}" if isinstance(t, float) and base else ""
        t2.append(f"| {r['mask']} | {r['S']} | {r['impl']} | {cell} | {ratio} |")
    t3 = ["| mask | S | method | fwd ms | fwd+bwd ms | fwd ring/all-gather | fwd+bwd ring/all-gather | "
          "MiB sent per rank (fwd / fwd+bwd) | K/V comm buffers MiB (bwd) | CUDA peak MiB (fwd+bwd) |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    ag = {(r["mask"], r["S"]): r for r in meth if r["method"] == "allgather"}
    mib = 2 ** 20
    for r in meth:
        a = ag[(r["mask"], r["S"])]
        peak = "" if r["cuda_peak"] is None else f"{r['cuda_peak'] / mib:.1f}"
        t3.append(f"| {r['mask']} | {r['S']} | {r['method']} | {r['fwd'] * 1e3:.1f} | {r['fwd_bwd'] * 1e3:.1f} | "
                  f"{r['fwd'] / a['fwd']:.2f} | {r['fwd_bwd'] / a['fwd_bwd']:.2f} | "
                  f"{r['sent_fwd'] / mib:.1f} / {r['sent_step'] / mib:.1f} | {r['kv_buffers'] / mib:.1f} | {peak} |")
    tables = [t for t in (t1, t2, t3) if len(t) > 2]
    print("\n\n".join("\n".join(t) for t in tables))
    if not args.no_write:
        cmd = "PYTHONPATH=src python benchmarks/context_parallel.py " + " ".join(argv if argv is not None
                                                                                  else sys.argv[1:])
        with Path(__file__).with_name("RESULTS.md").open("a") as f:
            f.write(f"\n## Context-parallel FlashMask ({args.world} ranks, {args.device})\n\n"
                    f"Command: `{cmd.strip()}` (torch {torch.__version__}, 1 thread per rank); B=1, H={H}, D={D}, "
                    f"fp32, best of {args.reps}; load average at the end {os.getloadavg()[0]:.1f} on "
                    f"{os.cpu_count()} CPUs. Ratios > 1 in the second table: slower than oarlock's mask-aware "
                    f"plan. Third table: ring / all-gather < 1 means the ring is faster.\n\n"
                    + "\n\n".join("\n".join(t) for t in tables) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
