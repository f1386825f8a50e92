"""Asynchronous checkpoint saves: return at once; plan, snapshot and write in the background.

:func:`async_save` does only local work before it returns: it copies the state dict's containers (the tensors to
save are fixed at the call: an entry rebound or added afterwards does not count; JSON values are deep-copied),
records every tensor's version counter and, per CUDA device, an event on the caller's current stream. The shards
are described (DTensor boxes, keys) in the background. The caller's stall is that and nothing else: no
collective, so it does not wait for the slowest rank. The
collective planning of the save (:func:`oarlock.checkpoint.runtime.save.prepare_save`: a fixed-size fingerprint exchange
and, when the keys, shapes, dtypes, placements and group equal those of the previous save, the reuse of its plan)
runs in the background on a *separate* gloo group with the same ranks, created on the first async save, so its
collectives never interleave with the training's own on the caller's group. A planning error (shapes that
disagree between ranks, a refused destination, a bad leaf on any rank) is raised on every rank by
:meth:`AsyncSaveHandle.wait_staged` and :meth:`AsyncSaveHandle.wait`.

In the background, two long-lived threads serve every save of the process (never more); the writer runs at a
lower priority (:func:`background_nice`), so that on CPUs shared with the training it takes a smaller share:

* the **stager** first plans the save (below), then copies the tensors this rank writes, in the order of its
  data file, into buffers kept from the
  previous save of the same shard, shape and dtype (page-locked on CUDA: device-to-host copies with
  ``non_blocking=True`` on a side stream that first waits for the work queued on the caller's stream before the
  call; on CPU: one single-threaded ``numpy.copyto`` per tensor, which releases the GIL and does not compete with
  the training's intra-op thread pool). When the last copy has landed, :meth:`AsyncSaveHandle.wait_staged`
  returns: from then on the training state may change.
* the **writer** writes each tensor as soon as it is staged (the copy of the next tensor overlaps the write of
  this one), hashing its blocks on the way, with writeback to disk started every 16 MiB; then the commit
  protocol of the synchronous save: every rank's file fsynced in a hidden temporary directory holding an
  incomplete-marker, rank 0 writes ``metadata.json`` last and renames the directory into place. The planning's
  collectives (on the stager) and the small agreements around the commit (here) use the separate group, one
  after the other: the writer starts once the plan is settled.

The caller must not update the saved tensors in place before ``wait_staged()`` returns. That is checked: the
version counter of every saved tensor (bumped by every in-place operation, ``optimizer.step()`` included) is
compared after its copy with its value at the call; a tensor changed in between fails the save (its error
raised by ``handle.wait()``; nothing is published). Writes the counter does not see (through ``.data`` or a numpy
view) are not caught. :class:`~oarlock.checkpoint.lifecycle.manager.CheckpointManager` waits for the snapshot before its
``save`` returns, so a loop using the manager needs nothing else.

A new save (async or not) first waits for the previous one to finish, so saves never overlap and the staging
buffers are free again; :meth:`AsyncSaveHandle.wait` re-raises the background error, if any. A save still
running when the interpreter exits is not lost: an ``atexit`` hook waits for it to commit, and a save that failed
without anyone calling ``wait()`` is reported once, naming its path and error: on the ``oarlock`` logger when
logging is configured, else on stderr. A save whose process group is destroyed before it finishes fails on every
rank (nothing is committed): call ``handle.wait()`` before ``destroy_process_group()``.
The exit status stays what the script set (Python gives ``atexit`` hooks no way to change it short of
``os._exit``, which would skip other hooks and lose unflushed files): a job that must fail when its last
checkpoint failed calls ``handle.wait()``. At exit, Python has already ended every ``concurrent.futures`` pool,
so the save's writeback, hashing and uploads run in its own thread then (:func:`oarlock.utils.submit`).
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import weakref
from typing import Any, Mapping

import torch

from oarlock.checkpoint.runtime.dist import DistWrapper
from oarlock.checkpoint.errors import CheckpointError
from oarlock.checkpoint.runtime.save import local_tensors, prepare_save, shard_id, write_and_commit, write_order
from oarlock.checkpoint.model.traversal import collect_leaves, holds_tensor
from oarlock.utils import logger

_lock = threading.Lock()
_pending: "AsyncSaveHandle | None" = None
# user group -> side group, held no longer than the user's group: a kept group keeps its gloo threads running
# past ``destroy_process_group()`` into finalization, where they abort the process (see save._cache_key)
_side_groups: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


class AsyncSaveHandle:
    """A save running in the background.

    ``wait_staged()`` blocks until the snapshot of the tensors is taken (the state may be updated after it);
    ``wait()`` until the checkpoint is committed (or failed), re-raising the error of the background work (a
    :class:`~oarlock.checkpoint.errors.CheckpointError`). ``plan_reused`` tells whether the save reused the
    previous save's plan; ``pinned_bytes`` is the size of the snapshot staged in page-locked memory (CUDA
    tensors), set once staged; ``staged_bytes`` the size of the whole snapshot."""

    def __init__(self, path: str | os.PathLike):
        self.path = path
        self.pinned_bytes = 0
        self.staged_bytes = 0
        self._reused = False
        self._planned = threading.Event()  # set once the background planning is over (planned or failed)
        self._finished = threading.Event()  # set by the writer when committed or failed
        self._stager: "_Stager | None" = None
        self._error: BaseException | None = None
        self._reported = False  # the error reached the caller (wait) or stderr (exit)
        self._callbacks: list[Any] = []
        self._cb_lock = threading.Lock()

    def add_done_callback(self, fn: Any) -> None:
        """Call ``fn(handle)`` once the save has finished (committed or failed: ``fn`` may call :meth:`wait` to
        see which), on the background writer thread, or at once on this thread when it already has (as
        ``concurrent.futures.Future.add_done_callback``). An exception ``fn`` raises is logged, not propagated."""
        with self._cb_lock:
            if not self._finished.is_set():
                self._callbacks.append(fn)
                return
        self._call(fn)

    def _call(self, fn: Any) -> None:
        try:
            fn(self)
        except Exception:  # a caller's callback must not kill the writer thread
            logger.exception("async save to %s: done callback %r raised", self.path, fn)

    def _finish(self) -> None:
        with self._cb_lock:
            self._finished.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            self._call(fn)

    @property
    def plan_reused(self) -> bool:
        """Whether the save reused the previous save's plan (waits for the background planning)."""
        self._planned.wait()
        return self._reused

    def done(self) -> bool:
        """True once the background write has finished (committed or failed)."""
        return self._finished.is_set()

    def staged(self) -> bool:
        """True once the snapshot is taken (or the save gave up on an error before or while staging)."""
        return self._planned.is_set() and (self._stager is None or self._stager.finished.is_set())

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the background no longer reads the saved tensors: the plan is settled and the snapshot
        taken, or the save failed. Call it before updating the saved state in place (``optimizer.step()``).
        ``timeout`` in seconds (None waits forever).

        Raises:
            TimeoutError: still planning or staging after ``timeout``.
            CheckpointError: the planning failed (on every rank alike: bad leaves, disagreeing shapes, a refused
                destination); the snapshot was never taken. Errors of staging and writing are raised by
                :meth:`wait`.
        """
        if not self._planned.wait(timeout):
            raise TimeoutError(f"async save to {self.path}: still planning after {timeout} s")
        if self._stager is None and self._error is not None:
            self._reported = True
            raise self._error
        if self._stager is not None and not self._stager.finished.wait(timeout):
            raise TimeoutError(f"async save to {self.path}: snapshot still being taken after {timeout} s")

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save is committed (``timeout`` in seconds; None waits forever).

        Raises:
            TimeoutError: still running after ``timeout``. CheckpointError: the save failed.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(f"async save to {self.path} still running after {timeout} s")
        if self._error is not None:
            self._reported = True
            raise self._error


def _side_group(process_group: Any) -> Any:
    """A gloo group with the same ranks as ``process_group`` for the background thread's collectives (created
    once per group, by all its ranks: the first async save is collective like every save)."""
    import torch.distributed as dist

    user = process_group if process_group is not None else dist.group.WORLD  # a re-initialised world is new
    g = _side_groups.get(user)
    if g is None:
        ranks = sorted(dist.get_process_group_ranks(user))
        g = _side_groups[user] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return g


def async_save(state_dict: Mapping[str, Any], path: str | os.PathLike, *, process_group: Any = None,
               save_replicas: bool = False, overwrite: bool = False) -> AsyncSaveHandle:
    """Save like :func:`~oarlock.checkpoint.api.save_state_dict`, returning at once: the planning, the snapshot
    and the write run in the background (module docstring). Collective over ``process_group``: every rank calls
    it, in the same order as its other saves; the planning's collectives run on a separate group with the same
    ranks (created by the first call, collectively), never on ``process_group`` itself.

    Call ``handle.wait_staged()`` before updating the saved tensors in place (a tensor updated before its copy
    fails the save), and ``handle.wait()`` before relying on the checkpoint. The values saved are those at the
    call: the state dict's containers are copied (JSON values deep-copied), and the tensors' version counters and
    the CUDA streams' positions recorded, before this returns; the shards are described in the background.

    Args:
        state_dict, path, process_group, save_replicas, overwrite: as for ``save_state_dict``.

    Returns:
        An :class:`AsyncSaveHandle`.

    Raises:
        CheckpointError: from ``handle.wait_staged()`` and ``handle.wait()``: planning errors (bad leaves on any
            rank, disagreeing shapes, bad tiling, a refused destination) on every rank alike; staging, write and
            commit errors from ``handle.wait()``.
    """
    wait_pending()  # saves never overlap: the previous one commits first and its staging buffers are free
    group = _side_group(process_group) if DistWrapper(process_group).active else None
    frozen, counters, locals_ = _capture(state_dict)
    starts = _stream_positions(locals_)
    handle = AsyncSaveHandle(path)

    plan_box: list[Any] = []

    def plan_and_stage() -> None:  # the stage thread, at the caller's priority: the loop waits for the snapshot
        stager = None
        try:
            # the shards are described here, off the caller's path, from the leaves the call captured; each keeps
            # the version counter its leaf had at the call
            live: dict[tuple, torch.Tensor] = {}
            versions: dict[tuple, int | None] = {}
            try:
                origins: list[tuple[Any, int]] = []
                leaves: Any = collect_leaves(frozen, origins)
                live = local_tensors(leaves)
                versions = {shard_id(sw): counters[id(leaf)][i] for sw, (leaf, i) in zip(leaves.shards, origins)}
            except Exception as e:  # reported to every rank by the planning
                leaves = e
            plan = prepare_save(state_dict, path, group, save_replicas, overwrite, leaves=leaves)
            handle._reused = plan.reused
            order = [i for i in write_order(plan) if i in live or i[0] in live]
            idents = [i if i in live else i[0] for i in order]
            stager = _Stager([(i, live[j]) for i, j in zip(order, idents)], [versions[j] for j in idents], starts)
            plan_box.append(plan)
            handle._stager = stager
        except BaseException as e:  # re-raised by wait_staged() and wait()
            handle._error = e
        finally:
            handle._planned.set()
        if stager is not None:
            stager.run()

    def write() -> None:  # the writer thread, at a lower priority (background_nice)
        handle._planned.wait()
        stager = handle._stager
        try:
            if stager is None:  # the planning failed: its error is the save's
                return
            try:
                # the live tensors give the writer shapes and dtypes up front; ``ready`` swaps in each snapshot
                write_and_commit(plan_box[0], dict(stager.items), group, ready=stager.ready)
            finally:
                stager.abort()  # a write that failed early releases the stager
                stager.finished.wait()
                handle.pinned_bytes, handle.staged_bytes = stager.pinned_bytes, stager.staged_bytes
            if stager.error is not None:  # pragma: no cover - ready() raised it inside the write already
                raise stager.error
        except BaseException as e:  # re-raised by wait()
            handle._error = e
        finally:
            if stager is not None:
                stager.snapshot.clear()
            handle._finish()

    global _pending
    with _lock:
        _pending = handle
    # two long-lived threads serve every async save of the process: handing work over is a queue put, the caller
    # never waits for a thread to start
    _STAGE_WORKER.submit(plan_and_stage)
    _WRITE_WORKER.submit(write)
    return handle


def _capture(state_dict: Any) -> tuple[Any, dict[int, list], list[torch.Tensor]]:
    """What :func:`async_save` fixes at the call, cheaply (no shard is described here): a copy of the state dict's
    containers holding the same tensor leaves (JSON values deep-copied), each tensor leaf's version counters (one
    per local tensor: a ShardedTensor has several) by ``id`` of the leaf, and the local tensors (for the CUDA
    stream positions). A state dict that is not a plain dict is passed on as is (collect_leaves reports it)."""
    import copy

    from oarlock.checkpoint.model.sharded import ShardedWeight, is_dtensor, is_sharded_tensor

    counters: dict[int, list] = {}
    locals_: list[torch.Tensor] = []

    def tensors_of(leaf: Any) -> list[torch.Tensor]:
        if isinstance(leaf, ShardedWeight):
            return [leaf.local_tensor]
        if is_dtensor(leaf):
            return [leaf._local_tensor]
        if is_sharded_tensor(leaf):
            return [sh.tensor for sh in leaf.local_shards()]
        return [leaf]

    def freeze(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: freeze(v) for k, v in obj.items()}
        if isinstance(obj, (torch.Tensor, ShardedWeight)):
            ts = tensors_of(obj)
            counters[id(obj)] = [_version(t) for t in ts]
            locals_.extend(ts)
            return obj
        if isinstance(obj, (list, tuple)) and holds_tensor(obj):
            return type(obj)(freeze(v) for v in obj) if type(obj) in (list, tuple) else [freeze(v) for v in obj]
        try:
            return copy.deepcopy(obj)
        except Exception:  # not JSON data either: collect_leaves names it
            return obj

    if not isinstance(state_dict, dict):
        return state_dict, counters, locals_
    return freeze(state_dict), counters, locals_


def _stream_positions(tensors: Any) -> dict[int, Any]:
    """Per CUDA device holding one of ``tensors``, an event recorded on the caller's current stream (the copies
    of the snapshot wait for the work queued before the call)."""
    starts: dict[int, Any] = {}
    for t in tensors:
        if t.device.type == "cuda":
            idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
            if idx not in starts:
                with torch.cuda.device(idx):
                    e = torch.cuda.Event()
                    e.record()  # on the caller's current stream of that device
                    starts[idx] = e
    return starts


class _Worker:
    """One long-lived daemon thread running submitted functions in order (started on first use, and again in a
    forked child, where the parent's thread does not exist)."""

    def __init__(self, name: str, nice: bool = False):
        self.name = name
        self.nice = nice  # lower the thread's priority (background_nice)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = -1

    def submit(self, fn: Any) -> None:
        if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
            self._queue = queue.SimpleQueue()
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._loop, args=(self._queue, self.nice), name=self.name,
                                            daemon=True)
            self._thread.start()
        self._queue.put(fn)

    def stop(self) -> None:
        """Let the thread finish what was submitted, then end, and join it (at interpreter exit: a daemon thread
        still unwinding torch's C++ frames when finalization stops it with ``pthread_exit`` aborts the process,
        "terminate called without an active exception")."""
        t = self._thread
        if t is not None and self._pid == os.getpid() and t.is_alive():
            self._queue.put(None)
            t.join()
        self._thread = None

    @staticmethod
    def _loop(q: queue.SimpleQueue, nice: bool) -> None:
        if nice:
            _lower_priority()
        while True:
            fn = q.get()
            if fn is None:
                return
            fn()  # the functions catch their own errors
            del fn  # the finished save's closure (plan, tensors) is freed here, not at the next get


def background_nice() -> int:
    """The nice increment of the writer thread (``OARLOCK_ASYNC_NICE``, default 8; 0 keeps the caller's priority;
    Linux only). On CPUs shared with the training loop the scheduler then gives the writes, hashing and fsync a
    smaller share while the loop runs (under Linux's CFS a thread's weight drops about 1.25x per nice step: nice 8
    weighs about a sixth of nice 0) and the whole CPU when the loop waits. The stage thread (planning and the
    snapshot, which the loop waits for in ``wait_staged``) keeps the caller's priority.

    Measured on 4 ranks sharing 2 cores (``benchmarks/async_save.py``, 512 MiB, RESULTS.md, 2026-12-04 after the
    writeback requests moved to their own thread), as oarlock's / DCP-with-stager's: nice 3 gave a loop slowdown
    excess (beyond 1x) of 0.80-1.48 over four runs and a commit at 0.18-0.44 of DCP's time; nice 6 0.89 and 0.57;
    nice 8 0.51-0.69 and 0.66-0.71; nice 10 0.38-0.48 and 0.73-1.05. Nice 8 keeps both under the goals (slowdown
    at most 1.1x DCP's, commit no later than DCP's) with a margin for this disk's noise. The loop's total time lost
    hardly depends on it (0.43-0.55 of DCP's at every setting): a lower priority spreads the same work thinner."""
    try:
        return max(0, min(19, int(os.environ.get("OARLOCK_ASYNC_NICE", "8"))))
    except ValueError:
        return 8


def _lower_priority() -> None:
    """Raise the calling thread's nice value by :func:`background_nice` (Linux: ``setpriority`` on the thread id
    applies to that thread alone; elsewhere it would name the process, so nothing is done there)."""
    n = background_nice()
    if n and sys.platform.startswith("linux"):
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + n)
        except OSError:  # not permitted here: run at the caller's priority
            pass


_STAGE_WORKER = _Worker("oarlock-async-stage")
_WRITE_WORKER = _Worker("oarlock-async-save", nice=True)


# ---------------------------------------------------------------- staging

# (shard id, shape, dtype, pinned) -> buffer of the last save; saves never overlap, so a buffer is free again
# when the next save stages. Only the buffers the latest save used are kept.
_buffers: dict[tuple, torch.Tensor] = {}
_side_streams: dict[int, Any] = {}


def release_staging_buffers() -> int:
    """Drop the snapshot buffers kept for the next async save (waits for a save in flight first); returns the
    bytes released. The next async save allocates them again."""
    wait_pending()
    n = sum(b.numel() * b.element_size() for b in _buffers.values())
    _buffers.clear()
    return n


def _side_stream(device: torch.device) -> Any:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _side_streams:
        _side_streams[idx] = torch.cuda.Stream(device=idx)
    return _side_streams[idx]


class _Stager:
    """The snapshot of one async save: ``(shard id, live tensor)`` in file order, copied by :meth:`run` (the
    stager thread) into reused buffers; :meth:`ready` (the writer thread) waits for one of them.

    ``versions`` are the tensors' version counters and ``starts`` the CUDA events (:func:`_stream_positions`),
    both recorded in the caller's thread at the call; each tensor's counter is checked after its copy."""

    def __init__(self, items: list[tuple[tuple, torch.Tensor]], versions: list[int | None], starts: dict[int, Any]):
        self.items = [(i, t.detach()) for i, t in items]
        self.versions = list(versions)
        self.snapshot: dict[tuple, torch.Tensor] = {}
        self.position = {i: n for n, (i, _) in enumerate(items)}
        self.landed = 0  # the first ``landed`` items are staged
        self._cond = threading.Condition()
        self.finished = threading.Event()
        self.error: BaseException | None = None
        self.pinned_bytes = 0
        self.staged_bytes = 0
        self._abort = False
        self._starts = starts

    def abort(self) -> None:
        self._abort = True

    def ready(self, ident: tuple) -> torch.Tensor:
        """Block until the snapshot of ``ident`` is complete and return it. Raises the staging error, if any."""
        n = self.position[ident]
        with self._cond:
            self._cond.wait_for(lambda: self.landed > n or self.finished.is_set())
        if self.error is not None:
            raise self.error
        return self.snapshot[ident]

    def run(self) -> None:
        global _buffers
        kept: dict[tuple, torch.Tensor] = {}
        try:
            with torch.no_grad():
                # copies done or queued, not yet announced to the writer, in file order (CUDA copies with their
                # event, CPU copies with None: announced only after every earlier one, so the order holds)
                pending: list[tuple[tuple, int, Any]] = []
                for n, (ident, t) in enumerate(self.items):
                    if self._abort:
                        break
                    pinned = t.device.type == "cuda"
                    key = (ident, tuple(t.shape), t.dtype, pinned)
                    buf = _buffers.get(key)
                    if buf is None:
                        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned and torch.cuda.is_available())
                    kept[key] = buf
                    self.snapshot[ident] = buf
                    nbytes = buf.numel() * buf.element_size()
                    self.staged_bytes += nbytes
                    if pinned:
                        self.pinned_bytes += nbytes if buf.is_pinned() else 0
                        pending.append((ident, n, self._copy_cuda(buf, t)))
                    else:
                        _copy_cpu(buf, t)
                        pending.append((ident, n, None))
                    while pending and (pending[0][2] is None or pending[0][2].query() or len(pending) > 4):
                        self._land(*pending.pop(0))
                for p in pending:
                    self._land(*p)
        except BaseException as e:
            self.error = e if isinstance(e, CheckpointError) else CheckpointError(
                f"async save: taking the snapshot failed: {type(e).__name__}: {e}")
        finally:
            if self.error is None and len(self.snapshot) < len(self.items):
                self.error = CheckpointError("async save: the snapshot was abandoned (the write failed first)")
            _buffers = kept if self.error is None else {**_buffers, **kept}
            with self._cond:  # a writer waiting for a tensor never staged sees the error
                self.finished.set()
                self._cond.notify_all()

    def _copy_cuda(self, buf: torch.Tensor, t: torch.Tensor) -> Any:
        """Queue the copy of CUDA tensor ``t`` into ``buf`` on the device's side stream; returns its event."""
        idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
        side = _side_stream(t.device)
        with torch.cuda.device(idx), torch.cuda.stream(side):
            side.wait_event(self._starts[idx])
            t.record_stream(side)  # the caching allocator keeps its memory until the copy ran
            buf.copy_(t, non_blocking=True)
            e = torch.cuda.Event()
            e.record(side)
        return e

    def _land(self, ident: tuple, n: int, event: Any) -> None:
        if event is not None:
            event.synchronize()
        self._check_version(n)
        self._advance(n)

    def _advance(self, n: int) -> None:
        with self._cond:
            self.landed = n + 1  # items land in order
            self._cond.notify_all()

    def _check_version(self, n: int) -> None:
        ident, t = self.items[n]
        if self.versions[n] is not None and _version(t) != self.versions[n]:
            raise CheckpointError(f"async save: key {ident[0]!r} (offset {list(ident[1])}) was updated in place "
                                  "before its snapshot was taken; call handle.wait_staged() before changing the "
                                  "saved state (optimizer.step())")


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place update); None for inference tensors, which have none."""
    try:
        return t._version
    except RuntimeError:
        return None


def _copy_cpu(buf: torch.Tensor, t: torch.Tensor) -> None:
    """``buf[...] = t`` for a CPU ``t``: a single-threaded memcpy that releases the GIL (``numpy.copyto`` on the
    bytes) for contiguous tensors, torch's copy otherwise."""
    import numpy as np

    t = t.resolve_conj().resolve_neg()
    if t.numel() == 0:
        return
    if t.is_contiguous() and t.device.type == "cpu":
        np.copyto(buf.reshape(-1).view(torch.uint8).numpy(), t.reshape(-1).view(torch.uint8).numpy())
    else:
        buf.copy_(t)


def _report_unseen(h: AsyncSaveHandle) -> None:
    """Say loudly that save ``h`` failed when nobody has seen its error."""
    if h._error is not None and not h._reported:
        h._reported = True
        msg = f"oarlock: async save to {h.path} FAILED, no checkpoint was written: {h._error}"
        if logger.hasHandlers():  # the application's logging decides where it goes
            logger.error(msg)
        else:  # once, on stderr (logging's last-resort handler would print it a second time)
            print(msg, file=sys.stderr, flush=True)


@atexit.register
def _wait_at_exit() -> None:
    """At interpreter exit: let the last async save commit (its thread is a daemon and would be killed), and
    report its failure if ``wait()`` was never called."""
    with _lock:
        h = _pending
    if h is not None:
        h._finished.wait()
        _report_unseen(h)
    # after the commit the threads still free the save's objects: end them before finalization does
    _WRITE_WORKER.stop()
    _STAGE_WORKER.stop()


def wait_pending() -> None:
    """Wait for the last async save of this process, if any (its error, if any, is raised by its handle's
    ``wait()``, not here; an error nobody has seen yet is reported on stderr)."""
    global _pending
    with _lock:
        h = _pending
        _pending = None
    if h is not None:
        h._finished.wait()
        _report_unseen(h)
