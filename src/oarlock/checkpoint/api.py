"""``save_state_dict`` / ``load_state_dict``: sharded checkpoints with automatic resharding.

The public facade. The work happens in :mod:`oarlock.checkpoint.runtime.save` (prepare, write, commit),
:mod:`oarlock.checkpoint.runtime.load` (gather, plan, execute), :mod:`oarlock.checkpoint.runtime.comm` (node-local
disks, warm
restart) and :mod:`oarlock.checkpoint.lifecycle.async_save`. The on-disk format is described in
``docs/checkpoint-format.md``.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Sequence

from oarlock.checkpoint.lifecycle.async_save import async_save as _async_save
from oarlock.checkpoint.lifecycle.async_save import wait_pending
from oarlock.checkpoint.runtime.executor import LoadReport
from oarlock.checkpoint.runtime.load import run_load
from oarlock.checkpoint.model.mapping import MappingProgram
from oarlock.checkpoint.runtime.save import local_tensors, prepare_save, write_and_commit

__all__ = ["LoadReport", "load_state_dict", "save_state_dict"]


def save_state_dict(state_dict: Mapping[str, Any], path: str | os.PathLike, *, process_group: Any = None,
                    save_replicas: bool = False, async_save: bool = False, overwrite: bool = False) -> Any:
    """Save a (possibly sharded) state dict as an oarlock checkpoint directory. Collective over
    ``process_group`` (default: the world when torch.distributed is initialised; else a single process).

    Args:
        state_dict: nested dicts/lists whose leaves are tensors (whole, replicated on every rank), DTensors
            (their local shard; replicas written once), :class:`ShardedWeight` s (keyed by their ``key``), or
            small JSON values (ints, floats, strings, ...: stored in ``metadata.json``, rank 0's copy wins).
            Nested keys are joined with ``.``; the path is kept so loads can rebuild the nesting.
        path: the checkpoint directory to create. Its parent is created if needed. An existing oarlock
            checkpoint there holding only files oarlock wrote is replaced (only after the new one is complete);
            anything else existing there is refused, naming the entries oarlock did not write (see ``overwrite``).
            Temporary directories that crashed saves to ``path`` left behind are removed (never one of a save
            still running).
        overwrite: write into ``path`` even when it holds entries oarlock did not write (a note, another tool's
            files): those entries are kept in the new checkpoint directory, only files oarlock wrote are replaced.
            A foreign checkpoint of another format there is still refused.

        save_replicas: every rank also writes the replicas it holds (``replica_id >= 1`` in the metadata), so a
            restart in the same layout reads only its own file with no communication (see
            :func:`oarlock.checkpoint.runtime.comm.try_warm_start`). Costs disk space for every replica.
        async_save: return at once with an :class:`~oarlock.checkpoint.AsyncSaveHandle` and write in the
            background (see :func:`oarlock.checkpoint.async_save`).

    On disk: ``rank-XXXXX.safetensors`` data files (only ranks with something to write) and ``metadata.json``
    (JSON, see :mod:`oarlock.checkpoint.model.metadata`). Everything is written into a hidden temporary directory
    next to ``path`` holding an incomplete-marker file, fsynced, and renamed to ``path`` only when complete,
    so an interrupted save never leaves a directory that loads and never touches other checkpoints.

    Raises:
        CheckpointError: (on every rank alike) bad leaves, disagreeing shapes/dtypes, shards that do not tile a
            tensor exactly (:class:`~oarlock.checkpoint.planning.load.CheckpointTilingError`), a refused ``path``
            (:class:`~oarlock.checkpoint.errors.CheckpointDestinationError`: not an oarlock checkpoint, or holding
            entries oarlock did not write, without ``overwrite``), or an I/O failure on any rank (the temporary
            directory is removed).
    """
    if async_save:
        return _async_save(state_dict, path, process_group=process_group, save_replicas=save_replicas,
                           overwrite=overwrite)
    wait_pending()  # an earlier async save commits first
    plan = prepare_save(state_dict, path, process_group, save_replicas, overwrite)
    write_and_commit(plan, local_tensors(plan.leaves), process_group)
    return None


def load_state_dict(state_dict: Mapping[str, Any], path: str | os.PathLike, *, process_group: Any = None,
                    aoa_config: Any = None, strict: bool = True, program: MappingProgram | None = None,
                    comm_method: str = "auto", model_only: bool = False,
                    ignore_unexpected: bool | str | Sequence[str] | Callable[[str], bool] = False,
                    verify_checksums: bool | str = True) -> LoadReport:
    """Load a checkpoint in place into the tensors of ``state_dict``, whatever layout either side has.
    Collective over ``process_group`` (default: the world when torch.distributed is initialised).

    Args:
        state_dict: nested dicts/lists of pre-allocated targets: tensors (the whole tensor), DTensors (their
            local shard), :class:`ShardedWeight` s (their box or flat range), and JSON values (replaced by the
            saved value in their container).
        path: any source :func:`~oarlock.checkpoint.storage.open_checkpoint` reads: an oarlock checkpoint, a
            HuggingFace directory or ``.safetensors`` file, a Paddle FlexCheckpoint directory.
        aoa_config: an AOA config (``{"aoa_statements": [...], ...}`` or a list of statement strings), compiled
            by ``oarlock.checkpoint.aoa.compile_aoa(aoa_config, source_specs, destination_specs)`` into a
            mapping program (renames, transposes, splits, concats, casts); language reference: ``docs/aoa.md``.
        strict: raise on missing or unexpected keys; else report them in the returned :class:`LoadReport`.
        model_only: the checkpoint's optimizer state (keys of
            :meth:`~oarlock.checkpoint.model.metadata.CheckpointMetadata.optimizer_state_keys` and the ``optimizer.*``
            objects) and the training-run records its reader marks
            (:attr:`~oarlock.checkpoint.model.metadata.CheckpointMetadata.non_model_keys`: Megatron-Core's ``common.*``
            values and ``*._extra_state*`` entries, DeepSpeed's engine counters) are not this load's: under
            ``strict`` they are not "unexpected". The way to load a model strictly from a training checkpoint.
            The ``model`` wrapper is matched to the checkpoint (without ``aoa_config``/``program``): a
            ``{"model": model.state_dict()}`` target loads from a checkpoint that stores the model's keys at the
            top level (torchtitan's flattened model states), a plain ``model.state_dict()`` from torch's
            ``{"model": ..., "optim": ...}`` layout, when none of the target's keys is stored as given and all
            of them are stored the other way (:func:`oarlock.checkpoint.runtime.load.model_wrapper_fit`).
        ignore_unexpected: the general form of "the rest of the checkpoint is not mine": True (every stored key
            no rank requested), glob patterns (a string or a list, ``fnmatch`` syntax) or a predicate over stored
            keys. Matching keys do not fail ``strict`` (they are still listed in ``LoadReport.unexpected_keys``);
            missing keys always do.
        verify_checksums: before writing any target, verify the block checksums recorded at save of every block
            the group's reads touch, each block hashed by one rank (the one reading most of it; a same-layout
            restart hashes each rank's own file; see :mod:`oarlock.checkpoint.integrity` and
            ``LoadReport.bytes_hashed``); checkpoints without checksums load unchecked. False skips the check.
            ``"overlap"``: the same blocks are hashed on a second thread while the reads write the targets, so the
            disk is read once and a verified load takes about as long as an unverified one; a mismatch still
            raises on every rank, but the targets then hold unspecified contents (use it where a failed load
            is not retried into the same tensors, e.g. a job's start). ``LoadReport.phases`` shows where the
            time went.
        program: an already-compiled :class:`~oarlock.checkpoint.model.mapping.MappingProgram` (instead of
            ``aoa_config``). Default: the identity (same keys, global shapes and dtypes).
        comm_method: ``"auto"`` (direct byte-range reads when every rank sees every file it needs, as on a
            shared filesystem; else grouped send/recv), ``"grouped_send_recv"`` or ``"broadcast"``: see
            :mod:`oarlock.checkpoint.runtime.comm`. With node-local disks each rank passes its own directory as
            ``path``;
            each needed file is then read by exactly one rank and slices travel to the ranks that need them.
            A same-layout restart (each rank's request equals what its own data file holds, e.g. after
            ``save_state_dict(..., save_replicas=True)``) reads only local files and moves no data.

    Returns:
        A :class:`LoadReport` (missing and unexpected keys, bytes this rank read).

    Raises:
        CheckpointMismatchError: requested global shape differs from the saved one (names key, both shapes and
            the AOA hint), dtype differs without a requested cast, missing/unexpected keys under ``strict``.
        CheckpointTilingError: the stored shards of a key do not tile its global box (names key and box).
        CheckpointFormatError: unreadable source; :class:`~oarlock.checkpoint.integrity.ChecksumError` (a subclass)
            when stored bytes do not match their checksum (naming the file, the block and its byte range, and
            every key stored in that block with its shard box).
        AOAError / AOASyntaxError: a bad ``aoa_config`` (subclasses of CheckpointError).

    Every rank raises alike; no target is written before the whole plan is built and validated.
    """
    return run_load(state_dict, path, process_group=process_group, aoa_config=aoa_config, strict=strict,
                    program=program, comm_method=comm_method, model_only=model_only,
                    ignore_unexpected=ignore_unexpected, verify_checksums=verify_checksums)
