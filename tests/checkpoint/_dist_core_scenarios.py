"""Scenarios for test_dist_core.py, run on 4 gloo ranks by the ``multirank`` fixture (one rank each).

Every rank of a 4-rank job holds rows ``[2r, 2r + 2)`` of an ``8 x 8`` weight (a row-parallel layout), so every
rank writes its own data file. References come from the ranks' own live tensors, exchanged with
``torch.distributed.all_gather_object``, never from oarlock.
"""

from __future__ import annotations

import shutil

import torch
import torch.distributed as dist
from multirank import raised

from oarlock.checkpoint import (CheckpointError, ShardedWeight, load_sharded_optimizer_state_dict, load_state_dict,
                                save_state_dict, sharded_optimizer_state_dict)
from oarlock.checkpoint.aoa import AOAError, AOASyntaxError
from oarlock.checkpoint.storage import SafetensorsFile

ROWS = 2


def _shard(rank: int, tensor: torch.Tensor, owner: int | None = None) -> ShardedWeight:
    r = rank if owner is None else owner
    return ShardedWeight("w", tensor, (ROWS, 8), (8, 8), (ROWS * r, 0))


def _full_weight() -> torch.Tensor:
    return torch.arange(64, dtype=torch.float32).reshape(8, 8)


def _save_rows(ctx, name: str, **kw) -> None:
    local = _full_weight()[ROWS * ctx.rank:ROWS * ctx.rank + ROWS].clone()
    save_state_dict({"w": _shard(ctx.rank, local)}, ctx.root / name, **kw)


def scenario_malformed_aoa_config_raises_aoa_syntax_error_on_every_rank(ctx):
    _save_rows(ctx, "ck")
    target = torch.zeros(ROWS, 8)
    e = raised(lambda: load_state_dict({"w": _shard(ctx.rank, target)}, ctx.root / "ck",
                                        aoa_config={"aoa_statements": ["w => v"]}))
    assert isinstance(e, AOASyntaxError), f"{type(e).__name__}: {e}"
    assert "aoa_statements[0]" in str(e) and "w => v" in str(e), str(e)
    assert torch.equal(target, torch.zeros(ROWS, 8))  # nothing written


def scenario_unknown_aoa_source_raises_aoa_error_on_every_rank(ctx):
    _save_rows(ctx, "ck")
    e = raised(lambda: load_state_dict({"w": _shard(ctx.rank, torch.zeros(ROWS, 8))}, ctx.root / "ck",
                                        aoa_config={"aoa_statements": ["nothere -> w"]}))
    assert isinstance(e, AOAError) and not isinstance(e, AOASyntaxError), f"{type(e).__name__}: {e}"
    assert "nothere" in str(e), str(e)


def scenario_warm_start_read_error_raises_on_every_rank(ctx):
    """A same-layout restart reads each rank's own file after one agreement; an I/O error on rank 1 at that point
    must reach every rank (before the fix the other ranks returned and went on without rank 1)."""
    _save_rows(ctx, "ck")
    real = SafetensorsFile.read_box

    def failing(self, *a, **k):
        raise OSError("injected I/O error")

    if ctx.rank == 1:
        SafetensorsFile.read_box = failing
    try:
        e = raised(lambda: load_state_dict({"w": _shard(ctx.rank, torch.zeros(ROWS, 8))}, ctx.root / "ck"))
    finally:
        SafetensorsFile.read_box = real
    assert isinstance(e, CheckpointError), f"{type(e).__name__}: {e}"
    want = "OSError: injected I/O error" if ctx.rank == 1 else "rank 1: OSError: injected I/O error"
    assert str(e) == want, str(e)
    # the ranks are still in step: a normal load right after works everywhere
    target = torch.zeros(ROWS, 8)
    report = load_state_dict({"w": _shard(ctx.rank, target)}, ctx.root / "ck")
    assert report.comm_method == "warm"
    assert torch.equal(target, _full_weight()[ROWS * ctx.rank:ROWS * ctx.rank + ROWS])


def scenario_save_error_keeps_its_class_on_every_rank(ctx):
    """Disagreeing global shapes are found by every rank from the gathered descriptions: the same class and
    message everywhere, nothing written."""
    shape = (8, 8) if ctx.rank != 2 else (8, 9)
    sw = ShardedWeight("w", torch.zeros(ROWS, shape[1]), (ROWS, shape[1]), shape, (ROWS * ctx.rank, 0))
    from oarlock.checkpoint import CheckpointMismatchError

    e = raised(lambda: save_state_dict({"w": sw}, ctx.root / "bad"))
    assert type(e) is CheckpointMismatchError, f"{type(e).__name__}: {e}"
    assert "key 'w'" in str(e) and "rank 2" in str(e), str(e)
    assert not (ctx.root / "bad").exists()


def _adam_state(ctx, owner: int) -> tuple[torch.Tensor, torch.optim.Adam, dict]:
    p = torch.nn.Parameter(_full_weight()[ROWS * owner:ROWS * owner + ROWS].clone())
    opt = torch.optim.Adam([p], lr=0.1)
    return p, opt, {"w": _shard(ctx.rank, p.data, owner)}


def scenario_optimizer_resume_with_node_local_directories(ctx):
    """4 ranks, 2 simulated nodes: node 0 (ranks 0, 1) holds metadata.json and rank files 0-1, node 1 (ranks
    2, 3) only rank files 2-3. Each rank resumes the optimizer from its own node's directory, in a layout that
    needs the other node's rows (rank r takes the rows rank (r + 2) % 4 saved)."""
    p, opt, model_sd = _adam_state(ctx, ctx.rank)
    for step in range(2):  # deterministic gradients, different per row
        opt.zero_grad()
        (p * torch.linspace(-1, 1, 8) * (step + 1 + ROWS * ctx.rank)).pow(2).sum().backward()
        opt.step()
    sd = {**model_sd, **sharded_optimizer_state_dict(opt, model_sd)}
    save_state_dict(sd, ctx.root / "shared")
    ref = [None] * ctx.world
    dist.all_gather_object(ref, {"w": p.detach().clone(), **{k: v.clone() for k, v in opt.state[p].items()}})
    if ctx.rank == 0:
        for node, ranks in ((0, (0, 1)), (1, (2, 3))):
            d = ctx.root / f"node{node}"
            d.mkdir()
            for r in ranks:
                for name in (f"rank-{r:05d}.safetensors", f"rank-{r:05d}.safetensors.xxh3"):  # data + its digests
                    shutil.copy(ctx.root / "shared" / name, d)
        shutil.copy(ctx.root / "shared" / "metadata.json", ctx.root / "node0")
    dist.barrier()
    owner = (ctx.rank + 2) % ctx.world
    q, opt2, model_sd2 = _adam_state(ctx, owner)
    q.data.zero_()
    report = load_sharded_optimizer_state_dict(opt2, model_sd2, ctx.root / f"node{ctx.rank // 2}", load_model=True)
    assert report.comm_method == "grouped_send_recv", report.comm_method
    want = ref[owner]
    assert torch.equal(q.detach(), want["w"])
    for name in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(opt2.state[q][name], want[name]), name


def scenario_reshape_load_moves_pieces_between_ranks(ctx):
    """AOA ``reshape=`` on 4 ranks: ``w`` [8, 8] (rank r saved rows 2r, 2r+1) loads as ``v = w.reshape(2, 4, 8)``
    (the mapping adds a unit axis: source boxes [1, 8] land in [1, 1, 8] targets) split on axis 1 (rank r holds
    ``v[:, r]`` = rows r and 4 + r, saved by other ranks), and as ``u = w.reshape(4, 16)`` split by columns, with
    every communication method; the reference is torch's reshape of the full weight."""
    _save_rows(ctx, "ck")
    r = ctx.rank
    want_v = _full_weight().reshape(2, 4, 8)[:, r:r + 1]
    want_u = _full_weight().reshape(4, 16)[:, 4 * r:4 * r + 4]
    for method in ("auto", "grouped_send_recv", "broadcast"):
        v, u = torch.full((2, 1, 8), float("nan")), torch.full((4, 4), float("nan"))
        rep = load_state_dict({"v": ShardedWeight("v", v, (2, 1, 8), (2, 4, 8), (0, r, 0)),
                               "u": ShardedWeight("u", u, (4, 4), (4, 16), (0, 4 * r))}, ctx.root / "ck",
                              aoa_config=["w -> v, reshape=[2, 4, 8]", "w -> u, reshape=[4, 16]"],
                              comm_method=method)
        assert torch.equal(v, want_v), (method, v, want_v)
        assert torch.equal(u, want_u), (method, u, want_u)
        assert rep.comm_method == ("direct" if method == "auto" else method), rep.comm_method


def scenario_fixed_size_agreements_and_gather_if_any(ctx):
    """DistWrapper.agree gives each value all ranks share and None for the others; gather_if_any returns None when
    every rank's result is empty, every rank's results when one is not, and raises one rank's error on all."""
    from oarlock.checkpoint.runtime.dist import DistWrapper

    d = DistWrapper(None)
    got = d.agree([7, ctx.rank, -(2 ** 62), 5 if ctx.rank else 6])
    assert got == [7, None, -(2 ** 62), None], got
    assert d.gather_if_any(lambda: []) is None
    assert d.gather_if_any(lambda: ["x"] if ctx.rank == 2 else []) == [[], [], ["x"], []]

    def fails():
        if ctx.rank == 1:
            raise CheckpointError("rank one's request is bad")
        return []

    err = raised(lambda: d.gather_if_any(fails))
    assert isinstance(err, CheckpointError) and "rank one's request is bad" in str(err), err


def scenario_a_shared_filesystem_reshard_load_gathers_nothing_per_rank(ctx):
    """A column reshard of row-saved DTensors on a shared directory: every collective of the load is a fixed-size
    all-reduce (no all-gather or gather of per-rank data), and the values are exact."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ctx.world,))
    full = {f"k{i}": torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8) + i for i in range(3)}
    save_state_dict({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}, ctx.root / "ck")
    tgt = {k: DTensor.from_local(torch.zeros(64, 8 // ctx.world), mesh, [Shard(1)], shape=torch.Size((64, 8)),
                                 stride=(8, 1), run_check=False) for k in full}
    calls: list[str] = []
    names = ("all_gather", "all_gather_object", "gather", "gather_object", "broadcast_object_list", "all_reduce")
    real = {n: getattr(dist, n) for n in names}
    for n in names:
        setattr(dist, n, (lambda n: lambda *a, **k: calls.append(n) or real[n](*a, **k))(n))
    try:
        load_state_dict(tgt, ctx.root / "ck")
    finally:
        for n in names:
            setattr(dist, n, real[n])
    cols = 8 // ctx.world
    for k, t in tgt.items():
        assert torch.equal(t.to_local(), full[k][:, ctx.rank * cols:(ctx.rank + 1) * cols]), k
    assert calls and set(calls) == {"all_reduce"}, calls


def _held_by_oarlock(targets: list) -> list[str]:
    """Paths from a module-level name of an ``oarlock`` module to any object of ``targets``, through containers,
    functools caches and oarlock objects (weak references do not count)."""
    import gc
    import sys
    import types
    import weakref

    want = {id(t) for t in targets}
    found: list[str] = []
    seen: set[int] = set()

    def walk(obj, path: str, depth: int) -> None:
        if id(obj) in want:
            found.append(path)
            return
        if depth > 8 or id(obj) in seen or isinstance(obj, (weakref.ref, types.ModuleType, type, str, bytes)):
            return
        seen.add(id(obj))
        if isinstance(obj, dict):
            for k, v in list(obj.items()):
                walk(k, f"{path}[key]", depth + 1)
                walk(v, f"{path}[{k!r:.40}]", depth + 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for i, v in enumerate(list(obj)):
                walk(v, f"{path}[{i}]", depth + 1)
        elif type(obj).__name__ == "_lru_cache_wrapper" or type(obj).__module__.startswith("oarlock"):
            for v in gc.get_referents(obj):
                walk(v, f"{path}.<ref>", depth + 1)

    for name, mod in list(sys.modules.items()):
        if name.startswith("oarlock") and mod is not None:
            for k, v in list(vars(mod).items()):
                if not isinstance(v, types.ModuleType):
                    walk(v, f"{name}.{k}", 0)
    return found


def scenario_no_process_group_or_mesh_is_kept_after_dtensor_save_and_load(ctx):
    """After a DTensor save and a reshard load, no oarlock module-level state holds the DeviceMesh (which holds
    its process groups) or the group itself: a kept group keeps its gloo threads running past
    ``destroy_process_group()`` into interpreter finalization (docs/checkpoint-format.md, "Ending a multi-rank
    script"). Before, a DTensor-box cache and the grid memo held both."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ctx.world,))
    full = _full_weight()
    save_state_dict({"w": distribute_tensor(full.clone(), mesh, [Shard(0)])}, ctx.root / "ck")
    out = {"w": distribute_tensor(torch.zeros(8, 8), mesh, [Shard(1)])}
    load_state_dict(out, ctx.root / "ck")
    assert torch.equal(out["w"].to_local(), full.chunk(ctx.world, dim=1)[ctx.rank])
    held = _held_by_oarlock([mesh, dist.group.WORLD])
    assert held == [], held
