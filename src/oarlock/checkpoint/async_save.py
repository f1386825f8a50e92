"""Asynchronous checkpoint saves: snapshot, return, write in the background.

:func:`async_save` runs the collective planning of a save (:func:`oarlock.checkpoint.save.prepare_save`: a
fixed-size fingerprint exchange, one record per class of ranks to rank 0, validation, write assignment) on the caller's process group *before it returns*, so it is ordered with the
training's own collectives like any synchronous call. It then copies the tensors this rank writes into CPU
memory (the snapshot: later in-place updates of the training state do not reach the file) and hands the
writing to a background thread. The thread's own collectives (two small all-gathers of error reports around the
commit) run on a *separate* gloo process group created for this purpose on the first async save, so they never
interleave with collectives of the training on the caller's group. The commit protocol is the synchronous one:
every rank writes and fsyncs its file into a hidden temporary directory, rank 0 writes ``metadata.json`` last
and renames the directory into place.

A new save (async or not) first waits for the previous one
to finish, so saves never overlap; :meth:`AsyncSaveHandle.wait` re-raises the background error, if any.

A save still running when the interpreter exits is not lost: an ``atexit`` hook waits for it to commit, and a
save that failed without anyone calling ``wait()`` is reported on stderr (and the ``oarlock`` logger) naming its
path and error, so a script whose last line is an async save leaves a loadable checkpoint or a loud message.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any, Mapping

import torch

from oarlock.checkpoint.dist import DistWrapper
from oarlock.checkpoint.save import local_tensors, prepare_save, write_and_commit
from oarlock.utils import logger

_lock = threading.Lock()
_pending: "AsyncSaveHandle | None" = None
_side_groups: dict[Any, Any] = {}


class AsyncSaveHandle:
    """A save running in the background. ``wait()`` blocks until the checkpoint is committed (or failed) and
    re-raises the error of the background write (a :class:`~oarlock.checkpoint.errors.CheckpointError`)."""

    def __init__(self, path: str | os.PathLike):
        self.path = path
        self.pinned_bytes = 0  # bytes of the snapshot staged in pinned memory (CUDA tensors)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._reported = False  # the error reached the caller (wait) or stderr (exit)

    def done(self) -> bool:
        """True once the background write has finished (committed or failed)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save is committed (``timeout`` in seconds; None waits forever).

        Raises:
            TimeoutError: still running after ``timeout``. CheckpointError: the save failed.
        """
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"async save to {self.path} still running after {timeout} s")
        if self._error is not None:
            self._reported = True
            raise self._error


def _side_group(process_group: Any) -> Any:
    """A gloo group with the same ranks as ``process_group`` for the background thread's collectives (created
    once per group, by all its ranks: the first async save is collective like every save)."""
    import torch.distributed as dist

    if process_group in _side_groups:
        return _side_groups[process_group]
    ranks = sorted(dist.get_process_group_ranks(process_group if process_group is not None else dist.group.WORLD))
    g = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    _side_groups[process_group] = g
    return g


def async_save(state_dict: Mapping[str, Any], path: str | os.PathLike, *, process_group: Any = None,
               save_replicas: bool = False, overwrite: bool = False) -> AsyncSaveHandle:
    """Save like :func:`~oarlock.checkpoint.api.save_state_dict`, returning as soon as the tensors this rank
    writes are copied to CPU memory -- or, for CUDA tensors, as soon as their copies into reused pinned buffers are
    queued (see :func:`stage`). Collective over ``process_group`` (the planning step, before returning).

    Args:
        state_dict, path, process_group, save_replicas, overwrite: as for ``save_state_dict``.

    Returns:
        An :class:`AsyncSaveHandle`; call ``wait()`` before relying on the checkpoint.

    Raises:
        CheckpointError: planning errors (bad leaves, disagreeing shapes, bad tiling) at once, on every rank;
            write and commit errors from ``handle.wait()``.
    """
    wait_pending()  # saves never overlap: the previous one commits first
    plan = prepare_save(state_dict, path, process_group, save_replicas, overwrite)
    ids = {(i[0], i[1], i[3]) for i in plan.writes.get(plan.rank, [])}
    # the snapshot: a CPU copy of only what this rank writes (pinned and asynchronous for CUDA tensors)
    snap, copied = stage({i: t for i, t in local_tensors(plan.leaves).items() if i in ids})
    group = _side_group(process_group) if DistWrapper(process_group).active else None
    handle = AsyncSaveHandle(path)
    handle.pinned_bytes = sum(t.numel() * t.element_size() for t in snap.values() if t.is_pinned())

    def run() -> None:
        try:
            for e in copied:
                e.synchronize()  # the device-to-host copies have landed in the pinned buffers
            write_and_commit(plan, snap, group)
        except BaseException as e:  # re-raised by wait()
            handle._error = e
        finally:
            snap.clear()

    global _pending
    with _lock:
        handle._thread = threading.Thread(target=run, name="oarlock-async-save", daemon=True)
        handle._thread.start()
        _pending = handle
    return handle


_pinned: dict[tuple, torch.Tensor] = {}  # (key, shape, dtype, device) -> pinned staging buffer, reused


def stage(tensors: Mapping[Any, torch.Tensor]) -> tuple[dict[Any, torch.Tensor], list[Any]]:
    """The snapshot of an async save: CPU copies of ``tensors`` that later in-place updates do not reach.

    CUDA tensors are copied with ``non_blocking=True`` into page-locked (pinned) buffers that are kept and reused
    by the next save of the same key, shape and dtype (saves never overlap, so a buffer is free again by then);
    the copies are queued on each tensor's current stream and this function returns without waiting for them:
    kernels queued later on the same stream (an optimizer step) run after the copy. Work on other streams that
    updates a saved tensor must synchronize with the current stream first. CPU tensors are cloned. Returns
    ``(snapshot, events)``: one CUDA event per device involved (none without CUDA tensors); ``synchronize()`` on
    each waits for the copies.
    """
    snap: dict[Any, torch.Tensor] = {}
    events: list[Any] = []
    with torch.no_grad():
        for k, t in tensors.items():
            t = t.detach()
            if t.device.type == "cuda":
                ident = (k, tuple(t.shape), t.dtype, t.device)
                buf = _pinned.get(ident)
                if buf is None:
                    buf = _pinned[ident] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
                snap[k] = buf
            else:
                snap[k] = t.to("cpu", copy=True)
        for dev in sorted({t.device.index or 0 for t in tensors.values() if t.device.type == "cuda"}):
            with torch.cuda.device(dev):  # the copies were queued on each device's current stream
                e = torch.cuda.Event()
                e.record()
                events.append(e)
    return snap, events


def _report_unseen(h: AsyncSaveHandle) -> None:
    """Say loudly that save ``h`` failed when nobody has seen its error."""
    if h._error is not None and not h._reported:
        h._reported = True
        msg = f"oarlock: async save to {h.path} FAILED, no checkpoint was written: {h._error}"
        logger.error(msg)
        print(msg, file=sys.stderr, flush=True)


@atexit.register
def _wait_at_exit() -> None:
    """At interpreter exit: let the last async save commit (its thread is a daemon and would be killed), and
    report its failure if ``wait()`` was never called."""
    with _lock:
        h = _pending
    if h is not None and h._thread is not None:
        h._thread.join()
        _report_unseen(h)


def wait_pending() -> None:
    """Wait for the last async save of this process, if any (its error, if any, is raised by its handle's
    ``wait()``, not here; an error nobody has seen yet is reported on stderr)."""
    global _pending
    with _lock:
        h = _pending
        _pending = None
    if h is not None and h._thread is not None:
        h._thread.join()
        _report_unseen(h)
