"""Peer-to-peer transport of live resharding: packed byte streams between pairs of ranks, cut into rounds of
bounded size, posted with ``torch.distributed`` point-to-point calls (``docs/live-resharding.md``, "Transport").

The unit is a *stream*: what one rank (the sender) owes another (the receiver), the concatenation of the
bytes of the slices the receiver asked for, in the receiver's order, already cast to the target dtype. Both ends
know the stream's slice sizes, so both cut it identically into *chunks* of at most ``chunk_bytes``: chunk ``k``
of every stream travels in round ``k``. A rank posts every send and receive of round ``k + 1`` before it waits
for round ``k`` (double buffering: packing the next round overlaps the wire), so it holds at most two rounds of
staging; ``chunk_bytes`` is chosen from ``bucket_bytes`` and the largest number of peers any rank has so that
one round's staging on any rank stays within ``bucket_bytes / 2``. Small slices share a chunk (one message for
many tensors); a chunk that is exactly one contiguous slice is sent from the source tensor and received into
the target without staging. Rounds cannot deadlock: in round ``k`` every rank posts all of its operations
before waiting, and the two ends of a stream post its chunks in the same rounds.

Also here: :class:`PeerGroup` / :func:`join_group`, a process group of its own between separately launched jobs
(a trainer under torchrun and an inference engine) that leaves each job's default group alone, and
:class:`PeerDistWrapper`, the :class:`~oarlock.checkpoint.runtime.dist.DistWrapper` contract over it.
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from oarlock.checkpoint.runtime.dist import DistWrapper
from oarlock.checkpoint.errors import CheckpointError

#: Default staging bound of a live reshard (``bucket_bytes``): two rounds in flight stay within it.
DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
_HASH_BYTES = 8

#: Test hook: called as ``_tamper(sender_rank, receiver_rank, round, buffer)`` on every packed chunk after its
#: hash was taken (a test flips a byte to check ``verify=True``). None in normal use.
_tamper: Callable[[int, int, int, torch.Tensor], None] | None = None


# ---------------------------------------------------------------- a group between separately launched jobs

@dataclass
class PeerGroup:
    """A process group made by :func:`join_group`: not registered with ``torch.distributed`` (the jobs keep their
    own default groups), used through its ``ProcessGroup`` object's own methods. Pass it as ``process_group=``.

    Attributes:
        rank, size: this process's rank in the joined group and the group's size.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors).
        pg: the ``torch.distributed`` ``ProcessGroup`` backend object.
        authenticated: every member proved the group's secret (``token=`` / ``$OARLOCK_SYNC_TOKEN``).
        refused: the processes rank 0 refused while the group formed (``"address (claimed rank r: reason)"``), on
            every member.
        verify_key: the key of the chunk hashes of ``verify=True`` (derived from the secret; None without one).
    """

    rank: int
    size: int
    backend: str
    pg: Any = field(repr=False)
    store: Any = field(repr=False, default=None)
    authenticated: bool = False
    refused: list[str] = field(default_factory=list)
    verify_key: bytes | None = field(repr=False, default=None)
    meeting: Any = field(repr=False, default=None)

    def close(self) -> None:
        """Shut the group's connections down (a later use raises)."""
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            shutdown()
        if self.meeting is not None:
            self.meeting.close()


def join_group(host: str, port: int, world_size: int, rank: int, *, backend: str = "gloo",
               timeout: float = 300.0, prefix: str = "oarlock-live", token: str | bytes | None = None) -> PeerGroup:
    """Join a process group of ``world_size`` processes that meet at ``host:port`` (rank 0 listens there, on that
    address only).

    Made for disaggregated reinforcement-learning jobs: a trainer launched by torchrun and an engine launched on
    its own each keep their default group, and every process of both calls ``join_group`` with its rank in the
    joint group (say trainer ranks ``0..T-1``, engine ranks ``T..T+E-1``). Rank 0 admits the others with a
    challenge-response over the shared secret ``token`` (:mod:`oarlock.checkpoint.runtime.rendezvous`): a process
    without it is refused, and rank 0 reports the addresses it refused (:attr:`PeerGroup.refused`). The admitted
    connections carry the group's store; the group is a ``ProcessGroupGloo`` (or ``ProcessGroupNCCL``) built on it.

    Args:
        host, port: where rank 0 listens (use ``127.0.0.1`` on one machine; a host name or an address of one of
            rank 0's interfaces across machines).
        world_size: processes in the joint group; rank: this process's rank in it (``0 <= rank < world_size``).
        backend: ``"gloo"`` or ``"nccl"``.
        timeout: seconds for the rendezvous and for every operation of the group (a dead peer raises within it).
        prefix: key prefix in the group's store.
        token: the group's shared secret (str or bytes), the same on every member; None: the environment variable
            ``OARLOCK_SYNC_TOKEN``. Without either, anyone who reaches ``host:port`` can join (a warning says so
            once when ``host`` is not a loopback address). With one, ``verify=True`` hashes are keyed by it.

    Raises:
        CheckpointError: bad rank/size/backend; the rendezvous timing out (naming host, port and world size).
        RendezvousError: (a ``CheckpointError``) this process refused (no or another secret), rank 0 not proving
            the secret, a rank claimed by two members (naming both addresses).
    """
    import torch.distributed as dist

    from oarlock.checkpoint.runtime import rendezvous

    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        raise CheckpointError(f"join_group: rank {rank!r} is not in a group of world_size {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise CheckpointError(f"join_group: backend {backend!r} is not supported; use 'gloo' or 'nccl'")
    secret = rendezvous.resolve_token(token)
    if secret is None:
        rendezvous.warn_if_open(host)
    td = datetime.timedelta(seconds=float(timeout))
    meeting = None
    try:
        meeting = rendezvous.meet(host, int(port), world_size, rank, secret, float(timeout))
        pstore = dist.PrefixStore(prefix, meeting.store)
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = td
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=meeting.local_address)]
            pg = dist.ProcessGroupGloo(pstore, rank, world_size, opts)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = td
            pg = dist.ProcessGroupNCCL(pstore, rank, world_size, opts)
    except rendezvous.RendezvousError:
        raise
    except (RuntimeError, OSError) as e:
        if meeting is not None:
            meeting.close()
        raise CheckpointError(f"join_group: rendezvous of {world_size} processes at {host}:{port} failed for rank "
                              f"{rank}: {e}") from e
    return PeerGroup(rank, world_size, backend, pg, meeting.store, secret is not None, list(meeting.refused),
                     rendezvous.derived_key(secret, meeting.group_id, b"verify"), meeting)


class _Done:
    """A finished operation (a send to oneself never happens: self-copies do not use the transport)."""

    def wait(self) -> bool:
        return True


class PeerDistWrapper(DistWrapper):
    """:class:`~oarlock.checkpoint.runtime.dist.DistWrapper` over a :class:`PeerGroup` (its ``ProcessGroup``
    methods instead of ``torch.distributed``'s module functions, which only know registered groups)."""

    def __init__(self, group: PeerGroup):
        self.group = group
        self._initialised = True
        self.rank, self.size = group.rank, group.size
        self._pg = group.pg

    @property
    def active(self) -> bool:
        return self.size > 1

    def global_rank(self, r: int) -> int:
        return r

    def comm_device(self) -> torch.device:
        if self.group.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _allreduce(self, t: torch.Tensor, op: Any) -> torch.Tensor:
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self._pg.allreduce([t], opts).wait()
        return t

    def all_min(self, values: list[int]) -> list[int]:
        import torch.distributed as dist

        if not self.active:
            return [int(v) for v in values]
        t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=self.comm_device())
        return [int(v) for v in self._allreduce(t, dist.ReduceOp.MIN).tolist()]

    def all_max_tensor(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if not self.active:
            return t
        return self._allreduce(t.to(self.comm_device()).clone(), dist.ReduceOp.MAX).cpu()

    def _bytes_of(self, obj: Any) -> torch.Tensor:
        data = pickle.dumps(obj)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.comm_device()) if data else \
            torch.empty(0, dtype=torch.uint8, device=self.comm_device())

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.active:
            return [obj]
        buf = self._bytes_of(obj)
        n = torch.tensor([buf.numel()], dtype=torch.int64, device=self.comm_device())
        sizes = [torch.empty_like(n) for _ in range(self.size)]
        self._pg.allgather([sizes], [n]).wait()
        most = max(int(s.item()) for s in sizes)
        padded = torch.zeros(most, dtype=torch.uint8, device=self.comm_device())
        padded[:buf.numel()] = buf
        outs = [torch.empty(most, dtype=torch.uint8, device=self.comm_device()) for _ in range(self.size)]
        self._pg.allgather([outs], [padded]).wait()
        # torch's own object collectives unpickle what group members send in the same way
        return [pickle.loads(o[:int(s.item())].cpu().numpy().tobytes()) for o, s in zip(outs, sizes)]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        import torch.distributed as dist

        if not self.active:
            return obj
        dev = self.comm_device()
        buf = self._bytes_of(obj) if self.rank == src else None
        n = torch.tensor([buf.numel() if buf is not None else 0], dtype=torch.int64, device=dev)
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self._pg.broadcast([n], opts).wait()
        if buf is None:
            buf = torch.empty(int(n.item()), dtype=torch.uint8, device=dev)
        self._pg.broadcast([buf], opts).wait()
        return pickle.loads(buf.cpu().numpy().tobytes()) if self.rank != src else obj

    def _send(self, t: torch.Tensor, dst: int) -> None:  # gather_from's point to point, over the raw group
        self._pg.send([t], dst, 0).wait()

    def _recv(self, t: torch.Tensor, src: int) -> None:
        self._pg.recv([t], src, 0).wait()

    def scatter_from(self, objs: list[Any] | None, src: int = 0) -> Any:
        every = self.broadcast_object(objs, src)
        return every[self.rank] if every else None

    # point to point
    def isend(self, t: torch.Tensor, peer: int, tag: int = 0) -> Any:
        return self._pg.send([t], peer, tag)

    def irecv(self, t: torch.Tensor, peer: int, tag: int = 0) -> Any:
        return self._pg.recv([t], peer, tag)


def wrapper_for(process_group: Any) -> DistWrapper:
    """The :class:`DistWrapper` of ``process_group`` (a registered group, None for the default one, or a
    :class:`PeerGroup`)."""
    if isinstance(process_group, PeerGroup):
        return PeerDistWrapper(process_group)
    return DistWrapper(process_group)


def post(dw: DistWrapper, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]
         ) -> list[Any]:
    """Post every send ``(tensor, peer)`` and receive ``(tensor, peer)`` of one round together (group ranks);
    returns the works to wait on. Registered groups go through ``batch_isend_irecv`` (one NCCL group call)."""
    if not sends and not recvs:
        return []
    if isinstance(dw, PeerDistWrapper):
        if dw.group.backend != "nccl":
            return [dw.isend(t, p) for t, p in sends] + [dw.irecv(t, p) for t, p in recvs]
        # NCCL runs point-to-point calls in order on one stream: a send waiting for its peer's receive would block
        # the receive behind it, so a round goes out as one coalesced group (what batch_isend_irecv does)
        dev = dw.comm_device()
        dw._pg._start_coalescing(dev)
        for t, p in sends:
            dw.isend(t, p)
        for t, p in recvs:
            dw.irecv(t, p)
        return [dw._pg._end_coalescing(dev)]
    import torch.distributed as dist

    ops = [dist.P2POp(dist.isend, t, dw.global_rank(p), dw.group) for t, p in sends]
    ops += [dist.P2POp(dist.irecv, t, dw.global_rank(p), dw.group) for t, p in recvs]
    return list(dist.batch_isend_irecv(ops))


def all_to_all_counts(dw: DistWrapper, counts: list[int]) -> list[int]:
    """Collective: ``counts[r]`` goes to rank ``r``; returns what each rank sent to this one (one ``all_to_all``
    of ``size`` int64s: each rank learns who will send it requests without an all-gather of everyone's lists)."""
    if not dw.active:
        return list(counts)
    dev = dw.comm_device()
    out = torch.empty(dw.size, dtype=torch.int64, device=dev)
    inp = torch.tensor(counts, dtype=torch.int64, device=dev)
    if isinstance(dw, PeerDistWrapper):
        import torch.distributed as dist

        dw._pg.alltoall_base(out, inp, [1] * dw.size, [1] * dw.size, dist.AllToAllOptions()).wait()
    else:
        import torch.distributed as dist

        dist.all_to_all_single(out, inp, group=dw.group)
    return [int(x) for x in out.cpu().tolist()]


# ---------------------------------------------------------------- streams and rounds

@dataclass
class Segment:
    """Bytes ``[start, stop)`` of slice ``index`` of a stream, at ``offset`` in its chunk."""

    index: int
    start: int
    stop: int
    offset: int


#: A slice of at least this many bytes travels in chunks of its own (sent from the source and received into the
#: target without staging when both are contiguous); smaller slices are packed together.
ALONE_BYTES = 1 << 20


def cut_stream(sizes: Sequence[int], chunk_bytes: int, alone: int | None = None,
               units: Sequence[int] | None = None) -> list[list[Segment]]:
    """The chunks of a stream whose slices have ``sizes`` bytes, in order: small slices are packed into chunks of
    at most ``chunk_bytes`` (a slice may straddle two); a slice of ``alone`` bytes or more (default
    :data:`ALONE_BYTES`) starts a new chunk and has its chunks to itself, cut at multiples of its row size
    (``units[i]`` bytes; at least one row a chunk), so each chunk is whole rows that either end can read or write
    in place. Both ends of a stream call this with the same arguments, so they cut it alike."""
    alone = ALONE_BYTES if alone is None else alone
    chunks: list[list[Segment]] = []
    cur: list[Segment] = []
    fill = 0
    for i, n in enumerate(sizes):
        if n >= alone:
            if cur:
                chunks.append(cur)
                cur, fill = [], 0
            u = units[i] if units is not None else 1  # a slice's bytes are whole rows: n is a multiple of u
            step = max(chunk_bytes // u, 1) * u
            for a in range(0, n, step):
                chunks.append([Segment(i, a, min(n, a + step), 0)])
            continue
        a = 0
        while a < n:
            take = min(n - a, chunk_bytes - fill)
            cur.append(Segment(i, a, a + take, fill))
            a += take
            fill += take
            if fill == chunk_bytes:
                chunks.append(cur)
                cur, fill = [], 0
    if cur:
        chunks.append(cur)
    return chunks


def chunk_bytes_for(bucket_bytes: int, fan: int) -> int:
    """Largest chunk such that one round's staging (a chunk per peer, sends and receives) is within
    ``bucket_bytes / 2`` on a rank with ``fan`` peers each way (two rounds are in flight); at least 256 bytes."""
    return max(bucket_bytes // (4 * max(fan, 1)) // 64 * 64, 256)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat ``uint8`` tensor (no copy)."""
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def chunk_hash(buf: torch.Tensor, key: bytes | None = None) -> int:
    """The 8-byte hash of a chunk's bytes, as a signed int64: XXH3-64 (the block hash of
    ``oarlock.checkpoint.integrity``), or with ``key`` (a group's :attr:`PeerGroup.verify_key`) keyed BLAKE2b-64,
    which a process without the key cannot compute for bytes of its own."""
    data = buf.cpu().numpy() if buf.device.type != "cpu" else buf.numpy()
    if key is not None:
        import hashlib

        return int(np.frombuffer(hashlib.blake2b(data, digest_size=8, key=key[:64]).digest(), dtype=np.int64)[0])
    import xxhash

    return int(np.array([xxhash.xxh3_64_intdigest(data)], dtype=np.uint64).view(np.int64)[0])
