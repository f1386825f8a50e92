"""Rank body of the distributed data-movement tests (launched 4x by test_comm_dist.py, gloo on CPU).

Node-local disks are simulated with one directory per "node" holding hard links to that node's data files
(ranks 0, 1 on node 0; ranks 2, 3 on node 1). Loaded tensors are compared with slices of the full tensors,
rebuilt from fixed seeds (plain torch). File reads are counted by wrapping ``os.open`` (every data-file read
opens the file), communication by wrapping the ``torch.distributed`` calls that move data.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from oarlock.checkpoint import CheckpointFormatError, load_state_dict, open_checkpoint, save_state_dict
from oarlock.checkpoint.async_save import async_save

warnings.filterwarnings("ignore")

TENSORS = {"w": ((64, 48), torch.float32, 1), "b": ((40,), torch.bfloat16, 2), "e": ((30, 20), torch.int64, 3),
           "s": ((), torch.float32, 4)}
NODE = {0: 0, 1: 0, 2: 1, 3: 1}

# ---- instrumentation
OPENED: list[str] = []  # data files this rank read bytes from
READ: dict[str, int] = {}  # bytes read per data file
CALLS: dict[str, int] = {}


def _install_counters() -> None:
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
    shape, dtype, seed = TENSORS[name]
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-10**12, 10**12, shape, generator=g, dtype=torch.int64)
    return torch.randn(shape, generator=g).to(dtype)


def build(lay, zeros):
    sd = {"step": 0 if zeros else 3}
    for name, layout in lay.items():
        t = torch.zeros_like(full(name)) if zeros else full(name)
        sd[name] = t if layout is None else distribute_tensor(t, *layout)
    return sd


def check(tag, sd):
    for name in TENSORS:
        v = sd[name]
        f = full(name)
        if isinstance(v, DTensor):
            shape, off = compute_local_shape_and_global_offset(f.shape, v.device_mesh, v.placements)
            f = f[tuple(slice(o, o + n) for o, n in zip(off, shape))]
            v = v.to_local()
        assert v.dtype == f.dtype and torch.equal(v, f), (tag, name)
    assert sd["step"] == 3, (tag, sd["step"])


def link_view(src: Path, dst: Path, files) -> None:
    """A directory holding hard links to ``files`` of ``src`` (what a node's local disk would hold)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in files:
        os.link(src / f, dst / f)


def run(rank: int, world: int, port: int, root: str) -> None:
    os.environ["OARLOCK_PROGRESS"] = "0"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        _install_counters()
        _run(rank, Path(root))
    finally:
        dist.destroy_process_group()


def loaded(tag, rank, lay, path, **kw):
    """Load into zeros with counters reset; returns (state dict, report, every rank's opened files)."""
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


def _run(rank: int, root: Path) -> None:
    mesh4 = init_device_mesh("cpu", (4,))
    mesh22 = init_device_mesh("cpu", (2, 2))
    src = {"w": (mesh22, [Shard(0), Shard(1)]), "b": (mesh4, [Shard(0)]), "e": (mesh4, [Shard(1)]), "s": None}
    dst = {"w": (mesh22, [Shard(1), Replicate()]), "b": (mesh4, [Replicate()]), "e": (mesh4, [Shard(0)]), "s": None}
    shared = root / "shared"
    save_state_dict(build(src, zeros=False), shared)
    with open_checkpoint(shared) as r:
        files = r.metadata.files
    assert files == [f"rank-{i:05d}.safetensors" for i in range(4)], files
    if rank == 0:  # node 0 keeps the metadata; node 1 has only its data files (metadata is broadcast)
        link_view(shared, root / "node0", files[:2] + ["metadata.json"])
        link_view(shared, root / "node1", files[2:])
        link_view(shared, root / "all_but_3", files + ["metadata.json"])
        (root / "empty").mkdir()
    dist.barrier()
    node = root / f"node{NODE[rank]}"

    # ---- shared filesystem: auto = direct byte-range reads, nothing sent
    _, rep, every = loaded("shared", rank, dst, shared)
    assert all(e["report"].comm_method == "direct" and e["report"].bytes_sent == 0 for e in every)

    # ---- node-local, reshard, grouped send/recv (auto) and broadcast: each file read exactly once
    for method in ("auto", "grouped_send_recv", "broadcast"):
        _, rep, every = loaded(method, rank, dst, node, comm_method=method)
        want = "broadcast" if method == "broadcast" else "grouped_send_recv"
        assert all(e["report"].comm_method == want for e in every), [e["report"].comm_method for e in every]
        opened = sorted(f for e in every for f in e["opened"])
        assert opened == files, (method, opened)  # each file read by one rank
        for r, e in enumerate(every):
            assert set(e["opened"]) <= set(files[2 * NODE[r]:2 * NODE[r] + 2]), (r, e["opened"])
            assert set(e["opened"]) <= set(e["report"].files_read)
            for f, n in e["read"].items():  # ... and no byte of it twice
                assert n <= (shared / f).stat().st_size, (f, n)
        assert sum(e["report"].bytes_sent for e in every) > 0
        if method != "broadcast":
            assert sum(e["report"].bytes_sent for e in every) == sum(e["report"].bytes_received for e in every)
            assert all(e["calls"].get("broadcast", 0) == 0 for e in every)
        else:
            assert all(e["calls"].get("batch_isend_irecv", 0) == 0 for e in every)
        # byte-balanced readers: every rank reads one quarter of the checkpoint here
        reads = [e["report"].bytes_read for e in every]
        assert max(reads) - min(reads) <= max(reads) // 2, reads

    # ---- node-local with an AOA program: transposed and cast slices travel and are placed correctly
    aoa = {"aoa_statements": ["w^T -> wt", "b -> b, dtype = 'float32'"]}
    sd = {"step": 0, "wt": distribute_tensor(torch.zeros(48, 64), mesh4, [Shard(1)]), "b": torch.zeros(40),
          "e": distribute_tensor(torch.zeros(30, 20, dtype=torch.int64), mesh4, [Shard(0)]), "s": torch.zeros(())}
    rep = load_state_dict(sd, node, aoa_config=aoa, comm_method="grouped_send_recv")
    assert rep.comm_method == "grouped_send_recv"
    assert torch.equal(sd["wt"].full_tensor(), full("w").T) and torch.equal(sd["b"], full("b").float())
    assert torch.equal(sd["e"].full_tensor(), full("e")) and torch.equal(sd["s"], full("s")) and sd["step"] == 3

    # ---- a file that no rank can see: the same clear error on every rank
    if rank == 0:
        link_view(shared, root / "partial", files[:3] + ["metadata.json"])
    dist.barrier()
    try:
        load_state_dict(build(dst, zeros=True), root / "partial")
        raise AssertionError("missing file not reported")
    except CheckpointFormatError as e:
        assert "rank-00003.safetensors" in str(e) and "visible to no rank" in str(e), str(e)

    # ---- rank 3 sees no file at all (not even metadata) and loads its shards in the saved layout
    path = root / ("empty" if rank == 3 else "all_but_3")
    _, rep, every = loaded("blind", rank, src, path)
    assert every[3]["opened"] == [] and every[3]["report"].bytes_read == 0
    assert every[3]["report"].bytes_received > 0
    assert sorted(f for e in every for f in e["opened"]) == files

    # ---- save_replicas: a same-layout restart from node-local copies reads its own file, moves nothing
    rep_lay = {"w": (mesh22, [Replicate(), Shard(0)]), "b": (mesh4, [Replicate()]), "e": (mesh4, [Shard(1)]),
               "s": None}
    save_state_dict(build(rep_lay, zeros=False), root / "rep", save_replicas=True)
    with open_checkpoint(root / "rep") as r:
        meta = r.metadata
    assert [s.replica_id for s in meta.tensors["w"].shards].count(0) == 2  # two row blocks, 2 copies each
    assert sorted(s.replica_id for s in meta.tensors["b"].shards) == [0, 1, 2, 3]
    mine = f"rank-{rank:05d}.safetensors"
    link_view(root / "rep", root / f"rep_rank{rank}", [mine, "metadata.json"])
    dist.barrier()
    _, rep, every = loaded("warm", rank, rep_lay, root / f"rep_rank{rank}")
    for r, e in enumerate(every):
        assert e["report"].comm_method == "warm", e["report"].comm_method
        assert e["opened"] == [f"rank-{r:05d}.safetensors"], e["opened"]
        assert e["report"].bytes_sent == e["report"].bytes_received == e["report"].messages_sent == 0
        # the same-layout flag, then the agreement that every rank's own read succeeded; no data moved
        assert e["calls"] == {"all_reduce": 2}, e["calls"]
    # without replicas the same restart cannot be local: it falls back to planned reads
    save_state_dict(build(rep_lay, zeros=False), root / "norep")
    _, rep, every = loaded("norep", rank, rep_lay, root / "norep")
    assert all(e["report"].comm_method == "direct" for e in every)
    # another layout from a replicated checkpoint: normal planning, replicas ignored
    _, rep, every = loaded("rep->dst", rank, dst, root / "rep")
    assert sorted(f for e in every for f in e["opened"]) <= sorted(files * 4)

    # ---- async save: training (in-place updates + collectives on the default group) goes on while the
    # write is held back; the checkpoint holds the state of the save call
    import oarlock.checkpoint.save as api  # the save pipeline writes through save.write_safetensors

    gate = threading.Event()
    real_write = api.write_safetensors

    def gated(*a, **k):
        assert gate.wait(60), "gate never opened"
        return real_write(*a, **k)

    api.write_safetensors = gated
    try:
        live = build(src, zeros=False)
        h = save_state_dict(live, root / "async", async_save=True)
        for _ in range(3):  # training steps
            for name in ("w", "b", "e"):
                live[name].to_local().add_(1)
            t = torch.ones(4)
            dist.all_reduce(t)
            assert t[0].item() == 4
        live["step"] = 99
        assert not h.done() and not (root / "async").exists()
        # a second save before the first finishes waits for it, then runs; it holds the later state
        gate.set()
        h2 = async_save(live, root / "async2")
        h.wait()
        h2.wait()
    finally:
        api.write_safetensors = real_write
    sd = build(src, zeros=True)
    load_state_dict(sd, root / "async")
    check("async", sd)
    sd = build(src, zeros=True)
    load_state_dict(sd, root / "async2")
    for name in ("w", "b", "e"):
        assert torch.equal(sd[name].to_local(), live[name].to_local()), name
    assert sd["step"] == 99
    dist.barrier()
