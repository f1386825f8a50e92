"""Scenarios of the distributed data-movement tests (test_comm_dist.py), run on 4 gloo ranks (CPU) in one launch
by the multirank harness: a failure names the scenario and the rank.

Node-local disks are simulated with one directory per "node" holding hard links to that node's data files
(ranks 0, 1 on node 0; ranks 2, 3 on node 1). Loaded tensors are compared with slices of the full tensors,
rebuilt from fixed seeds (plain torch). File reads are counted by wrapping ``os.open``/``os.preadv`` (every
data-file read goes through them), communication by wrapping the ``torch.distributed`` calls that move data.
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from multirank import link_files, needs
from oarlock.checkpoint import CheckpointFormatError, load_state_dict, open_checkpoint, save_state_dict
from oarlock.checkpoint.lifecycle.async_save import async_save
from testkit import seeded_tensor

warnings.filterwarnings("ignore")

TENSORS = {"w": ((64, 48), torch.float32, 1), "b": ((40,), torch.bfloat16, 2), "e": ((30, 20), torch.int64, 3),
           "s": ((), torch.float32, 4)}
NODE = {0: 0, 1: 0, 2: 1, 3: 1}
FILES = [f"rank-{i:05d}.safetensors" for i in range(4)]

# ---- instrumentation (installed once per rank process, by the first scenario that loads)
OPENED: list[str] = []  # data files this rank read bytes from
READ: dict[str, int] = {}  # bytes read per data file
CALLS: dict[str, int] = {}
_INSTALLED: list[bool] = []


def _install_counters() -> None:
    if _INSTALLED:
        return
    _INSTALLED.append(True)
    real_open = os.open
    real_preadv = os.preadv
    names: dict[int, str] = {}

    def counting_open(path, flags, *a, **k):
        fd = real_open(path, flags, *a, **k)
        names[fd] = Path(path).name
        return fd

    def counting_preadv(fd, bufs, offset, *a):
        n = real_preadv(fd, bufs, offset, *a)
        name = names.get(fd, "")
        if name.endswith(".safetensors"):  # data reads (headers are read with os.pread)
            if name not in OPENED:
                OPENED.append(name)
            READ[name] = READ.get(name, 0) + n
        return n

    os.open = counting_open
    os.preadv = counting_preadv
    for name in ("send", "recv", "batch_isend_irecv", "broadcast", "all_gather_object",
                 "broadcast_object_list", "all_reduce", "all_gather", "scatter", "gather"):
        real = getattr(dist, name)

        def wrapped(*a, _real=real, _name=name, **k):
            CALLS[_name] = CALLS.get(_name, 0) + 1
            return _real(*a, **k)

        setattr(dist, name, wrapped)


def full(name):
    return seeded_tensor(*TENSORS[name])


def build(lay, zeros):
    sd = {"step": 0 if zeros else 3}
    for name, layout in lay.items():
        t = torch.zeros_like(full(name)) if zeros else full(name)
        sd[name] = t if layout is None else distribute_tensor(t, *layout)
    return sd


def check(tag, sd):
    """Every tensor of ``sd`` equals its slice of the seeded full tensor (dtype included), and step is 3."""
    for name in TENSORS:
        v = sd[name]
        f = full(name)
        if isinstance(v, DTensor):
            shape, off = compute_local_shape_and_global_offset(f.shape, v.device_mesh, v.placements)
            f = f[tuple(slice(o, o + n) for o, n in zip(off, shape))]
            v = v.to_local()
        assert v.dtype == f.dtype, (tag, name, v.dtype, f.dtype)
        assert torch.equal(v, f), (tag, name, "differs from the slice of the full tensor")
    assert sd["step"] == 3, (tag, sd["step"])


_MESHES: dict = {}


def layouts():
    """(saved layout, load layout): name -> (mesh, placements) or None (a plain tensor)."""
    if not _MESHES:  # mesh creation is collective: once per rank process, by the first scenario
        _MESHES["mesh4"], _MESHES["mesh22"] = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
    mesh4, mesh22 = _MESHES["mesh4"], _MESHES["mesh22"]
    src = {"w": (mesh22, [Shard(0), Shard(1)]), "b": (mesh4, [Shard(0)]), "e": (mesh4, [Shard(1)]), "s": None}
    dst = {"w": (mesh22, [Shard(1), Replicate()]), "b": (mesh4, [Replicate()]), "e": (mesh4, [Shard(0)]), "s": None}
    return src, dst


def loaded(tag, lay, path, **kw):
    """Load into zeros with counters reset, check the values; returns (state dict, report, every rank's
    {opened, read, report, calls})."""
    _install_counters()
    sd = build(lay, zeros=True)
    dist.barrier()
    OPENED.clear()
    READ.clear()
    CALLS.clear()
    rep = load_state_dict(sd, path, **kw)
    calls = dict(CALLS)
    opened, nread = list(OPENED), dict(READ)
    check(tag, sd)
    every = [None] * 4
    dist.all_gather_object(every, {"opened": opened, "read": nread, "report": rep, "calls": calls})
    return sd, rep, every


def scenario_save_one_file_per_rank_and_node_views(ctx):
    """The source checkpoint (2x2-mesh / Shard DTensors, a plain tensor, a value) in ctx.shared: one data file per
    rank; rank 0 builds the node views (node 0: files 0, 1 + metadata; node 1: files 2, 3 only)."""
    src, _ = layouts()
    shared = ctx.shared / "shared"
    save_state_dict(build(src, zeros=False), shared)
    with open_checkpoint(shared) as r:
        files = r.metadata.files
    assert files == FILES, files
    if ctx.rank == 0:
        link_files(shared, ctx.shared / "node0", files[:2] + ["metadata.json"])
        link_files(shared, ctx.shared / "node1", files[2:])
        link_files(shared, ctx.shared / "all_but_3", files + ["metadata.json"])
        (ctx.shared / "empty").mkdir()
    dist.barrier()


@needs("save_one_file_per_rank_and_node_views")
def scenario_shared_filesystem_reads_directly(ctx):
    """Every rank sees every file: auto = direct byte-range reads, nothing sent."""
    _, dst = layouts()
    _, _, every = loaded("shared", dst, ctx.shared / "shared")
    got = [(e["report"].comm_method, e["report"].bytes_sent) for e in every]
    assert got == [("direct", 0)] * 4, got


def _node_local(ctx, method: str) -> None:
    """Node-local directories, resharded load: each file read exactly once (by a rank of its node), no byte
    twice, data shipped by grouped send/recv (auto) or broadcast."""
    _, dst = layouts()
    shared = ctx.shared / "shared"
    _, _, every = loaded(method, dst, ctx.shared / f"node{NODE[ctx.rank]}", comm_method=method)
    want = "broadcast" if method == "broadcast" else "grouped_send_recv"
    assert [e["report"].comm_method for e in every] == [want] * 4, [e["report"].comm_method for e in every]
    opened = sorted(f for e in every for f in e["opened"])
    assert opened == FILES, (method, "each file read by exactly one rank", opened)
    for r, e in enumerate(every):
        assert set(e["opened"]) <= set(FILES[2 * NODE[r]:2 * NODE[r] + 2]), (r, "read another node's file",
                                                                             e["opened"])
        assert set(e["opened"]) <= set(e["report"].files_read), (r, e["opened"], e["report"].files_read)
        for f, n in e["read"].items():  # ... and no byte of it twice
            assert n <= (shared / f).stat().st_size, (r, f, n, "bytes read exceed the file")
    sent = sum(e["report"].bytes_sent for e in every)
    assert sent > 0, "node-local reshard sent nothing"
    if method != "broadcast":
        assert sent == sum(e["report"].bytes_received for e in every), "bytes sent != bytes received"
        assert [e["calls"].get("broadcast", 0) for e in every] == [0] * 4, [e["calls"] for e in every]
    else:
        assert [e["calls"].get("batch_isend_irecv", 0) for e in every] == [0] * 4, [e["calls"] for e in every]
    # byte-balanced readers: every rank reads one quarter of the checkpoint here
    reads = [e["report"].bytes_read for e in every]
    assert max(reads) - min(reads) <= max(reads) // 2, ("unbalanced reads", reads)


@needs("save_one_file_per_rank_and_node_views")
def scenario_node_local_auto_uses_grouped_send_recv(ctx):
    _node_local(ctx, "auto")


@needs("save_one_file_per_rank_and_node_views")
def scenario_node_local_grouped_send_recv(ctx):
    _node_local(ctx, "grouped_send_recv")


@needs("save_one_file_per_rank_and_node_views")
def scenario_node_local_broadcast(ctx):
    _node_local(ctx, "broadcast")


@needs("save_one_file_per_rank_and_node_views")
def scenario_node_local_with_aoa_transpose_and_cast(ctx):
    """Node-local with an AOA program: transposed and cast slices travel and are placed correctly."""
    mesh4 = layouts()[1]["e"][0]
    aoa = {"aoa_statements": ["w^T -> wt", "b -> b, dtype = 'float32'"]}
    sd = {"step": 0, "wt": distribute_tensor(torch.zeros(48, 64), mesh4, [Shard(1)]), "b": torch.zeros(40),
          "e": distribute_tensor(torch.zeros(30, 20, dtype=torch.int64), mesh4, [Shard(0)]), "s": torch.zeros(())}
    rep = load_state_dict(sd, ctx.shared / f"node{NODE[ctx.rank]}", aoa_config=aoa, comm_method="grouped_send_recv")
    assert rep.comm_method == "grouped_send_recv", rep.comm_method
    assert torch.equal(sd["wt"].full_tensor(), full("w").T), "wt != w^T"
    assert sd["b"].dtype == torch.float32 and torch.equal(sd["b"], full("b").float()), "b not cast to float32"
    assert torch.equal(sd["e"].full_tensor(), full("e")), "e"
    assert torch.equal(sd["s"], full("s")) and sd["step"] == 3, (sd["s"], sd["step"])


@needs("save_one_file_per_rank_and_node_views")
def scenario_file_visible_to_no_rank_same_error_everywhere(ctx):
    _, dst = layouts()
    if ctx.rank == 0:
        link_files(ctx.shared / "shared", ctx.root / "partial", FILES[:3] + ["metadata.json"])
    dist.barrier()
    target = build(dst, zeros=True)
    try:
        load_state_dict(target, ctx.root / "partial")
        raise AssertionError("missing file not reported")
    except CheckpointFormatError as e:
        msg = str(e)
    assert "rank-00003.safetensors" in msg and "visible to no rank" in msg, msg
    msgs = [None] * 4
    dist.all_gather_object(msgs, msg)
    assert len({re.sub(r"^rank \d+: ", "", m) for m in msgs}) == 1, ("ranks raised different errors", msgs)
    for name in ("w", "b", "e"):  # nothing was written into any destination
        assert not target[name].to_local().any(), name


@needs("save_one_file_per_rank_and_node_views")
def scenario_rank_that_sees_no_file_receives_its_shards(ctx):
    """Rank 3 sees no file at all (not even metadata) and loads its shards in the saved layout."""
    src, _ = layouts()
    path = ctx.shared / ("empty" if ctx.rank == 3 else "all_but_3")
    _, _, every = loaded("blind", src, path)
    assert every[3]["opened"] == [] and every[3]["report"].bytes_read == 0, every[3]
    assert every[3]["report"].bytes_received > 0, every[3]["report"]
    assert sorted(f for e in every for f in e["opened"]) == FILES, [e["opened"] for e in every]


def _replica_layout():
    src, _ = layouts()
    mesh4, mesh22 = src["b"][0], src["w"][0]
    return {"w": (mesh22, [Replicate(), Shard(0)]), "b": (mesh4, [Replicate()]), "e": (mesh4, [Shard(1)]),
            "s": None}


def scenario_save_replicas_gives_a_warm_restart_without_communication(ctx):
    """save_replicas: a same-layout restart from node-local copies reads its own file, moves nothing."""
    rep_lay = _replica_layout()
    save_state_dict(build(rep_lay, zeros=False), ctx.shared / "rep", save_replicas=True)
    with open_checkpoint(ctx.shared / "rep") as r:
        meta = r.metadata
    assert [s.replica_id for s in meta.tensors["w"].shards].count(0) == 2  # two row blocks, 2 copies each
    assert sorted(s.replica_id for s in meta.tensors["b"].shards) == [0, 1, 2, 3]
    mine = f"rank-{ctx.rank:05d}.safetensors"
    link_files(ctx.shared / "rep", ctx.root / f"rep_rank{ctx.rank}", [mine, "metadata.json"])
    dist.barrier()
    _, _, every = loaded("warm", rep_lay, ctx.root / f"rep_rank{ctx.rank}")
    for r, e in enumerate(every):
        assert e["report"].comm_method == "warm", (r, e["report"].comm_method)
        assert e["opened"] == [f"rank-{r:05d}.safetensors"], (r, e["opened"])
        assert e["report"].bytes_sent == e["report"].bytes_received == e["report"].messages_sent == 0, (r, e)
        # the same-layout flag, the agreement that every rank's own file matches its checksums (before any
        # target is written), then that every rank's own read succeeded; no data moved
        assert e["calls"] == {"all_reduce": 3}, (r, e["calls"])
        assert e["report"].bytes_hashed == (ctx.shared / "rep" / f"rank-{r:05d}.safetensors").stat().st_size, \
            (r, e["report"].bytes_hashed)


def scenario_same_restart_without_replicas_reads_planned_ranges(ctx):
    """Without replicas the same restart cannot be local: it falls back to planned direct reads."""
    rep_lay = _replica_layout()
    save_state_dict(build(rep_lay, zeros=False), ctx.root / "norep")
    _, _, every = loaded("norep", rep_lay, ctx.root / "norep")
    assert [e["report"].comm_method for e in every] == ["direct"] * 4, [e["report"].comm_method for e in every]


@needs("save_replicas_gives_a_warm_restart_without_communication")
def scenario_replicated_checkpoint_into_another_layout(ctx):
    """Another layout from a replicated checkpoint: normal planning (direct reads of its files), replicas
    ignored; the values are checked by ``loaded``."""
    _, dst = layouts()
    _, _, every = loaded("rep->dst", dst, ctx.shared / "rep")
    assert [e["report"].comm_method for e in every] == ["direct"] * 4, [e["report"].comm_method for e in every]
    for r, e in enumerate(every):
        assert set(e["opened"]) <= set(FILES), (r, e["opened"])
        assert e["report"].bytes_sent == 0, (r, e["report"].bytes_sent)


def scenario_async_save_while_training_goes_on(ctx):
    """Async save: training (in-place updates + collectives on the default group) goes on while the write is held
    back; the checkpoint holds the state of the save call; a second async save waits for the first and holds the
    later state."""
    import oarlock.checkpoint.runtime.save as api  # the save pipeline writes through save.write_safetensors

    src, _ = layouts()
    gate = threading.Event()
    real_write = api.write_safetensors

    def gated(*a, **k):
        assert gate.wait(60), "gate never opened"
        return real_write(*a, **k)

    api.write_safetensors = gated
    try:
        live = build(src, zeros=False)
        h = save_state_dict(live, ctx.root / "async", async_save=True)
        h.wait_staged()  # the snapshot is taken while the write is held back
        for _ in range(3):  # training steps
            for name in ("w", "b", "e"):
                live[name].to_local().add_(1)
            t = torch.ones(4)
            dist.all_reduce(t)
            assert t[0].item() == 4
        live["step"] = 99
        assert not h.done() and not (ctx.root / "async").exists(), "the held-back save finished early"
        gate.set()
        h2 = async_save(live, ctx.root / "async2")
        h.wait()
        h2.wait()
    finally:
        api.write_safetensors = real_write
    assert (ctx.root / "async2" / "metadata.json").is_file()
    sd = build(src, zeros=True)
    load_state_dict(sd, ctx.root / "async")
    check("async", sd)
    sd = build(src, zeros=True)
    load_state_dict(sd, ctx.root / "async2")
    for name in ("w", "b", "e"):
        assert torch.equal(sd[name].to_local(), live[name].to_local()), (name, "second save lost the later state")
    assert sd["step"] == 99, sd["step"]
    dist.barrier()
