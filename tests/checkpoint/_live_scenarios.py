"""Scenarios of the live-resharding tests (test_live_reshard.py), on 4 gloo ranks in one launch.

Every layout pair checks the targets two independent ways: against slices of the dense tensor rebuilt from a
fixed seed with plain torch (the reference), and against a load of the same sources through a checkpoint
(save_state_dict + load_state_dict into a second copy of the targets, same AOA config): equal bytes. Byte
accounting: each rank's ``bytes_received`` equals the bytes of its target boxes.
"""

from __future__ import annotations

import random
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from oarlock.checkpoint import (CheckpointError, CheckpointMismatchError, FlatPartition, ShardedWeight, WeightSync,
                                load_state_dict, reshard_state_dict, save_state_dict)
from oarlock.checkpoint.runtime import transfer
from testkit import seeded_tensor

warnings.filterwarnings("ignore")


def full(shape, dtype=torch.float32, seed=0):
    return seeded_tensor(tuple(shape), dtype, seed)


def dt(t: torch.Tensor, mesh, placements) -> DTensor:
    return distribute_tensor(t.clone(), mesh, placements)


def local_of(x):
    if isinstance(x, DTensor):
        return x.to_local()
    if isinstance(x, ShardedWeight):
        return x.local_tensor
    return x


def leaves(d):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from leaves(v)
        elif isinstance(v, list):
            yield from v
        else:
            yield v


def target_bytes(targets) -> int:
    return sum(local_of(v).numel() * local_of(v).element_size() for v in leaves(targets))


def zeros_like_targets(make):
    """A second copy of the targets (same layout) for the checkpoint load."""
    return make()


def run_pair(ctx, sources, make_targets, reference, aoa=None, **kw):
    """Reshard, then check against the dense reference and against a checkpoint load; returns the report."""
    targets = make_targets()
    rep = reshard_state_dict(sources, targets, aoa_config=aoa, **kw)
    # 1. the dense reference (plain torch slicing of the seeded full tensors)
    for key, want in reference(targets).items():
        got = want[0]
        assert got.dtype == want[1].dtype, (key, got.dtype, want[1].dtype)
        assert torch.equal(got, want[1]), f"{key}: live reshard differs from the dense reference"
    # 2. a load of the same sources through a checkpoint
    path = ctx.root / "ckpt"
    save_state_dict(sources, path)
    via_file = make_targets()
    load_state_dict(via_file, path, aoa_config=aoa)
    for a, b in zip(leaves(targets), leaves(via_file)):
        assert torch.equal(local_of(a), local_of(b)), "live reshard differs from a load through a checkpoint"
    assert rep.bytes_received == target_bytes(targets), (rep.bytes_received, target_bytes(targets))
    return rep


def mesh1(n=4, ranks=None):
    return init_device_mesh("cpu", (n,)) if ranks is None else dist.device_mesh.DeviceMesh("cpu", ranks)


# ---------------------------------------------------------------- layout pairs (colocated, world 4)

def scenario_fsdp2_to_tp_columns(ctx):
    m = init_device_mesh("cpu", (4,))
    W, B = full((64, 48), seed=1), full((40,), torch.bfloat16, seed=2)
    src = {"w": dt(W, m, [Shard(0)]), "b": dt(B, m, [Shard(0)])}

    def make():
        return {"w": dt(torch.zeros(64, 48), m, [Shard(1)]), "b": dt(torch.zeros(40, dtype=torch.bfloat16), m,
                                                                        [Replicate()])}

    rep = run_pair(ctx, src, make, lambda t: {"w": (t["w"].to_local(), W[:, ctx.rank * 12:(ctx.rank + 1) * 12]),
                                             "b": (t["b"].to_local(), B)})
    return rep.bytes_received


def scenario_uneven_shards_and_3d(ctx):
    m = init_device_mesh("cpu", (4,))
    A = full((10, 7, 9), seed=3)
    src = {"a": dt(A, m, [Shard(2)])}

    def make():
        return {"a": dt(torch.zeros(10, 7, 9), m, [Shard(0)])}

    rows = [0, 3, 6, 9, 10]  # torch.chunk's uneven split, as DTensor's Shard(0) cuts 10 rows over 4 ranks
    run_pair(ctx, src, make, lambda t: {"a": (t["a"].to_local(), A[rows[ctx.rank]:rows[ctx.rank + 1]])})


def scenario_hsdp_replicated_sources_balanced(ctx):
    m2 = init_device_mesh("cpu", (2, 2))
    m = init_device_mesh("cpu", (4,))
    ws = {f"w{i}": full((32, 16), seed=10 + i) for i in range(8)}
    src = {k: dt(v, m2, [Replicate(), Shard(0)]) for k, v in ws.items()}  # HSDP: 2 replicas of 2 shards

    def make():
        return {k: dt(torch.zeros(32, 16), m, [Shard(1)]) for k in ws}

    rep = run_pair(ctx, src, make, lambda t: {k: (t[k].to_local(), ws[k][:, ctx.rank * 4:(ctx.rank + 1) * 4])
                                             for k in ws})
    sent = [None] * 4
    dist.all_gather_object(sent, rep.bytes_sent)
    assert max(sent) <= 1.25 * min(sent), f"senders of replicated sources unbalanced: {sent}"
    return sent


def scenario_replicated_plain_tensors_balanced(ctx):
    m = init_device_mesh("cpu", (4,))
    ws = {f"n{i}": full((16, 16), seed=20 + i) for i in range(16)}  # TP-replicated norms: every rank holds all

    def make():
        return {k: dt(torch.zeros(16, 16), m, [Shard(0)]) for k in ws}

    rep = run_pair(ctx, {k: v.clone() for k, v in ws.items()}, make,
                   lambda t: {k: (t[k].to_local(), ws[k][ctx.rank * 4:(ctx.rank + 1) * 4]) for k in ws})
    sent = [None] * 4
    dist.all_gather_object(sent, rep.bytes_sent)
    assert max(sent) <= 1.25 * min(sent), f"senders of replicated sources unbalanced: {sent}"


def scenario_tp_rows_to_uneven_columns_sharded_weights(ctx):
    W = full((12, 10), seed=4)
    src = {"w": ShardedWeight("w", W[ctx.rank * 3:(ctx.rank + 1) * 3].clone(), (3, 10), (12, 10), (ctx.rank * 3, 0))}
    cols = [0, 1, 4, 4, 10]  # rank 2 wants nothing

    def make():
        a, b = cols[ctx.rank], cols[ctx.rank + 1]
        return {"w": ShardedWeight("w", torch.zeros(12, b - a), (12, b - a), (12, 10), (0, a))}

    run_pair(ctx, src, make, lambda t: {"w": (t["w"].local_tensor, W[:, cols[ctx.rank]:cols[ctx.rank + 1]])})


def scenario_zero1_flat_ranges_to_tp(ctx):
    # a ZeRO-1 flat buffer of two tensors split evenly over 4 ranks (partition 30 of 120 elements)
    A, B = full((8, 9), seed=5), full((6, 8), seed=6)
    flat = torch.cat([A.reshape(-1), B.reshape(-1)])
    lo, hi = ctx.rank * 30, (ctx.rank + 1) * 30
    src = {}
    for key, t, off in (("a", A, 0), ("b", B, 72)):
        a, b = max(lo - off, 0), min(hi - off, t.numel())
        a, b = (a, b) if b > a else (0, 0) if lo - off < 0 else (t.numel(), t.numel())
        src[key] = ShardedWeight(key, flat[off + a:off + b].clone(), tuple(t.shape), tuple(t.shape), (0, 0),
                                 flattened_range=(a, b), flat_partition=FlatPartition(off, 30, ctx.rank))
    m = init_device_mesh("cpu", (4,))

    def make():
        return {"a": dt(torch.zeros(8, 9), m, [Shard(0)]), "b": dt(torch.zeros(6, 8), m, [Shard(1)])}

    run_pair(ctx, src, make, lambda t: {"a": (t["a"].to_local(), A[ctx.rank * 2:(ctx.rank + 1) * 2]),
                                        "b": (t["b"].to_local(), B[:, ctx.rank * 2:(ctx.rank + 1) * 2])})


def scenario_pp_stages_to_tp(ctx):
    # pipeline stages: ranks 0-1 hold layers 0-1 (stage 0, replicated across its 2 DP ranks), ranks 2-3 layers 2-3
    Ls = {f"layers.{i}.w": full((8, 8), seed=30 + i) for i in range(4)}
    stage = ctx.rank // 2
    src = {k: v.clone() for k, v in Ls.items() if int(k.split(".")[1]) // 2 == stage}
    m = init_device_mesh("cpu", (4,))

    def make():
        return {k: dt(torch.zeros(8, 8), m, [Shard(0)]) for k in Ls}

    run_pair(ctx, src, make, lambda t: {k: (t[k].to_local(), Ls[k][ctx.rank * 2:(ctx.rank + 1) * 2]) for k in Ls})


def scenario_ep_experts_to_tp_ep(ctx):
    # EP4: rank r holds experts 2r, 2r+1 whole; target TP2 x EP2: ranks {0,1} experts 0-3, {2,3} experts 4-7, each
    # expert's rows split over the TP pair
    E = {f"experts.{e}.w": full((6, 4), seed=40 + e) for e in range(8)}
    src = {k: v.clone() for k, v in E.items() if int(k.split(".")[1]) // 2 == ctx.rank}
    ep, tp = ctx.rank // 2, ctx.rank % 2

    def make():
        return {f"experts.{e}.w": ShardedWeight(f"experts.{e}.w", torch.zeros(3, 4), (3, 4), (6, 4), (tp * 3, 0))
                for e in range(ep * 4, ep * 4 + 4)}

    run_pair(ctx, src, make, lambda t: {k: (v.local_tensor, E[k][tp * 3:tp * 3 + 3]) for k, v in t.items()})


def _qkv_rows(Q, K, V, heads, groups, tp, rank, D):
    """The reference: rank's TP slice of the fused_qkv layout, computed by hand (per KV group: its query heads,
    then k, then v; TP splits the groups)."""
    per = heads // groups
    out = []
    for g in range(groups):
        out += [Q[g * per * D:(g + 1) * per * D], K[g * D:(g + 1) * D], V[g * D:(g + 1) * D]]
    fused = torch.cat(out)
    n = fused.shape[0] // tp
    return fused[rank * n:(rank + 1) * n]


def scenario_fused_qkv_and_gate_up_with_cast(ctx):
    H, G, D, hid = 8, 4, 4, 16
    Q, K, V = full((H * D, hid), seed=50), full((G * D, hid), seed=51), full((G * D, hid), seed=52)
    gate, up = full((24, hid), seed=53), full((24, hid), seed=54)
    m = init_device_mesh("cpu", (4,))
    src = {"q": dt(Q, m, [Shard(0)]), "k": dt(K, m, [Shard(1)]), "v": dt(V, m, [Replicate()]),
           "gate": dt(gate, m, [Shard(0)]), "up": dt(up, m, [Shard(0)])}
    aoa = [f"q, k, v -> qkv, fused_qkv, num_heads={H}, num_key_value_groups={G}, axis=0",
           "qkv -> qkv, dtype='bfloat16'",
           "gate, up -> gate_up, fused_ffn, axis=0"]
    n = (H + 2 * G) * D

    def make():
        return {"qkv": dt(torch.zeros(n, hid, dtype=torch.bfloat16), m, [Shard(0)]),
                "gate_up": dt(torch.zeros(48, hid), m, [Shard(0)])}

    r = ctx.rank
    ref_gu = torch.cat([gate[r * 6:(r + 1) * 6], up[r * 6:(r + 1) * 6]])  # fused_ffn: per TP rank [gate_r; up_r]
    run_pair(ctx, src, make, lambda t: {"qkv": (t["qkv"].to_local(),
                                                _qkv_rows(Q, K, V, H, G, 4, r, D).bfloat16()),
                                        "gate_up": (t["gate_up"].to_local(), ref_gu)}, aoa=aoa)


def scenario_transpose_and_int_bool(ctx):
    W = full((12, 8), seed=60)
    I = full((9, 4), torch.int64, seed=61)
    M = full((4, 5), seed=62) > 0
    m = init_device_mesh("cpu", (4,))
    src = {"w": dt(W, m, [Shard(0)]), "i": dt(I, m, [Shard(0)]), "m": M.clone()}
    aoa = ["w -> wt, permute='[1, 0]'"]

    def make():
        return {"wt": dt(torch.zeros(8, 12), m, [Shard(0)]), "i": dt(torch.zeros(9, 4, dtype=torch.int64), m,
                                                                     [Shard(1)]),
                "m": torch.zeros(4, 5, dtype=torch.bool)}

    r = ctx.rank
    run_pair(ctx, src, make, lambda t: {"wt": (t["wt"].to_local(), W.t()[r * 2:(r + 1) * 2]),
                                        "i": (t["i"].to_local(), I[:, r:r + 1]), "m": (t["m"], M)}, aoa=aoa)


def scenario_tp_to_fsdp2_small_buckets_verified(ctx):
    # tiny buckets: many rounds, slices straddling chunks, packing of many small tensors; verify on
    W = full((256, 40), seed=70)
    small = {f"s{i}": full((3,), seed=80 + i) for i in range(20)}
    m = init_device_mesh("cpu", (4,))
    src = {"w": dt(W, m, [Shard(1)]), **{k: dt(v, m, [Replicate()]) for k, v in small.items()}}

    def make():
        return {"w": dt(torch.zeros(256, 40), m, [Shard(0)]), **{k: torch.zeros(3) for k in small}}

    rep = run_pair(ctx, src, make, lambda t: {"w": (t["w"].to_local(), W[ctx.rank * 64:(ctx.rank + 1) * 64]),
                                              **{k: (t[k], v) for k, v in small.items()}},
                   bucket_bytes=4096, verify=True)
    assert rep.rounds > 1, rep


# ---------------------------------------------------------------- disaggregated: disjoint source and target ranks

def scenario_disaggregated_fsdp2_to_tp2(ctx):
    trainer = dist.device_mesh.DeviceMesh("cpu", [0, 1])
    engine = dist.device_mesh.DeviceMesh("cpu", [2, 3])
    W, E = full((16, 12), seed=90), full((20, 8), torch.bfloat16, seed=91)
    if ctx.rank < 2:
        src = {"w": dt(W, trainer, [Shard(0)]), "e": dt(E.float(), trainer, [Shard(0)])}
        make = dict
    else:
        src = {}

        def make():
            return {"w": dt(torch.zeros(16, 12), engine, [Shard(1)]),
                    "e": dt(torch.zeros(20, 8, dtype=torch.bfloat16), engine, [Shard(0)])}
    aoa = ["e -> e, dtype='bfloat16'"]
    targets = make()
    rep = reshard_state_dict(src, targets, aoa_config=aoa)
    if ctx.rank >= 2:
        t = ctx.rank - 2
        assert torch.equal(targets["w"].to_local(), W[:, t * 6:(t + 1) * 6])
        assert torch.equal(targets["e"].to_local(), E[t * 10:(t + 1) * 10])
        assert rep.bytes_received == 16 * 6 * 4 + 10 * 8 * 2 and rep.bytes_local == 0 and rep.bytes_sent == 0
    else:
        assert rep.bytes_received == 0 and rep.bytes_sent > 0
    sent = [None] * 4
    dist.all_gather_object(sent, rep.bytes_sent)
    assert sum(sent) == 2 * (16 * 6 * 4 + 10 * 8 * 2), sent  # cast on the sender: bf16 bytes on the wire


def scenario_random_placements(ctx):
    # 12 random source/target placement pairs on a 2x2 mesh and a 1-D mesh (the same draws on every rank)
    rng = random.Random(1234)
    m2 = init_device_mesh("cpu", (2, 2))
    m1 = init_device_mesh("cpu", (4,))
    kinds = [lambda: [Shard(0)], lambda: [Shard(1)], lambda: [Replicate()]]
    kinds2 = [lambda: [Shard(0), Shard(1)], lambda: [Replicate(), Shard(0)], lambda: [Shard(1), Shard(1)],
              lambda: [Shard(0), Shard(0)], lambda: [Replicate(), Replicate()]]
    for case in range(12):
        shape = (rng.randint(1, 13), rng.randint(1, 11))
        X = full(shape, seed=100 + case)
        sm, sp = (m2, rng.choice(kinds2)()) if rng.random() < 0.5 else (m1, rng.choice(kinds)())
        tm, tp = (m2, rng.choice(kinds2)()) if rng.random() < 0.5 else (m1, rng.choice(kinds)())
        src = {"x": dt(X, sm, sp)}
        tgt = {"x": dt(torch.zeros(shape), tm, tp)}
        rep = reshard_state_dict(src, tgt, bucket_bytes=rng.choice([512, 1 << 20]))
        want = dt(X, tm, tp).to_local()  # torch's own placement of the dense tensor
        assert torch.equal(tgt["x"].to_local(), want), (case, shape, sp, tp)
        assert rep.bytes_received == want.numel() * 4


# ---------------------------------------------------------------- errors and replay

def scenario_mismatch_raises_everywhere_before_any_byte(ctx):
    m = init_device_mesh("cpu", (4,))
    W = full((8, 8), seed=110)
    src = {"w": dt(W, m, [Shard(0)]), "v": dt(W, m, [Shard(0)])}
    for bad, needle in (({"w": (8, 9)}, "'w'"), ({"v": torch.float16}, "'v'")):
        tgt = {"w": dt(torch.full((8, 8), 7.0), m, [Shard(1)]), "v": dt(torch.full((8, 8), 7.0), m, [Shard(1)])}
        if ctx.rank == 3:  # one rank asks for something the sources cannot give
            k, v = next(iter(bad.items()))
            tgt[k] = torch.full(v, 7.0) if isinstance(v, tuple) else torch.full((8, 8), 7.0, dtype=v)
        try:
            reshard_state_dict(src, tgt)
        except CheckpointMismatchError as e:
            assert needle in str(e), str(e)
        else:
            raise AssertionError("no error")
        for v in leaves(tgt):
            assert bool((local_of(v) == 7).all()), "a target was written before the error"
    tgt = {"w": dt(torch.zeros(8, 8), m, [Shard(1)]), "extra": torch.zeros(2)}
    try:
        reshard_state_dict(src, tgt)
    except CheckpointMismatchError as e:
        assert "'extra'" in str(e) and "'v'" in str(e), str(e)
    else:
        raise AssertionError("no error")
    rep = reshard_state_dict(src, {"w": dt(torch.zeros(8, 8), m, [Shard(1)])}, strict=False)
    assert rep.unexpected_keys == ["v"], rep


def scenario_verify_catches_flipped_byte(ctx):
    m = init_device_mesh("cpu", (4,))
    W = full((64, 16), seed=120)
    src = {"w": dt(W, m, [Shard(0)])}
    tgt = {"w": dt(torch.zeros(64, 16), m, [Shard(1)])}
    sync = WeightSync(src, tgt, verify=True)

    def flip(sender, receiver, k, buf):
        if sender == 1 and receiver == 2 and k == 0:
            buf[3] ^= 0x40

    transfer._tamper = flip
    try:
        sync.run()
    except CheckpointError as e:
        assert "'w'" in str(e) and "hash" in str(e), str(e)
    else:
        raise AssertionError("a flipped byte went unnoticed")
    finally:
        transfer._tamper = None
    assert sync.torn, "targets must be marked torn after a failed sync"
    sync.run()  # a later good run clears it
    assert not sync.torn and torch.equal(tgt["w"].to_local(), W[:, ctx.rank * 4:(ctx.rank + 1) * 4])


def scenario_plan_reuse_and_each_change_replans(ctx):
    m = init_device_mesh("cpu", (4,))
    W = full((16, 8), seed=130)
    src = {"w": dt(W, m, [Shard(0)])}
    tgt = {"w": dt(torch.zeros(16, 8), m, [Shard(1)])}
    sync = WeightSync(src, tgt)
    assert not sync.run().plan_reused
    src["w"].to_local().add_(1)  # new values, same layout: replayed
    rep = sync.run()
    assert rep.plan_reused and torch.equal(tgt["w"].to_local(), (W + 1)[:, ctx.rank * 2:(ctx.rank + 1) * 2])
    changes = [  # the key change is made on rank 1 only: one rank's change re-plans every rank
        ("key", lambda: (src.__setitem__("w2", torch.ones(3)),
                         tgt.__setitem__("w2", torch.zeros(3)) if ctx.rank == 1 else None)),
        ("shape", lambda: (src.__setitem__("w2", torch.ones(4)), tgt.__setitem__("w2", torch.zeros(4)))),
        ("dtype", lambda: (src.__setitem__("w2", torch.ones(4, dtype=torch.float64)),
                           tgt.__setitem__("w2", torch.zeros(4, dtype=torch.float64)))),
        ("placement", lambda: tgt.__setitem__("w", dt(torch.zeros(16, 8), m, [Shard(0)]))),
    ]
    for name, change in changes:
        change()
        rep = sync.run()
        assert not rep.plan_reused, f"a change of {name} did not re-plan"
        assert sync.run().plan_reused, f"no replay after the {name} change"
    # a change of group
    g = dist.new_group([0, 1, 2, 3])
    sync.process_group = g
    assert not sync.run().plan_reused
    assert sync.run().plan_reused
    assert torch.equal(tgt["w"].to_local(), (W + 1)[ctx.rank * 4:(ctx.rank + 1) * 4])


def scenario_staging_memory_is_bounded(ctx):
    # 32 MiB resharded rows -> columns with 2 MiB buckets: every slice is a strided 2 MiB gather; the peak resident
    # memory above the start (sampled from /proc) stays within 2 x bucket_bytes + the largest slice (+ 4 MiB of
    # allocator slack), and the report's own account agrees
    import os
    import threading
    import time

    m = init_device_mesh("cpu", (4,))
    W = full((4096, 2048), seed=140)
    src = {"w": dt(W, m, [Shard(0)])}
    tgt = {"w": dt(torch.zeros(4096, 2048), m, [Shard(1)])}
    del W
    page = os.sysconf("SC_PAGE_SIZE")

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    sync = WeightSync(src, tgt, bucket_bytes=2 << 20)
    sync.run()  # plans (its own memory is not the transfer's)
    base, peak, stop = rss(), [0], [False]

    def sample():
        while not stop[0]:
            peak[0] = max(peak[0], rss())
            time.sleep(0.0005)

    th = threading.Thread(target=sample)
    th.start()
    rep = sync.run()
    stop[0] = True
    th.join()
    largest = 1024 * 512 * 4
    bound = 2 * (2 << 20) + largest
    assert rep.staging_peak_bytes <= bound, rep
    assert peak[0] - base <= bound + (4 << 20), f"resident memory grew by {(peak[0] - base) / 2**20:.1f} MiB"
    want = full((4096, 2048), seed=140)[:, ctx.rank * 512:(ctx.rank + 1) * 512]
    assert torch.equal(tgt["w"].to_local(), want)
    return [rep.staging_peak_bytes, peak[0] - base]
