"""The distributed core of every collective checkpoint step: one object, :class:`DistWrapper`, over a
``torch.distributed`` process group (or over nothing, in a single process).

Every collective step of save, load, optimizer resume, conversion and export goes through it, so that

* without an initialised process group (or with a group of one rank) every call is a local no-op;
* a step that fails on some ranks fails on *every* rank, with the **same exception class** and message
  (``AOAError``, ``AOASyntaxError``, ``CheckpointMismatchError``, ``OptimizerStateError``, ... stay what they
  are, so ``except AOAError`` works on every rank); the failing rank re-raises its own exception object, the
  others raise the same class with the message prefixed by ``"rank R: "``. Errors that are not oarlock errors
  (``OSError``, ``RuntimeError``, ...) become :class:`~oarlock.checkpoint.errors.CheckpointError` naming the
  original type, again alike on every rank;
* no rank is left out of step: a step either completes on every rank or raises on every rank, each rank having
  issued the same collectives.

Contract for code built on it (other modules and new formats):

``DistWrapper(group)``
    ``rank``, ``size``, ``active`` (a process group with more than one rank), ``is_coordinator`` (rank 0),
    ``global_rank(r)``, ``comm_device()`` (CUDA for NCCL, CPU otherwise).
``all_gather_object(obj) -> list``; ``broadcast_object(obj, src) -> obj``; ``all_true(flag) -> bool``;
``all_min(values) -> list[int]``; ``all_max_tensor(t) -> Tensor``; ``gather_to(obj, dst) -> list | None``;
``gather_from(obj, senders, dst) -> dict | None``; ``scatter_from(objs, src) -> obj``
    Plain collectives (``[obj]``, ``obj``, ``flag``, ``values`` and ``t`` without a group); the last two reach one
    rank or come from one rank, so a coordinator's traffic does not land on every rank (``gather_from``: only
    the named senders' bytes).
``check(error)``
    Collective: every rank passes its exception or None; raises on every rank when any rank failed (one
    ``all_reduce`` of a flag on success, plus one ``all_gather_object`` of the reports on failure).
``run(fn, *args, **kw)``
    Collective: ``fn`` runs locally, then :meth:`check` is applied; returns ``fn``'s result on every rank.
``gather(fn, *args, **kw) -> list``
    Collective: ``fn`` runs locally, its result (or error) is all-gathered in one exchange; raises alike on every
    rank when any rank failed, else returns every rank's result in group-rank order.

Messages are exchanged with ``all_gather_object`` (torch's own pickling between the ranks of one job); an error
travels as its class's module, qualified name and message, and is rebuilt only from classes of ``oarlock`` or
Python's builtins.
"""

from __future__ import annotations

import builtins
import importlib
from typing import Any, Callable, NamedTuple, Sequence

import torch

from oarlock.checkpoint.errors import CheckpointError
from oarlock.errors import OarlockError


class ErrorReport(NamedTuple):
    """One rank's failure as it travels between ranks."""

    rank: int
    module: str
    qualname: str
    message: str
    oarlock: bool  # an OarlockError subclass: its class is kept on every rank


def dist_active() -> bool:
    """True when torch.distributed is available and a default process group is initialised."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def fingerprint_words(text: str) -> list[int]:
    """Two non-negative 62-bit ints from the SHA-256 of ``text``: a fixed-size stand-in for a string in
    :meth:`DistWrapper.agree` (equal texts, equal words; a collision needs 124 bits to match)."""
    import hashlib

    d = hashlib.sha256(text.encode()).digest()
    return [int.from_bytes(d[:8], "little") >> 2, int.from_bytes(d[8:16], "little") >> 2]


def error_report(e: BaseException, rank: int) -> ErrorReport:
    """``e`` as it travels to the other ranks (class module, name, message)."""
    cls = type(e)
    return ErrorReport(rank, cls.__module__, cls.__qualname__, str(e), isinstance(e, OarlockError))


def _error_class(rep: ErrorReport) -> type[BaseException] | None:
    """The exception class a report names, only from oarlock modules or builtins; None when unresolvable."""
    if not (rep.module == "builtins" or rep.module == "oarlock" or rep.module.startswith("oarlock.")):
        return None
    try:
        obj: Any = builtins if rep.module == "builtins" else importlib.import_module(rep.module)
        for part in rep.qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return obj if isinstance(obj, type) and issubclass(obj, BaseException) else None


def rebuild_error(rep: ErrorReport, rank: int) -> BaseException:
    """The exception rank ``rank`` raises for another rank's failure ``rep`` (same class for oarlock errors)."""
    text = rep.message if rep.oarlock else f"{rep.qualname}: {rep.message}"
    msg = text if rep.rank == rank else f"rank {rep.rank}: {text}"
    if rep.oarlock:
        cls = _error_class(rep)
        if cls is not None:
            try:
                return cls(msg)
            except Exception:  # a constructor with another signature: keep the message at least
                pass
        return CheckpointError(f"{rep.qualname}: {msg}")
    return CheckpointError(msg)


GROUP_DESTROYED = ("the process group of this checkpoint operation was destroyed before it finished "
                   "(torch.distributed is no longer initialised); nothing is committed. An async save must finish "
                   "first: call handle.wait() (or CheckpointManager.wait()) before destroy_process_group()")


class DistWrapper:
    """Collectives and error agreement over ``group`` (None: the default group, or a single process).

    See the module docstring for the contract. Cheap to build; holds no state besides the group.
    """

    def __init__(self, group: Any = None):
        self.group = group
        self._initialised = dist_active()
        if group is not None and not self._initialised:
            raise CheckpointError(GROUP_DESTROYED)
        if self._initialised:
            import torch.distributed as dist

            self.rank = dist.get_rank(group)
            self.size = dist.get_world_size(group)
        else:
            self.rank, self.size = 0, 1

    @property
    def active(self) -> bool:
        """A real process group with more than one rank (collectives communicate).

        Raises:
            CheckpointError: the group existed when this wrapper was made and torch.distributed has since been
                shut down (a save or load must never go on as a single process then: it would commit alone).
        """
        if self._initialised and not dist_active():
            raise CheckpointError(GROUP_DESTROYED)
        return self._initialised and self.size > 1

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def global_rank(self, r: int) -> int:
        """The global rank of group rank ``r`` (for point-to-point calls and ``src`` arguments)."""
        if not self._initialised or self.group is None:
            return r
        import torch.distributed as dist

        return dist.get_global_rank(self.group, r)

    def comm_device(self) -> torch.device:
        """Where tensors exchanged over this group must live: CUDA for NCCL, else CPU."""
        if not self._initialised:
            return torch.device("cpu")
        import torch.distributed as dist

        if "nccl" in str(dist.get_backend(self.group)).lower():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ------------------------------------------------------------ plain collectives

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in group-rank order (``[obj]`` without a group)."""
        if not self.active:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Group rank ``src``'s ``obj`` on every rank."""
        if not self.active:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=self.global_rank(src), group=self.group)
        return box[0]

    def gather_to(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` on group rank ``dst`` only (None elsewhere): what a coordinator collects without
        every rank receiving everything (``[obj]`` without a group)."""
        if not self.active:
            return [obj]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.size if self.rank == dst else None
        dist.gather_object(obj, out, dst=self.global_rank(dst), group=self.group)
        return out

    def gather_from(self, obj: Any, senders: Any, dst: int = 0) -> dict[int, Any] | None:
        """``{rank: obj}`` of the ranks in ``senders`` (the same set on every rank) on group rank ``dst`` only (None
        elsewhere). Point to point, one length and one payload per sender: ``dst`` receives the senders' bytes and
        nothing for the other ranks (``torch.distributed.gather_object`` pads every rank's object to the largest,
        so one large record would cost ``dst`` world x its size)."""
        senders = sorted({int(r) for r in senders})
        if not self.active:
            return {self.rank: obj} if self.rank in senders or not senders else {}
        import pickle

        dev = self.comm_device()
        if self.rank == dst:
            out = {dst: obj} if dst in senders else {}
            for r in senders:
                if r == dst:
                    continue
                n = torch.empty(1, dtype=torch.int64, device=dev)
                self._recv(n, r)
                buf = torch.empty(int(n.item()), dtype=torch.uint8, device=dev)
                self._recv(buf, r)
                out[r] = pickle.loads(buf.cpu().numpy().tobytes())  # torch's own object collectives do the same
            return out
        if self.rank in senders:
            data = pickle.dumps(obj)
            self._send(torch.tensor([len(data)], dtype=torch.int64, device=dev), dst)
            self._send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev), dst)
        return None

    def _send(self, t: torch.Tensor, dst: int) -> None:
        """Blocking send of ``t`` to group rank ``dst`` (a subclass over another kind of group overrides it)."""
        import torch.distributed as dist

        dist.send(t, dst=self.global_rank(dst), group=self.group)

    def _recv(self, t: torch.Tensor, src: int) -> None:
        """Blocking receive into ``t`` from group rank ``src``."""
        import torch.distributed as dist

        dist.recv(t, src=self.global_rank(src), group=self.group)

    def scatter_from(self, objs: list[Any] | None, src: int = 0) -> Any:
        """Rank ``src`` gives each rank ``r`` its ``objs[r]``; returns this rank's (``objs[0]`` without a
        group)."""
        if not self.active:
            return objs[0] if objs else None
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.scatter_object_list(box, objs if self.rank == src else None, src=self.global_rank(src),
                                 group=self.group)
        return box[0]

    def all_true(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on every rank (one ``all_reduce`` MIN of an int)."""
        return bool(self.all_min([1 if flag else 0])[0])

    def all_min(self, values: list[int]) -> list[int]:
        """Element-wise minimum over the ranks of ``values`` (ints within int64; one ``all_reduce`` MIN)."""
        if not self.active:
            return [int(v) for v in values]
        import torch.distributed as dist

        t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=self.comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return [int(v) for v in t.tolist()]

    def all_max_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum over the ranks of the 1-D int64 CPU tensor ``t`` (the same length on every rank;
        one ``all_reduce`` MAX, on the backend's device); a CPU tensor, ``t`` itself without a group."""
        if not self.active:
            return t
        import torch.distributed as dist

        dev = self.comm_device()
        buf = t.to(dev) if dev != t.device else t.clone()
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
        return buf.cpu()

    def min_max(self, values: Sequence[int]) -> tuple[list[int], list[int]]:
        """Collective, fixed size: the element-wise minimum and maximum over the ranks of ``values`` (ints within
        +-(2**63 - 1)). One ``all_reduce`` MIN of ``2 x len(values)`` int64s whatever the world size: each value
        and its negation (the minimum of the negations is minus the maximum). Alone: the values, twice."""
        vals = [int(v) for v in values]
        got = self.all_min(vals + [-v for v in vals])
        n = len(vals)
        return got[:n], [-x for x in got[n:]]

    def agree(self, values: Sequence[int]) -> list[int | None]:
        """Collective, fixed size (:meth:`min_max`): for each of ``values``, that value when every rank passed the
        same one, else None."""
        lo, hi = self.min_max(values)
        return [a if a == b else None for a, b in zip(lo, hi)]

    # ------------------------------------------------------------ error agreement

    def check(self, error: BaseException | None) -> None:
        """Collective: raise on every rank when any rank passes an error (see the module docstring). Costs one
        ``all_reduce`` of a flag when every rank succeeded; the error reports travel only after a failure."""
        if self.all_true(error is None):
            return
        reports = self.all_gather_object(None if error is None else error_report(error, self.rank))
        self.raise_reports(reports, error)

    def raise_reports(self, reports: list[ErrorReport | None], own: BaseException | None = None) -> None:
        """Raise the agreed error for already gathered ``reports`` (None entries: ranks that succeeded). A rank
        raises its own failure (``own``, the original object when it is an oarlock error), else the first
        failing rank's."""
        failures = [r for r in reports if r is not None]
        if not failures:
            return
        mine = next((r for r in failures if r.rank == self.rank), None)
        if mine is not None and own is not None and isinstance(own, OarlockError):
            raise own
        rep = mine if mine is not None else failures[0]
        err = rebuild_error(rep, self.rank)
        if own is not None:
            raise err from own
        raise err

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Collective: call ``fn`` here, then agree on success; returns its result on every rank."""
        result, err = None, None
        try:
            result = fn(*args, **kwargs)
        except Exception as e:  # reported to every rank
            err = e
        self.check(err)
        return result

    def gather_if_any(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any] | None:
        """Collective: call ``fn`` here; when it fails on some rank, raise on every rank (as :meth:`run`); when its
        result is empty (falsy) on every rank, return None after one ``all_reduce`` of two ints, whatever the world
        size; otherwise all-gather the results (falsy ones included) and return them in rank order."""
        result, err = None, None
        try:
            result = fn(*args, **kwargs)
        except Exception as e:
            err = e
        if not self.active:
            if err is not None:
                raise err
            return [result] if result else None
        ok, empty = self.all_min([int(err is None), int(err is not None or not result)])
        if not ok:
            reports = self.all_gather_object(None if err is None else error_report(err, self.rank))
            self.raise_reports(reports, err)
        if empty:
            return None
        return self.all_gather_object(result)

    def gather(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Collective: call ``fn`` here and all-gather its result with the error agreement in one exchange."""
        result, err = None, None
        try:
            result = fn(*args, **kwargs)
        except Exception as e:
            err = e
        both = self.all_gather_object((None if err is None else error_report(err, self.rank), result))
        self.raise_reports([b[0] for b in both], err)
        return [b[1] for b in both]


