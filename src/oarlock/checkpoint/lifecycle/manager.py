"""A checkpoint manager for training loops: save every N steps, keep the last K, find the latest, resume.

Layout under ``root``::

    root/step-00000100/      one oarlock checkpoint per saved step (see :func:`oarlock.checkpoint.save_state_dict`)
    root/step-00000200/
    root/latest              text file naming the directory of the latest committed step ("step-00000200")

Protocol of :meth:`CheckpointManager.save` (rank 0 does the file-system steps; ``save_state_dict`` is collective):

1. wait for the previous save of this manager, then remove leftovers of killed saves (hidden ``.step-*``
   temporary directories, a half-written ``.latest.tmp-*``, directories half-way through deletion);
2. write the new step through ``save_state_dict`` (a hidden temporary directory renamed into place when complete);
3. write the new pointer into ``.latest.tmp-<id>``, fsync it, and ``os.replace`` it over ``latest`` (atomic);
4. only then delete step directories beyond ``keep_last`` (each is first renamed to a hidden name, so a
   half-deleted directory never looks like a checkpoint). A step directory holding entries oarlock did not write
   (a note the user put there) is not renamed: its ``metadata.json`` is removed first (it stops being a committed
   step), then the other files oarlock wrote; the user's entries stay in the directory.

Nothing the manager did not write is deleted: saving a step whose directory holds entries oarlock did not write
is refused (:class:`~oarlock.checkpoint.errors.CheckpointDestinationError`) unless ``save(..., overwrite=True)``,
which keeps them (see :func:`~oarlock.checkpoint.save_state_dict`).

A process killed at any point therefore leaves either the old or the new step as the latest, never neither.
:meth:`CheckpointManager.latest` trusts the pointer when it names a committed checkpoint, and otherwise takes the
highest committed step directory (the pointer of a first save may not exist yet).

Values of the saved ``state`` may be anything ``save_state_dict`` takes (tensors, DTensors, ShardedWeights, JSON
values, nested dicts) and also *stateful objects*: anything with ``state_dict()`` and ``load_state_dict()`` (LR
schedulers, a data loader's position, :class:`RNGState`, :class:`OptimizerState`). Their ``state_dict()`` is
saved in their place and, on load, given back to their ``load_state_dict()``. Objects whose state differs per rank (random generators, a
rank's data position) set ``rank_local = True`` or are wrapped in :class:`RankLocal`; they are stored once per
rank under ``<key>.rank<r>`` (``r`` zero-padded to 5 digits) and resume only with the same number of ranks.
"""

from __future__ import annotations

import os
import random
import re
import signal
import struct
import threading
from pathlib import Path
from typing import Any, Mapping

import torch

from oarlock.checkpoint.api import load_state_dict, save_state_dict
from oarlock.checkpoint.runtime.dist import DistWrapper
from oarlock.checkpoint.errors import CheckpointError
from oarlock.checkpoint.model.metadata import ALGORITHM_KEY, PARAM_GROUPS_KEY
from oarlock.checkpoint.lifecycle.optim import (HYPERPARAMETERS, OptimizerStateError, optimizer_algorithm,
                                                sharded_optimizer_state_dict)
from oarlock.checkpoint.storage import ObjectPath, commit_for, detect_format, location, storage_key

LATEST_FILE = "latest"
#: Environment variable naming a protocol point (see :data:`CRASH_POINTS`) at which the process SIGKILLs itself:
#: fault injection for testing that a killed save never loses the latest checkpoint.
CRASH_ENV = "OARLOCK_MANAGER_CRASH_AT"
CRASH_POINTS = ("before_save", "after_save", "pointer_written", "after_pointer", "during_delete", "after_delete")


def _crash_point(name: str) -> None:
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def _is_stateful(v: Any) -> bool:
    return (not isinstance(v, (torch.Tensor, Mapping, list, tuple)) and callable(getattr(v, "state_dict", None))
            and callable(getattr(v, "load_state_dict", None)))


class RankLocal:
    """Marks a stateful object whose state differs on every rank (e.g. a per-rank data-loader position): the
    manager saves one copy per rank (under ``<key>.rank00000``, ``<key>.rank00001``, ...) and restores each rank's
    own."""

    rank_local = True

    def __init__(self, obj: Any):
        if not _is_stateful(obj):
            raise CheckpointError(f"RankLocal needs an object with state_dict() and load_state_dict(), got "
                                  f"{type(obj).__name__}")
        self.obj = obj

    def state_dict(self) -> Any:
        return self.obj.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.obj.load_state_dict(state)


class OptimizerState:
    """An optimizer as a stateful object for :class:`CheckpointManager`, saved the sharded way: its state
    tensors through :func:`~oarlock.checkpoint.sharded_optimizer_state_dict` (they reshard like the parameters and
    are loaded in place) and, on load, its hyper-parameters (lr, betas, ... as the saved run last had them, e.g.
    set by an LR scheduler) restored from the checkpoint so that the next ``step()`` is the saved run's.

    Args:
        optimizer: as for ``sharded_optimizer_state_dict``.
        model_sharded_state_dict: the model's ``{key: ShardedWeight}`` in this run's layout.

    Raises:
        OptimizerStateError: on load, when the checkpoint was written by another optimizer algorithm or has
            another number of parameter groups.
    """

    def __init__(self, optimizer: Any, model_sharded_state_dict: Mapping[str, Any]):
        self.optimizer = optimizer
        self.model_sharded_state_dict = model_sharded_state_dict

    def state_dict(self) -> dict[str, Any]:
        return sharded_optimizer_state_dict(self.optimizer, self.model_sharded_state_dict)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Apply the loaded hyper-parameters (the state tensors were loaded in place, aliasing the optimizer's)."""
        alg, groups = state.get(ALGORITHM_KEY), state.get(PARAM_GROUPS_KEY)
        if alg is not None and alg != optimizer_algorithm(self.optimizer):
            raise OptimizerStateError(f"optimizer state was saved by {alg}, this optimizer is "
                                      f"{optimizer_algorithm(self.optimizer)}")
        if not groups:
            return
        if len(groups) != len(self.optimizer.param_groups):
            raise OptimizerStateError(f"{len(groups)} parameter groups saved, the optimizer has "
                                      f"{len(self.optimizer.param_groups)}")
        for saved, group in zip(groups, self.optimizer.param_groups):
            for k in HYPERPARAMETERS:
                if k in saved and k in group:
                    cur = group[k]
                    if isinstance(cur, torch.Tensor):
                        cur.fill_(saved[k])
                    else:
                        group[k] = tuple(saved[k]) if isinstance(cur, tuple) else saved[k]


class RNGState:
    """The random generators of this process as a stateful object for :class:`CheckpointManager`: torch's CPU
    generator, every CUDA device's generator (when CUDA is available), Python's ``random`` and numpy's legacy
    global generator (``numpy.random.seed``/``rand``). Rank-local: every rank keeps its own streams.

    ``state_dict()`` returns int64/uint8 CPU tensors: ``"torch"`` (uint8, torch's state bytes), ``"cuda"`` (uint8
    ``[devices, n]``), ``"python"`` (int64 ``[628]``: version, the 625 Mersenne Twister words, whether a Gaussian
    is cached and its float64 bits) and ``"numpy"`` (int64 ``[627]``: 624 key words, position, has-Gaussian and
    the cached Gaussian's float64 bits). ``load_state_dict`` restores exactly what it is given.
    """

    rank_local = True

    def __init__(self, cuda: bool | None = None):
        self.cuda = torch.cuda.is_available() if cuda is None else cuda

    def state_dict(self) -> dict[str, torch.Tensor]:
        import numpy as np

        version, words, gauss = random.getstate()
        py = [version, *words, 0 if gauss is None else 1, _f64_bits(gauss or 0.0)]
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        if name != "MT19937":  # pragma: no cover - numpy's legacy generator is always MT19937
            raise CheckpointError(f"numpy's global generator is {name}, RNGState saves MT19937")
        out = {"torch": torch.get_rng_state().clone(),
               "python": torch.tensor(py, dtype=torch.int64),
               "numpy": torch.tensor([*keys.astype(np.int64).tolist(), pos, has_gauss, _f64_bits(cached)],
                                     dtype=torch.int64)}
        if self.cuda:
            out["cuda"] = torch.stack([s.cpu() for s in torch.cuda.get_rng_state_all()])
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        import numpy as np

        torch.set_rng_state(state["torch"].to(torch.uint8).cpu())
        py = [int(x) for x in state["python"].tolist()]
        random.setstate((py[0], tuple(py[1:626]), _bits_f64(py[627]) if py[626] else None))
        nk = [int(x) for x in state["numpy"].tolist()]
        np.random.set_state(("MT19937", np.array(nk[:624], dtype=np.uint32), nk[624], nk[625], _bits_f64(nk[626])))
        if "cuda" in state and self.cuda:
            torch.cuda.set_rng_state_all(list(state["cuda"].to(torch.uint8)))


def _f64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_f64(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(b)))[0]


class CheckpointManager:
    """Save, rotate and resume checkpoints of a training loop under one directory (see the module docstring for
    the layout and the crash-safe protocol).

    Args:
        root: directory holding the step directories and the ``latest`` pointer (created on first save).
        keep_last: how many committed steps to keep (at least 1): the latest plus the ``keep_last - 1``
            highest other steps; None keeps every step.
        process_group: the group saves and loads are collective over (default: the world when torch.distributed
            is initialised, else a single process). Rank 0 does the file-system steps.
        save_replicas: passed to :func:`~oarlock.checkpoint.save_state_dict`.
        prefix: step directory names are ``f"{prefix}{step:08d}"``.

    Raises:
        CheckpointError: ``keep_last < 1`` or a ``prefix`` that is not a plain file name.
    """

    def __init__(self, root: str | os.PathLike, keep_last: int | None = 3, *, process_group: Any = None,
                 save_replicas: bool = False, prefix: str = "step-"):
        if keep_last is not None and int(keep_last) < 1:
            raise CheckpointError(f"keep_last must be >= 1 (or None to keep every step), got {keep_last}")
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", prefix):
            raise CheckpointError(f"prefix {prefix!r} must be a plain file-name prefix (letters, digits, _ . -)")
        self.root = location(root)  # a local directory or an s3:// prefix (docs/checkpoint-format.md)
        self._commit = commit_for(self.root)
        self.keep_last = None if keep_last is None else int(keep_last)
        self.process_group = process_group
        self.save_replicas = save_replicas
        self.prefix = prefix
        self._step_re = re.compile(re.escape(prefix) + r"(\d+)")
        self._stale_re = re.compile(r"\." + re.escape(prefix) + r"\d+\..+|\." + re.escape(LATEST_FILE) + r"\.tmp-.+")
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # ------------------------------------------------------------ queries

    def path(self, step: int) -> Path | ObjectPath:
        """The directory of ``step`` (an :class:`~oarlock.checkpoint.storage.location.ObjectPath` prefix when
        ``root`` is
        ``s3://...``)."""
        return self.root / f"{self.prefix}{int(step):08d}"

    def steps(self) -> list[int]:
        """Committed steps under ``root`` (directories with ``metadata.json`` and no incomplete marker), ascending."""
        return sorted(int(m.group(1)) for n in _step_dirs(self.root) if (m := self._step_re.fullmatch(n))
                      and self._committed(self.root / n))

    def _committed(self, p: Path) -> bool:
        return self._commit.is_committed(p)

    def latest(self) -> int | None:
        """The latest committed step: the one the ``latest`` pointer names when that directory is a committed
        checkpoint, else the highest committed step directory; None when there is none. Waits for nothing (an
        async save in flight is not the latest until committed)."""
        name = _latest_step(self.root, self._step_re)
        return None if name is None else int(self._step_re.fullmatch(name).group(1))

    # ------------------------------------------------------------ save

    def wait(self) -> None:
        """Block until the last save (sync or async) is committed, the pointer replaced and old steps deleted;
        re-raise its error if it failed."""
        t = self._thread
        if t is not None:
            t.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def save(self, step: int, state: Mapping[str, Any], *, async_save: bool = False,
             overwrite: bool = False) -> None:
        """Save ``state`` as step ``step`` (collective over the manager's process group).

        Args:
            step: the training step (a non-negative int); an existing directory of this step is replaced.
            state: a dict of tensors, DTensors, ShardedWeights, JSON values and stateful objects (module
                docstring), e.g. ``{"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(
                opt, msd), "scheduler": sched, "rng": RNGState(), "step": step}``.
            async_save: plan the save, take the snapshot of this rank's tensors in the background (into reused
                buffers, pinned for CUDA tensors, see :mod:`oarlock.checkpoint.lifecycle.async_save`) and return once it
                is taken, so the loop may update the state right after; the write, the commit, the pointer and
                the deletion of old steps run in the background (:meth:`wait` blocks for them and re-raises their
                error; the next ``save`` waits first). A plan equal to the previous save's is reused.
            overwrite: replace the step's directory even when it holds entries oarlock did not write (they are
                kept; only files oarlock wrote are replaced).

        Raises:
            CheckpointError: what :func:`~oarlock.checkpoint.save_state_dict` raises (on every rank alike), a
                negative step, or the failure of the previous async save.
            CheckpointDestinationError: the step's directory holds entries oarlock did not write and
                ``overwrite`` is not given (naming them; nothing is written).
        """
        if int(step) < 0:
            raise CheckpointError(f"step must be >= 0, got {step}")
        self.wait()
        dist = DistWrapper(self.process_group)
        err = None
        if dist.is_coordinator:
            try:
                self._commit.make_root(self.root)
                self.clean_stale()
            except (OSError, CheckpointError) as e:
                err = CheckpointError(f"{self.root}: cannot prepare the checkpoint root: {e}")
        dist.check(err)
        flat = self._to_saveable(state)
        _crash_point("before_save")
        handle = save_state_dict(flat, self.path(step), process_group=self.process_group,
                                 save_replicas=self.save_replicas, async_save=async_save, overwrite=overwrite)
        if not async_save:
            _crash_point("after_save")
            err = None
            try:
                self._publish(step)
            except Exception as e:
                err = e
            dist.check(err)  # every rank returns after the pointer is replaced (or raises alike)
            return

        handle.wait_staged()  # the loop's next in-place update must not reach the snapshot

        def finish() -> None:
            try:
                handle.wait()
                self._publish(step)
            except BaseException as e:  # re-raised by wait()
                self._error = e

        # not a daemon: a script ending right after ``save`` still gets its pointer replaced (the interpreter
        # joins the thread before exiting)
        self._thread = threading.Thread(target=finish, name="oarlock-manager-commit")
        self._thread.start()

    def _publish(self, step: int) -> None:
        """Rank 0: replace the pointer atomically, then delete steps beyond ``keep_last``."""
        if not DistWrapper(self.process_group).is_coordinator:
            return
        self._commit.replace_small(self.root / LATEST_FILE, (self.path(step).name + "\n").encode(), _crash_point)
        _crash_point("after_pointer")
        self._delete_old(step)

    def _delete_old(self, step: int) -> None:
        """Delete the steps beyond ``keep_last`` (after the pointer names ``step``)."""
        if self.keep_last is not None:
            others = [s for s in self.steps() if s != step]
            keep = {step, *others[len(others) - (self.keep_last - 1):]} if self.keep_last > 1 else {step}
            for s in self.steps():
                if s not in keep:
                    self._delete(s)
        _crash_point("after_delete")

    def _delete(self, step: int) -> None:
        self._commit.delete_checkpoint(self.path(step), _crash_point)

    def clean_stale(self) -> list[str]:
        """Remove leftovers of killed saves under ``root``: hidden ``.<prefix>N.*`` directories (temporary save
        directories, replaced or half-deleted steps) and ``.latest.tmp-*`` files. Only names this manager and
        ``save_state_dict`` create are touched. An interrupted replacement of a step is completed first (its
        kept entries go back into the step) and the temporary directory of a save still running is skipped
        (it holds a lock, see :func:`~oarlock.checkpoint.storage.commit.local.hold_staging`). Returns the removed names."""
        return self._commit.clean_stale(self.root, self._step_re, self._stale_re)

    # ------------------------------------------------------------ load

    def load_latest(self, state: Mapping[str, Any], *, strict: bool = True, **load_kwargs: Any) -> int | None:
        """Load the latest committed step into ``state`` (same structure as given to :meth:`save`: tensors are
        loaded in place, JSON values replaced in their container, stateful objects get ``load_state_dict``).
        Collective. Returns the step, or None (``state`` untouched) when ``root`` holds no checkpoint.

        ``strict`` and ``load_kwargs`` (``aoa_config``, ``comm_method``, ...) go to
        :func:`~oarlock.checkpoint.load_state_dict`.

        The step is the one rank 0 sees as the latest (every rank loads the same step).

        Raises:
            CheckpointError: what ``load_state_dict`` raises (a rank that cannot see the step directory included).
        """
        self.wait()  # on rank 0 this includes replacing the pointer of an async save
        dist = DistWrapper(self.process_group)
        step = dist.broadcast_object(self.latest() if dist.is_coordinator else None)  # rank 0's view decides
        if step is None:
            return None
        self.load(step, state, strict=strict, **load_kwargs)
        return step

    def load(self, step: int, state: Mapping[str, Any], *, strict: bool = True, **load_kwargs: Any) -> None:
        """Load step ``step`` into ``state`` (see :meth:`load_latest`)."""
        request, stateful = self._load_request(state)
        load_state_dict(request, self.path(step), process_group=self.process_group, strict=strict, **load_kwargs)
        for k, (obj, rank_key) in stateful.items():
            obj.load_state_dict(request[k][rank_key] if rank_key is not None else request[k])
        if isinstance(state, dict):
            for k, v in request.items():
                if k not in stateful and v is not state[k]:
                    state[k] = v  # top-level JSON values were replaced in ``request``, a copy of ``state``

    # ------------------------------------------------------------ stateful objects

    def _rank_key(self) -> str:
        return f"rank{DistWrapper(self.process_group).rank:05d}"

    def _to_saveable(self, state: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(state, Mapping):
            raise CheckpointError(f"state must be a dict, got {type(state).__name__}")
        out: dict[str, Any] = {}
        for k, v in state.items():
            if _is_stateful(v):
                sd = v.state_dict()
                out[k] = {self._rank_key(): sd} if getattr(v, "rank_local", False) else sd
            else:
                out[k] = v
        return out

    def _load_request(self, state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[Any, str | None]]]:
        """The dict handed to ``load_state_dict`` (stateful objects replaced by a template of their state: same
        structure and shapes, filled by the load) and, per stateful key, the object and its rank key if any."""
        if not isinstance(state, Mapping):
            raise CheckpointError(f"state must be a dict, got {type(state).__name__}")
        request: dict[str, Any] = {}
        stateful: dict[str, tuple[Any, str | None]] = {}
        for k, v in state.items():
            if _is_stateful(v):
                rank_key = self._rank_key() if getattr(v, "rank_local", False) else None
                request[k] = {rank_key: v.state_dict()} if rank_key is not None else v.state_dict()
                stateful[k] = (v, rank_key)
            else:
                request[k] = v
        return request, stateful


# ---------------------------------------------------------------- a manager root given where a checkpoint is expected

_STEP_DIR = re.compile(r"(.*?)(\d+)")


def _step_dirs(root: Any) -> list[str]:
    """Names of the sub-directories (sub-prefixes) of ``root`` that are not hidden; [] when it is none."""
    try:
        if not root.is_dir():
            return []
        st, key = storage_key(root)
        return [n for n, size in st.list(key).items() if size < 0 and not n.startswith(".")]
    except (OSError, CheckpointError):
        return []


def _latest_step(root: Any, step: "re.Pattern[str]") -> str | None:
    """The name of the latest committed step under ``root`` (step directories named by ``step``, whose last group
    is the step number): the one the ``latest`` pointer names when that is a committed checkpoint, else the
    committed step with the highest number; None when there is none."""
    commit = commit_for(root)
    try:
        name = (root / LATEST_FILE).read_text().strip()
    except (OSError, CheckpointError, UnicodeDecodeError):
        name = ""
    if name and "/" not in name and step.fullmatch(name) and commit.is_committed(root / name):
        return name
    steps = [(int(m.group(m.lastindex)), n) for n in _step_dirs(root)
             if (m := step.fullmatch(n)) and commit.is_committed(root / n)]
    return max(steps)[1] if steps else None


def resolve_manager_root(path: str | os.PathLike) -> tuple[Path | ObjectPath, str | None]:
    """``(checkpoint path, step directory name)`` for a path the commands read: a directory that is no checkpoint
    itself but a :class:`CheckpointManager` root resolves to its latest committed step (what
    :meth:`CheckpointManager.latest` would answer, for any step-name prefix); any other path is returned as it is,
    with None. Never raises (opening the returned path reports what is wrong)."""
    p = location(path)
    try:
        detect_format(p)
        return p, None
    except CheckpointError:
        pass
    name = _latest_step(p, _STEP_DIR)
    return (p / name, name) if name is not None else (p, None)
