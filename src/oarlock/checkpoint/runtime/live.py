"""Live resharding: move tensors from the layout the ranks of a running job hold (``sources``) into another
layout they want filled in place (``targets``), in memory, between the ranks of one process group
(``docs/live-resharding.md``). The weight synchronisation of reinforcement learning is the main use: a trainer
in FSDP/TP/EP pushes its new weights into an inference engine in another TP layout after every step.

The pieces are those of a load through a checkpoint, with the sources' description playing the metadata's role:

1. *Describe the sources* as a save would (:func:`~oarlock.checkpoint.planning.save.describe_rank`): a DTensor is
   one grid rule per mesh, ZeRO flat ranges one flat rule, other shards are listed; ranks with equal descriptions
   form one class and one member of each sends it to rank 0, which builds the layout
   (:func:`~oarlock.checkpoint.planning.save.build_layout`, with the holders of every replicated piece) and
   broadcasts it. The "file" of a stored piece names a rank that holds it.
2. *Plan* each rank's targets against it exactly as a load does (:class:`~oarlock.checkpoint.planning.load.Planner`,
   through AOA when a config is given): every slice of a target gets one source slice; the receiver alone then
   gives each slice of a replicated piece its senders
   (:func:`~oarlock.checkpoint.runtime.live_plan.spread_over_holders`: itself when it holds the piece, else row
   ranges over the holders or the holder it asked least).
3. *Ask*: each receiver sends each of its senders the list of slices it wants (one ``all_to_all`` of counts,
   then one message per pair that has something to move); no rank learns the other ranks' plans.
4. *Move* the bytes in bounded, double-buffered rounds (:mod:`oarlock.checkpoint.runtime.transfer`), cast to the
   target dtype by the sender, permuted into place by the receiver; slices a rank sends itself are copied.

:class:`WeightSync` keeps the plan (steps 1-3) and replays step 4 after a fixed-size fingerprint check.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import torch

from oarlock.checkpoint.runtime import transfer
from oarlock.checkpoint.runtime.dist import DistWrapper
from oarlock.checkpoint.errors import CheckpointError
from oarlock.checkpoint.runtime.live_errors import as_plan_error
from oarlock.checkpoint.runtime.executor import destination_view, place, source_shaped_view
from oarlock.checkpoint.model.mapping import MappingProgram, box_extent
from oarlock.checkpoint.model.traversal import Leaves, collect_leaves
from oarlock.checkpoint.runtime.live_plan import (LivePlan, Recv, ReshardReport, Send, aligned_to,  # noqa: F401
                                                  live_fingerprint, make_plan, quick_signature, row_bytes,
                                                  source_view, strip_layouts)
from oarlock.utils import gc_paused


class _Mover:
    """Step 4 on one rank: local copies, then the rounds (see :mod:`oarlock.checkpoint.runtime.transfer`)."""

    def __init__(self, plan: LivePlan, src: Leaves, tgt: Leaves, dw: DistWrapper, verify: bool,
                 report: ReshardReport, bucket_bytes: int):
        self.plan, self.src, self.tgt, self.dw, self.verify, self.report = plan, src, tgt, dw, verify, report
        self.dev = dw.comm_device()
        c = plan.chunk_bytes
        self.out_chunks = {r: transfer.cut_stream([s.nbytes for s in ss], c, units=[row_bytes(s.box, s.dtype)
                                                                                      for s in ss])
                           for r, ss in plan.sends.items()}
        self.in_chunks = {r: transfer.cut_stream([x.nbytes for x in xs], c, units=[self._unit(x) for x in xs])
                          for r, xs in plan.recvs.items()}
        self.packed: dict[tuple[int, int], torch.Tensor] = {}  # (receiver, slice) -> bytes, while it straddles
        self.staged: dict[tuple[int, int], torch.Tensor] = {}  # (sender, slice) -> bytes being assembled
        self.bad: set[str] = set()
        self.staging = 0  # bytes of send staging made so far (a round's share is its growth while it is packed)
        self.recv_staging = 0  # the same for receive buffers
        self.bucket_bytes = bucket_bytes
        self.hash_key = getattr(getattr(dw, "group", None), "verify_key", None) if verify else None

    def _unit(self, x: Recv) -> int:
        return row_bytes(x.item.src_box, self.tgt.shards[x.leaf].local_tensor.dtype)

    # -- sender side
    def _slice_rows(self, s: Send, a: int, b: int) -> torch.Tensor:
        """Bytes ``[a, b)`` of a slice's stream form (row-aligned for slices that travel alone; the whole slice
        otherwise), cast and gathered into contiguous memory only when it has to be (counted as staging)."""
        v = source_view(self.src.shards[s.leaf].local_tensor, s.flat_start, s.shape, s.box)
        whole = a == 0 and b == s.nbytes
        if not whole:
            u = row_bytes(s.box, s.dtype)
            v = v[a // u:b // u]
        src = v
        if v.dtype != s.dtype:
            v = v.to(s.dtype)
        if v.device != self.dev:
            v = v.to(self.dev)
        out = transfer.as_bytes(v.contiguous())
        if out.data_ptr() != src.data_ptr() or v is not src:
            self.staging += out.numel()  # a cast, a device move or a gather of a strided slice
        return out

    def _small_bytes(self, r: int, i: int, s: Send) -> torch.Tensor:
        """The whole stream form of a small slice (packed with others), kept while it straddles two chunks."""
        got = self.packed.get((r, i))
        if got is None:
            v = source_view(self.src.shards[s.leaf].local_tensor, s.flat_start, s.shape, s.box)
            got = self.packed[(r, i)] = transfer.as_bytes(v.to(device=self.dev, dtype=s.dtype).contiguous())
        return got

    def _pack(self, r: int, k: int) -> torch.Tensor:
        segs = self.out_chunks[r][k]
        slices = self.plan.sends[r]
        n = segs[-1].offset + segs[-1].stop - segs[-1].start
        if len(segs) == 1 and slices[segs[0].index].nbytes >= transfer.ALONE_BYTES:
            sg = segs[0]  # a big slice's rows: from the source, gathered only if strided
            out = self._slice_rows(slices[sg.index], sg.start, sg.stop)
            if self.verify:
                out = torch.cat([out, torch.zeros(transfer._HASH_BYTES, dtype=torch.uint8, device=self.dev)])
                self.staging += out.numel()
        else:
            out = torch.empty(n + (transfer._HASH_BYTES if self.verify else 0), dtype=torch.uint8, device=self.dev)
            self.staging += out.numel()
            for sg in segs:
                out[sg.offset:sg.offset + sg.stop - sg.start] = self._small_bytes(r, sg.index, slices[sg.index])[
                    sg.start:sg.stop]
                if sg.stop == slices[sg.index].nbytes:
                    self.packed.pop((r, sg.index), None)
        if self.verify:
            out[n:] = torch.tensor([transfer.chunk_hash(out[:n], self.hash_key)], dtype=torch.int64).view(torch.uint8)
            if transfer._tamper is not None:
                transfer._tamper(self.dw.rank, r, k, out)
        self.report.messages_sent += 1
        self.report.bytes_sent += n
        return out

    # -- receiver side
    def _direct(self, x: Recv) -> torch.Tensor | None:
        """The target's bytes this slice fills, when they are contiguous and need no permutation."""
        t = self.tgt.shards[x.leaf].local_tensor
        if x.item.permute is not None or t.device != self.dev:
            return None
        v = destination_view(x.item, t)
        return transfer.as_bytes(v) if v.is_contiguous() else None

    def _recv_buffer(self, s: int, k: int) -> torch.Tensor:
        segs = self.in_chunks[s][k]
        n = segs[-1].offset + segs[-1].stop - segs[-1].start
        if len(segs) == 1 and not self.verify:
            sg = segs[0]
            d = self._direct(self.plan.recvs[s][sg.index])
            if d is not None:
                return d[sg.start:sg.stop]
        self.recv_staging += n
        return torch.empty(n + (transfer._HASH_BYTES if self.verify else 0), dtype=torch.uint8, device=self.dev)

    def _unpack(self, s: int, k: int, buf: torch.Tensor) -> None:
        segs = self.in_chunks[s][k]
        xs = self.plan.recvs[s]
        n = segs[-1].offset + segs[-1].stop - segs[-1].start
        self.report.messages_received += 1
        self.report.bytes_received += n
        if self.verify:
            sent = int(buf[n:].cpu().clone().view(torch.int64)[0])
            if sent != transfer.chunk_hash(buf[:n], self.hash_key):
                self.bad.update(xs[sg.index].item.dst_key for sg in segs)
                for sg in segs:
                    self.staged.pop((s, sg.index), None)
                return
        for sg in segs:
            x = xs[sg.index]
            if x.item.dst_key in self.bad:
                continue
            part = buf[sg.offset:sg.offset + sg.stop - sg.start]
            d = self._direct(x)
            if d is not None:
                if d.data_ptr() + sg.start != part.data_ptr():
                    d[sg.start:sg.stop].copy_(part)
                continue
            t = self.tgt.shards[x.leaf].local_tensor
            whole = sg.start == 0 and sg.stop == x.nbytes
            if not whole and x.nbytes >= transfer.ALONE_BYTES and x.item.permute is None:
                u = self._unit(x)  # whole rows of a big slice: straight into their rows of the target
                rows = source_shaped_view(x.item, t)[sg.start // u:sg.stop // u]
                rows.copy_(aligned_to(part, t).view(t.dtype).view(rows.shape))
                continue
            st = part if whole else self.staged.get((s, sg.index))
            if st is None:
                st = self.staged[(s, sg.index)] = torch.empty(x.nbytes, dtype=torch.uint8, device=self.dev)
            if not whole:
                st[sg.start:sg.stop].copy_(part)
            if sg.stop == x.nbytes:
                self.staged.pop((s, sg.index), None)
                place(aligned_to(st, t).view(t.dtype).view(box_extent(x.item.src_box)), x.item, t)

    # -- the whole transfer
    def run(self) -> None:
        """Post rounds in order while the staging of the rounds in flight is within the bound (zero-copy rounds
        cost none, so they all go out at once), copy this rank's own slices while the first rounds are on the
        wire, then wait for and unpack the rounds in order. Every rank posts round ``k`` before it waits for
        round ``k``, so the rounds complete whatever each rank's window. (Packing the next round in a thread
        was tried: no faster on the benchmark, and it held a round more of staging.)"""
        from collections import deque

        rep = self.report
        rounds = max([len(c) for c in self.out_chunks.values()] + [len(c) for c in self.in_chunks.values()] + [0])
        rep.rounds = rounds
        budget = self.bucket_bytes

        def pack_round(k: int) -> tuple[list, int]:
            with torch.no_grad():
                before = self.staging
                sends = [(self._pack(r, k), r) for r in sorted(self.out_chunks) if k < len(self.out_chunks[r])]
                return sends, self.staging - before

        with torch.no_grad():
            flight: deque = deque()
            held = 0
            nxt = 0

            def start(k: int) -> tuple[int, list, list, int]:
                sends, staged = pack_round(k)
                before = self.recv_staging
                recvs = [(self._recv_buffer(s, k), s) for s in sorted(self.in_chunks) if k < len(self.in_chunks[s])]
                return k, transfer.post(self.dw, sends, recvs), recvs, staged + self.recv_staging - before

            def fill() -> None:
                nonlocal nxt, held
                while nxt < rounds and (not flight or held < budget) and len(flight) < 64:
                    got = start(nxt)
                    flight.append(got)
                    held += got[3]
                    rep.staging_peak_bytes = max(rep.staging_peak_bytes, held + self._assembling())
                    nxt += 1

            fill()
            local = 0
            for s, x in self.plan.local:  # while the first rounds travel
                v = source_view(self.src.shards[s.leaf].local_tensor, s.flat_start, s.shape, s.box)
                t = self.tgt.shards[x.leaf].local_tensor
                place(v if v.dtype == t.dtype else v.to(t.dtype), x.item, t)
                local += x.nbytes
            while flight:
                k, works, recvs, staged = flight.popleft()
                for w in works:
                    w.wait()
                for buf, s in recvs:
                    self._unpack(s, k, buf)
                held -= staged
                del works, recvs
                fill()
        rep.bytes_local += local
        rep.bytes_sent += local
        rep.bytes_received += local

    def _assembling(self) -> int:
        """Staging that outlives a round: small slices straddling two chunks, on either end."""
        return sum(t.numel() for t in self.staged.values()) + sum(t.numel() for t in self.packed.values())


# ---------------------------------------------------------------- public API

class WeightSync:
    """Plan once, replay every step: a live reshard from ``sources`` into ``targets`` kept ready for repeated
    :meth:`run` calls (the weight sync of an RL loop). Collective over ``process_group``: every rank builds one
    and calls :meth:`run` the same number of times.

    The first :meth:`run` plans (:func:`reshard_state_dict`); later runs check one fixed-size fingerprint of every
    rank's keys, shapes, dtypes, boxes, placements, devices and group (one ``all_reduce`` of a flag, nothing per
    shard) and, when no rank's changed, only move bytes; any change re-plans. The state dicts are read again at
    every run, so tensors replaced by new ones of the same description are picked up.

    Args: as :func:`reshard_state_dict`.

    Attributes:
        plan_reused: whether the last :meth:`run` replayed the previous plan.
        torn: True on a rank whose targets a failed run may have written part of (cleared by a later successful
            run); an inference engine must not serve from torn weights.
    """

    def __init__(self, sources: Mapping[str, Any], targets: Mapping[str, Any], *, process_group: Any = None,
                 aoa_config: Any = None, program: MappingProgram | None = None, strict: bool = True,
                 bucket_bytes: int | None = None, verify: bool = False):
        if aoa_config is not None and program is not None:
            raise CheckpointError("pass either aoa_config or program, not both")
        if bucket_bytes is None:
            bucket_bytes = transfer.DEFAULT_BUCKET_BYTES
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise CheckpointError(f"bucket_bytes must be a positive int (bytes), got {bucket_bytes!r}")
        self.sources, self.targets = sources, targets
        self.process_group, self.aoa_config, self.program = process_group, aoa_config, program
        self.strict, self.bucket_bytes, self.verify = strict, bucket_bytes, verify
        self._plan: LivePlan | None = None
        self._described: tuple | None = None  # (quick signature, (source leaves, target leaves, fingerprint))
        self.plan_reused = False
        self.torn = False

    def run(self) -> ReshardReport:
        """Move the sources' current values into the targets (collective).

        Returns:
            this rank's :class:`ReshardReport`.

        Raises:
            PlanError: (every rank, before any byte moves; no target written, :attr:`torn` not set by it) always
                also an instance of the error's own class:
                ``CheckpointMismatchError``: a target's global shape or dtype differs from what its sources give
                (naming the target key, the source keys it is made from, both shapes and dtypes, and the AOA
                statement only when the user wrote it), or missing/unexpected keys under ``strict``;
                ``AOAError``: a bad AOA config; ``CheckpointError``: the group broken before the run.
            CheckpointError: the transfer failed on some rank (a peer died, a timeout, a chunk whose hash did not
                match with ``verify=True``, naming the keys): raised on every rank with ``phase = "transfer"``,
                :attr:`torn` set where targets may hold a mix of old and new values.
        """
        t0 = time.perf_counter()
        try:
            dw, plan, src, tgt, reuse = self._prepare()
        except Exception as e:  # before any byte moved: the targets hold their old values
            raise as_plan_error(e)
        rep = ReshardReport(list(plan.missing), list(plan.unexpected), list(plan.skipped), plan_reused=reuse)
        rep.plan_seconds = time.perf_counter() - t0
        self.plan_reused = reuse
        if plan.recvs or plan.local:
            self.torn = True
        mover = _Mover(plan, src, tgt, dw, self.verify, rep, self.bucket_bytes)
        err: BaseException | None = None
        try:
            mover.run()
            if mover.bad:
                raise CheckpointError(f"live reshard: chunks received by rank {dw.rank} do not match the hash their "
                                      f"sender took (verify=True): keys {sorted(mover.bad)} hold corrupted bytes")
        except Exception as e:
            err = e
        try:
            dw.check(err)
        except CheckpointError as e:
            raise _transfer_error(f"{e}{self._torn_note()}") from e
        except Exception as e:  # the group itself failed (a dead peer, a timeout)
            raise _transfer_error(f"live reshard failed on rank {dw.rank}: {type(e).__name__}: {e}"
                                  f"{self._torn_note()}") from e
        self.torn = False
        rep.seconds = time.perf_counter() - t0
        return rep

    def _prepare(self) -> tuple:
        """Steps 1-3 (or the fingerprint check of a replay): ``(dist wrapper, plan, source leaves, target leaves,
        reused)``. Collective; raises alike on every rank, before any byte moves."""
        dw = transfer.wrapper_for(self.process_group)
        with gc_paused():
            settings = (repr(self.aoa_config), id(self.program), self.strict, self.bucket_bytes, self.verify)
            quick = (quick_signature(self.sources), quick_signature(self.targets), id(self.process_group),
                     settings)
            if self._described is not None and self._described[0] == quick:
                src, tgt, fp = self._described[1]  # the same tensor objects as last run: described already
            else:
                src, tgt = collect_leaves(self.sources), collect_leaves(self.targets)
                if isinstance(dw, transfer.PeerDistWrapper):
                    strip_layouts(src)
                    strip_layouts(tgt)
                fp = live_fingerprint(src, tgt, dw, settings)
                self._described = (quick, (src, tgt, fp))
            same = self._plan is not None and self._plan.fingerprint == fp
            try:
                reuse = dw.all_true(same) if dw.active else same
            except RuntimeError as e:  # the group itself is broken (a peer died before this run)
                raise CheckpointError(f"live reshard failed on rank {dw.rank} before any byte moved: "
                                      f"{type(e).__name__}: {e}") from e
            if not reuse:
                self._plan = None
                self._plan = make_plan(src, tgt, dw, self.aoa_config, self.program, self.strict, self.bucket_bytes,
                                       fp)
        return dw, self._plan, src, tgt, reuse

    def _torn_note(self) -> str:
        return " (this rank's targets are torn: part old, part new values; run again)" if self.torn else ""


def _transfer_error(message: str) -> CheckpointError:
    err = CheckpointError(message)
    err.phase = "transfer"  # type: ignore[attr-defined]
    return err


def reshard_state_dict(sources: Mapping[str, Any], targets: Mapping[str, Any], *, process_group: Any = None,
                       aoa_config: Any = None, program: MappingProgram | None = None, strict: bool = True,
                       bucket_bytes: int | None = None, verify: bool = False) -> ReshardReport:
    """Collective: fill every rank's ``targets`` in place from the tensors the ranks hold in ``sources``, in memory.

    Each rank passes what it holds and what it wants (either may be ``{}``): nested dicts of tensors (whole, treated
    as replicated), DTensors on any mesh and placements, :class:`~oarlock.checkpoint.ShardedWeight` s (ZeRO flat
    ranges included); JSON values are left alone (tensors only move). Target keys are matched to source keys through
    AOA exactly as a load matches checkpoint keys (rename, fused qkv/ffn, split, transpose, cast, macros, presets).
    Bytes go from one holder straight to each rank that needs them (``batch_isend_irecv``: NCCL for CUDA, gloo for
    CPU); no rank gathers a tensor it does not hold as a target; each slice of a replicated source is sent by its
    holders in turn or in row ranges, balanced by bytes. Staging is bounded by ``bucket_bytes`` plus the largest
    slice that straddles a chunk.

    Args:
        sources, targets: this rank's state dicts (targets are written in place).
        process_group: a ``torch.distributed`` group (None: the default group, or one process), or a
            :class:`~oarlock.checkpoint.runtime.transfer.PeerGroup` from :func:`~oarlock.checkpoint.join_group`.
        aoa_config / program: how target keys map to source keys (docs/aoa.md); default: same keys.
        strict: raise on missing or unexpected keys (before any byte moves).
        bucket_bytes: staging bound in bytes (default :data:`~oarlock.checkpoint.runtime.transfer.DEFAULT_BUCKET_BYTES`,
            256 MiB): two rounds of chunks in flight stay within it.
        verify: hash every chunk on both sides (XXH3-64; over a :func:`~oarlock.checkpoint.join_group` group with
            a secret, BLAKE2b keyed by it) and fail naming the keys of a chunk that differs.

    Returns:
        this rank's :class:`ReshardReport`.

    Raises:
        as :meth:`WeightSync.run`.
    """
    return WeightSync(sources, targets, process_group=process_group, aoa_config=aoa_config, program=program,
                      strict=strict, bucket_bytes=bucket_bytes, verify=verify).run()
