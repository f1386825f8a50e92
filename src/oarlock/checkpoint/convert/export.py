"""Offline and online conversion between checkpoint layouts: HuggingFace export, TP/PP-sharded oarlock checkpoints
written from one process, and the plan behind ``oarlock convert`` (``docs/checkpoint-format.md``).

Every conversion goes through the same two pieces as a load: a mapping program (identity, or a compiled AOA config)
and the load planner. Each output tensor -- a whole HF tensor, or one simulated rank's shard of an oarlock tensor --
is built by reading exactly the byte ranges of the source it needs, written to disk, and dropped before the next one
starts (file headers are written first: shapes and dtypes are known from the program), so peak memory is one output
tensor, never the model. The live export of a running job (:func:`export_hf_sharded`) holds at most one output
file's worth of tensors on rank 0.

TP/PP simulation (:func:`convert_checkpoint`): a job of ``world = tp * dp * pp`` ranks is described rank by rank
(rank order ``tp`` fastest, then ``dp``, then ``pp``: ``rank = tp_i + tp * (dp_i + dp * pp_i)``, Megatron's default),
each rank's shard descriptions are fed to the same deterministic write assignment that
:func:`~oarlock.checkpoint.save_state_dict` runs after its all-gather, and each rank's data file is written with the
same header layout. The result -- ``metadata.json`` and the ``rank-XXXXX.safetensors`` files -- is therefore what the
same ranks holding those shards would have saved with ``save_state_dict``.

Which axis a key is split on comes from *TP rules*: an ordered list of ``(glob, axis)`` pairs, first match wins,
``axis`` None (or no match) = replicated. Named rule sets: ``"megatron"`` (torch ``[out, in]`` Linear weights:
column-parallel q/k/v/qkv/gate/up/intermediate projections and their biases on axis 0, row-parallel o/down/output
projections on axis 1, vocabulary-parallel embeddings and LM head on axis 0), ``"paddle"`` (the same for Paddle's
``[in, out]`` Linear weights: column-parallel on axis 1, row-parallel on axis 0) and ``"none"``. Uneven extents are
split like ``torch.chunk`` (and DTensor ``Shard``): ``ceil(n / tp)`` per rank, the last ones smaller or empty.
Pipeline stages take contiguous blocks of layers (the first integer after ``layers.``/``layer.``/``h.``/``blocks.``);
keys outside layers go to stage 0 when they name an embedding, else to the last stage.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch

from oarlock.checkpoint.runtime.dist import DistWrapper
from oarlock.checkpoint.errors import CheckpointError
from oarlock.checkpoint.runtime.executor import execute_items, io_threads, pool_map
from oarlock.checkpoint.convert.full import full_state_dict
from oarlock.checkpoint.integrity import CHECKSUMS_KEY, BlockHasher, make_record, verify_all_blocks, write_digests
from oarlock.checkpoint.formats.huggingface_writer import HF_INDEX, HF_SINGLE, save_hf_checkpoint, write_hf_index
from oarlock.checkpoint.model.metadata import OPTIMIZER_KEYS_EXTRA, CheckpointMetadata
from oarlock.checkpoint.planning.load import Planner, index_of
from oarlock.checkpoint.formats.reader import CheckpointReader
from oarlock.checkpoint.storage.safetensors import SafetensorsWriter, contiguous_run
from oarlock.checkpoint.runtime.save import (assign_writes, check_destination, data_file_name, new_save_id,
                                             shard_header)
from oarlock.checkpoint.model.sharded import ShardDesc
from oarlock.checkpoint.storage import check_destination as storage_check_destination
from oarlock.checkpoint.storage import copy_file, location, publish_directory, staged_directory
from oarlock.checkpoint.formats.opening import open_checkpoint
from oarlock.checkpoint.convert.plan import (ConversionLayout, program_for_layout, carried_objects, compile_program,
                                             plan_conversion, rank_descriptions, resolve_tp_rules, select_keys,
                                             side_files, strip_model_prefix, warn_split_heads)
from oarlock.utils import dtype_itemsize, numel, torch_dtype




@contextlib.contextmanager
def single_threaded_copies() -> Iterator[None]:
    """Run tensor copies on one intra-op thread: the copies of a conversion are memory bound, and waking an
    OpenMP team for each of thousands of small slices costs more than it saves (tens of ms per copy on a busy
    machine). The previous thread count is restored on exit."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def read_destination(reader: CheckpointReader, planner: Planner, key: str, *, offset: Sequence[int] | None = None,
                     local_shape: Sequence[int] | None = None) -> torch.Tensor:
    """The box ``[offset, offset + local_shape)`` (default: all) of destination ``key`` of ``planner``'s program,
    read from ``reader`` through the planner: only the source byte ranges it needs, permutes and casts applied.

    Returns a new CPU tensor of ``local_shape`` with the destination dtype.
    """
    spec = planner.program.destination_spec(key)
    gshape = tuple(spec.shape)
    local = tuple(local_shape) if local_shape is not None else gshape
    off = tuple(offset) if offset is not None else (0,) * len(gshape)
    out = torch.empty(local, dtype=torch_dtype(spec.dtype))
    plan = planner.plan_rank([ShardDesc(key, local, gshape, off, spec.dtype)])
    execute_items(reader, out, plan.items)
    return out


def iter_full_tensors(source: str | os.PathLike, aoa_config: Any = None, *, include: Sequence[str] | None = None,
                      exclude: Sequence[str] | None = None, optimizer_state: bool = True,
                      verify_checksums: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(key, full_tensor)`` for every destination key of a checkpoint on disk (any format), one at a time,
    through ``aoa_config`` when given (e.g. a reverse config), filtered as :func:`select_keys` says. The offline
    twin of :func:`~oarlock.checkpoint.convert.full.full_state_dict`. A source with block checksums is verified whole
    before the first tensor is yielded (ChecksumError on a corrupt block)."""
    with open_checkpoint(source) as reader:
        if verify_checksums:
            verify_all_blocks(reader)
        program, _ = select_keys(compile_program(reader.metadata, aoa_config), reader.metadata, include=include,
                                 exclude=exclude, optimizer_state=optimizer_state)
        planner = Planner(reader.metadata, program)
        for key in planner.program.destination_keys():
            yield key, read_destination(reader, planner, key)






def export_hf(source: str | os.PathLike, out_dir: str | os.PathLike, *, aoa_config: Any = None,
              max_shard_size: int | str = "5GB", copy_side_files: bool = True,
              show_progress: bool | None = None, include: Sequence[str] | None = None,
              exclude: Sequence[str] | None = None, optimizer_state: bool = False,
              verify_checksums: bool = True, overwrite: bool = False,
              extra_files: Mapping[str, str | os.PathLike] | None = None, model_prefix: str | None = None) -> Path:
    """Export a checkpoint on disk (oarlock in any layout, Paddle, HF) to a HuggingFace directory:
    ``model.safetensors`` or ``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json`` (files of at
    most ``max_shard_size`` bytes of tensor data, a larger tensor alone in its file).

    Each destination tensor is read once through the planner (only the source bytes it needs), optionally through
    ``aoa_config`` (typically the forward HF -> model statements with ``aoa_config_reverse: True``), and written
    straight into its output file: shapes and dtypes are known from the program, so every file's header is written
    first and tensors follow one at a time. Peak memory is one tensor, whatever ``max_shard_size``.
    ``copy_side_files`` copies ``config.json``, tokenizer files etc. from the source directory. The output appears
    atomically (an existing directory is replaced only when the new one is complete); the source is never written.

    Model weights only by default: optimizer state keys of a training checkpoint (see :func:`select_keys`) are
    left out unless ``optimizer_state=True``; ``include``/``exclude`` globs filter the destination keys. A
    source with block checksums is verified whole first (:mod:`oarlock.checkpoint.integrity`; ``verify_checksums=False``
    skips it). ``extra_files`` (``{name: path}``) are copied in too (after the side files, so they win).
    A training-state checkpoint's wrapper prefix (``model.`` of torch's ``{"model": ..., "optim": ...}``) is
    stripped from the model keys unless ``model_prefix`` says otherwise (:func:`strip_model_prefix`).

    An existing ``out_dir`` is replaced only when it is an HF checkpoint holding only files oarlock wrote (or an
    empty directory); with ``overwrite`` also one holding other entries, which are kept (only oarlock's files are
    replaced; ``docs/checkpoint-format.md``, destination rule).

    Raises:
        CheckpointError: unreadable source (naming file and key), a bad AOA config, I/O errors (nothing is
            published), a filter that leaves no key; CheckpointDestinationError: an ``out_dir`` that is, contains or
            is inside ``source``, or holds entries oarlock did not write without ``overwrite`` (nothing is
            written); ChecksumError: a corrupt source block.
    """
    plan = plan_conversion(source, to="hf", aoa_config=aoa_config, max_shard_size=max_shard_size, include=include,
                           exclude=exclude, optimizer_state=optimizer_state, model_prefix=model_prefix)
    user_config = aoa_config
    if not plan.keys:
        raise CheckpointError(f"{source}: no tensor left to export after filtering "
                              f"(include={include}, exclude={exclude}, optimizer_state={optimizer_state})")
    out_dir = location(out_dir)  # a local directory or an s3:// prefix (other schemes refused)
    storage_check_destination(out_dir, "huggingface", [source], overwrite=overwrite)
    with staged_directory(out_dir) as tmp:
        with open_checkpoint(source) as reader, single_threaded_copies():
            if verify_checksums:
                verify_all_blocks(reader)
            aoa_config = strip_model_prefix(reader.metadata, aoa_config, model_prefix)
            planner = Planner(reader.metadata, compile_program(reader.metadata, aoa_config))
            specs = {k.key: k for k in plan.keys}
            bar = _byte_bar(plan.total_bytes, show_progress)
            for name, (keys, _) in plan.files.items():
                entries = [(k, specs[k].shape, specs[k].dtype) for k in keys]
                items = [(k, (0,) * len(specs[k].shape), specs[k].shape) for k in keys]
                _write_streaming(tmp / name, entries, _producer(reader, planner, items), bar)
            if bar is not None:
                bar.close()
            hf_config = reader.metadata.extra.get("hf_config")  # a source that knows its model (GGUF) says so
        if len(plan.files) > 1:
            write_hf_index(tmp, {k: name for name, (keys, _) in plan.files.items() for k in keys}, plan.total_bytes)
        if copy_side_files:
            for name, f in side_files(source).items():
                if not name.startswith("model"):  # never carry over a stale index
                    copy_file(f, tmp / name)
        for name, f in (extra_files or {}).items():
            if name in (HF_INDEX, HF_SINGLE) or name.startswith("model-") or "/" in name:
                raise CheckpointError(f"extra file {name!r} would overwrite a checkpoint file of the export")
            copy_file(f, tmp / name)
        if isinstance(hf_config, dict) and user_config is None and not (tmp / "config.json").exists():
            (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        publish_directory(tmp, out_dir, overwrite=overwrite)
    return out_dir


def export_hf_sharded(sharded_state_dict: Mapping[str, Any], out_dir: str | os.PathLike, *, aoa_config: Any = None,
                      process_group: Any = None, max_shard_size: int | str = "5GB",
                      extra_files: Mapping[str, str | os.PathLike] | None = None,
                      overwrite: bool = False, config: Any = None) -> Path | None:
    """Export the model a running job holds (sharded over ``process_group``) to a HuggingFace directory written by
    group rank 0: the online merge of :func:`~oarlock.checkpoint.convert.full.full_state_dict` with ``rank0_only=True``
    (each tensor gathered once, point to point to rank 0) streamed into
    :func:`~oarlock.checkpoint.formats.huggingface_writer.save_hf_checkpoint`. Collective: every rank must call it.

    Args:
        sharded_state_dict: this rank's ``{key: ShardedWeight | DTensor | Tensor}``.
        aoa_config: e.g. the model's HF -> model statements with ``aoa_config_reverse: True``.
        extra_files: ``{name: path}`` copied into the export (``config.json``, tokenizer files).
        overwrite: as for :func:`~oarlock.checkpoint.formats.huggingface_writer.save_hf_checkpoint`.
        config: the model's HF config (a dict, or a transformers ``PretrainedConfig``), written as ``config.json``
            so that ``from_pretrained`` reads the export; without it (and without ``extra_files["config.json"]``)
            the directory holds the weights only.

    Returns the directory on rank 0, None elsewhere. Peak memory on rank 0: about ``max_shard_size`` plus one
    full tensor; elsewhere, one piece at a time.

    Raises:
        CheckpointError: on every rank alike when rank 0's write failed (nothing is published).
    """
    dist = DistWrapper(process_group)
    gen = full_state_dict(sharded_state_dict, aoa_config, process_group=process_group, rank0_only=True)

    def write() -> Path | None:
        if dist.is_coordinator:
            return save_hf_checkpoint(gen, out_dir, max_shard_size=max_shard_size, extra_files=extra_files,
                                      overwrite=overwrite, config=config)
        for _ in gen:  # sends this rank's pieces to rank 0, in the same order rank 0 receives them
            pass
        return None

    return dist.run(write)


def _segments(reader: CheckpointReader, planner: Planner, key: str, offset: Sequence[int],
              local_shape: Sequence[int]) -> list[tuple[int, int, int]] | None:
    """The box of destination ``key`` as byte runs ``(source fd, source offset, nbytes)`` in output order, when
    every read item is a plain contiguous copy (no permute, no cast) from a safetensors file into a contiguous part
    of the output; None otherwise. Renames, concats, row splits and fused layouts along axis 0 qualify."""
    spec = planner.program.destination_spec(key)
    local = tuple(local_shape)
    plan = planner.plan_rank([ShardDesc(key, local, tuple(spec.shape), tuple(offset), spec.dtype)])
    isz = dtype_itemsize(spec.dtype)
    runs = []
    for it in plan.items:
        if it.permute is not None or it.dtype is not None or it.dst_flat_start or len(it.dst_shape) != len(local):
            return None
        dst = contiguous_run(local, it.dst_box)
        src = reader.byte_run(it.src_key, it.file, it.name, it.src_flat_start, it.src_shape, it.src_box)
        if dst is None or src is None or src[2] != dst[1] * isz:
            return None
        runs.append((dst[0] * isz, src))
    runs.sort(key=lambda r: r[0])
    pos = 0
    for off, (_, _, n) in runs:
        if off != pos:  # pragma: no cover - a plan always tiles its target
            return None
        pos += n
    if pos != numel(local) * isz:
        return None
    return [src for _, src in runs]


def _write_streaming(path: Path, entries: list[tuple[str, tuple[int, ...], str]], produce: Any,
                     bar: Any = None) -> None:
    """One safetensors file; ``produce(index)`` gives each tensor or its byte runs (see
    :meth:`~oarlock.checkpoint.storage.safetensors.SafetensorsWriter.put`)."""
    with SafetensorsWriter(path, entries) as out:
        for i, (name, _, _) in enumerate(entries):
            n = out.put(name, produce(i))
            if bar is not None:
                bar.update(n)


def _producer(reader: CheckpointReader, planner: Planner, items: Sequence[tuple[str, Sequence[int], Sequence[int]]]
              ) -> Any:
    """``produce(i)`` for :func:`_write_streaming`: byte runs when the i-th ``(key, offset, local_shape)`` is a
    plain copy, else the tensor read through the planner."""
    def produce(i: int) -> Any:
        key, off, local = items[i]
        segs = _segments(reader, planner, key, off, local)
        if segs is not None:
            return segs
        return read_destination(reader, planner, key, offset=off, local_shape=local)
    return produce


def convert_checkpoint(source: str | os.PathLike, out_dir: str | os.PathLike, *, aoa_config: Any = None,
                       tp: int = 1, pp: int = 1, dp: int = 1,
                       tp_rules: str | Path | Mapping[str, int | None] | Sequence | None = None,
                       copy_side_files: bool = True, show_progress: bool | None = None,
                       include: Sequence[str] | None = None, exclude: Sequence[str] | None = None,
                       optimizer_state: bool = True, verify_checksums: bool = True,
                       overwrite: bool = False) -> CheckpointMetadata:
    """Write an oarlock checkpoint from any source, sharded as a job of ``tp * dp * pp`` ranks would save it
    (see the module docstring for rank order, TP rules and stage assignment), from this one process.

    Args:
        source: any checkpoint :func:`~oarlock.checkpoint.storage.open_checkpoint` reads.
        out_dir: the oarlock checkpoint directory to create (an existing oarlock checkpoint holding only files
            oarlock wrote is replaced only when the new one is complete; anything else is refused unless
            ``overwrite``, which keeps the entries oarlock did not write and replaces only oarlock's).
        aoa_config: applied on the way (e.g. HF -> fused model layout); ``fused_ffn``/``fused_qkv_old`` see the
            destination TP degree ``tp`` for keys the rules split.
        tp_rules: see :func:`resolve_tp_rules`.
        include, exclude, optimizer_state: key filters, see :func:`select_keys` (default: every key).

    A source with block checksums is verified whole first (unless ``verify_checksums`` is False); the output
    records its own. Shards are read through the planner straight from the source's bytes, key by key. Returns the
    written metadata (equal to what ``save_state_dict`` on those ranks writes).

    Raises:
        CheckpointError: bad source/config/rules, I/O errors (the temporary directory is removed; nothing is
            published). CheckpointDestinationError: an ``out_dir`` that is, contains or is inside ``source``, or
            is refused by :func:`~oarlock.checkpoint.storage.check_destination` (nothing is written).
    """
    out_dir = location(out_dir)  # a local directory or an s3:// prefix (other schemes refused)
    layout = ConversionLayout(tp, pp, dp, tuple(resolve_tp_rules(tp_rules)))
    check_destination(out_dir, [source], overwrite=overwrite)
    with open_checkpoint(source) as reader, single_threaded_copies():
        if verify_checksums:  # a corrupt source must not turn into a valid-looking output
            verify_all_blocks(reader)
        program, axes = program_for_layout(reader.metadata, aoa_config, layout)
        warn_split_heads(source, axes, layout.tp)
        program, _ = select_keys(program, reader.metadata, include=include, exclude=exclude,
                                 optimizer_state=optimizer_state)
        tensors, writes = assign_writes(rank_descriptions(program, axes, layout))
        for t in tensors.values():
            index_of(t)
        meta = _converted_metadata(reader.metadata, program, tensors, carried_objects(
            reader.metadata, include=include, exclude=exclude, optimizer_state=optimizer_state))
        planner = Planner(reader.metadata, program)
        total = sum(numel(s.local_shape) * dtype_itemsize(t.dtype) for t in tensors.values() for s in t.shards)
        with staged_directory(out_dir, incomplete_marker=True) as tmp:
            bar = _byte_bar(total, show_progress)
            outs: dict[int, SafetensorsWriter] = {}
            try:
                # the stored tensor names assign_writes chose (the key, except for the reserved __metadata__)
                name_of = {(s.file, k, tuple(s.global_offset)): s.name for k, t in tensors.items() for s in t.shards}
                by_key = _open_rank_files(tmp, writes, tensors, name_of, layout.world, meta.save_id, outs)
                # key by key over all rank files: a key whose shards are strided in the source (a row-parallel
                # split) is read once whole and cut, instead of once per rank
                for k in program.destination_keys():
                    pieces = by_key.get(k, [])
                    segs = [_segments(reader, planner, k, off, lshape) for _, off, lshape in pieces]
                    whole = None
                    if len(pieces) > 1 and any(sg is None for sg in segs):
                        whole = read_destination(reader, planner, k)
                    by_rank: dict[int, list] = {}
                    for (rank, off, lshape), sg in zip(pieces, segs):
                        by_rank.setdefault(rank, []).append((off, lshape, sg))

                    def write_rank(rank: int) -> int:
                        done = 0
                        for off, lshape, sg in by_rank[rank]:
                            if sg is None:
                                if whole is not None:
                                    sg = whole[tuple(slice(o, o + n) for o, n in zip(off, lshape))]
                                else:
                                    sg = read_destination(reader, planner, k, offset=off, local_shape=lshape)
                            done += outs[rank].put(name_of[(data_file_name(rank), k, off)], sg)
                        return done

                    # each rank's file has its own writer: the key's pieces are copied into them side by side
                    # (kernel copies and tensor copies release the GIL; one thread was a third of a 2-core machine)
                    written = pool_map(write_rank, sorted(by_rank), min(io_threads(), len(by_rank)))
                    if bar is not None:
                        bar.update(sum(written))
                    whole = None  # freed before the next key's
            except BaseException:
                for o in outs.values():  # abandoned: closing would hash a half-written file and mask the error
                    o.abandon()
                raise
            # each file's checksums (kernel-copied bytes are hashed from the file) and fsync, side by side
            pool_map(lambda o: o.close(), list(outs.values()), io_threads())
            if bar is not None:
                bar.close()
            meta.extra[CHECKSUMS_KEY] = make_record({data_file_name(r): write_digests(tmp, data_file_name(r),
                                                                                    o.checksum_record)
                                                     for r, o in outs.items()})
            if copy_side_files:
                for name, f in side_files(source).items():
                    copy_file(f, tmp / name)
            publish_directory(tmp, out_dir, meta, overwrite=overwrite)
    return meta


def _converted_metadata(source: CheckpointMetadata, program: Any, tensors: dict, objects: dict
                        ) -> CheckpointMetadata:
    """The metadata of a conversion's output: its tensors and carried objects, a fresh save id, the TP-blocked
    layouts a load at another TP degree re-lays out, and the source's optimizer-key marking."""
    meta = CheckpointMetadata("oarlock", tensors=tensors, save_id=new_save_id(), objects=objects)
    meta.nested = {k: v for k, v in source.nested.items() if k in meta.objects}
    if getattr(program, "tp_layouts", None):  # fused_ffn/fused_qkv_old blocks: a load at another TP re-lays out
        meta.extra["tp_layouts"] = program.tp_layouts
    marked = set(source.optimizer_keys)  # a foreign reader's marking survives under the same names
    if marked & set(tensors):
        meta.extra[OPTIMIZER_KEYS_EXTRA] = [k for k in tensors if k in marked]
    return meta


def _open_rank_files(tmp: Path, writes: dict, tensors: dict, name_of: dict, world: int, save_id: str,
                     outs: dict[int, SafetensorsWriter]) -> dict[str, list[tuple[int, tuple, tuple]]]:
    """Open one hashed writer per rank file in ``tmp`` (into ``outs``, so the caller can abandon them on an error)
    with the shard records a same-layout restart checks, as ``save_state_dict`` writes them; returns key ->
    ``[(rank, global offset, local shape)]`` of its pieces."""
    by_key: dict[str, list[tuple[int, tuple, tuple]]] = {}
    for rank in sorted(writes):
        ids = sorted((i[0], i[1], i[2]) for i in writes[rank])
        f = data_file_name(rank)
        hdr = shard_header([(name_of[(f, i[0], i[1])], i[1], i[2], tensors[i[0]].global_shape, tensors[i[0]].dtype,
                             i[3]) for i in sorted(writes[rank])], world, save_id)
        outs[rank] = SafetensorsWriter(tmp / f, [(name_of[(f, k, off)], lshape, tensors[k].dtype)
                                                 for k, off, lshape in ids], hdr, hasher=BlockHasher())
        for k, off, lshape in ids:
            by_key.setdefault(k, []).append((rank, off, lshape))
    return by_key


def convert_to_dcp(source: str | os.PathLike, out_dir: str | os.PathLike, *, aoa_config: Any = None,
                   tp: int = 1, pp: int = 1, dp: int = 1,
                   tp_rules: str | Path | Mapping[str, int | None] | Sequence | None = None,
                   copy_side_files: bool = True, show_progress: bool | None = None,
                   overwrite: bool = False) -> CheckpointMetadata:
    """Write a ``torch.distributed.checkpoint`` (DCP) directory from any source, chunked as a job of
    ``tp * dp * pp`` ranks would save it (same layout rules as :func:`convert_checkpoint`), from this one process.
    torch's own ``dcp.load`` reads the result into any layout (e.g. HF -> AOA/TP layout -> torchtitan); the
    source's non-tensor values are written too. Format: :mod:`oarlock.checkpoint.formats.dcp`.

    Each chunk is read through the planner straight from the source's bytes and written before the next; memory
    holds one tensor. Returns the written metadata (as oarlock's DCP reader reports it).

    Raises:
        CheckpointError: bad source/config/rules, I/O errors (nothing is published).
        CheckpointDestinationError: an ``out_dir`` that is, contains or is inside ``source``, or exists and is
            not a DCP checkpoint holding only files oarlock wrote (nor empty) without ``overwrite`` (which keeps
            the other entries; see :func:`~oarlock.checkpoint.storage.check_destination`).
    """
    from oarlock.checkpoint.formats.dcp import DcpWriter, parse_dcp_metadata

    out_dir = location(out_dir)  # a local directory or an s3:// prefix (other schemes refused)
    storage_check_destination(out_dir, "dcp", [source], overwrite=overwrite)
    layout = ConversionLayout(tp, pp, dp, tuple(resolve_tp_rules(tp_rules)))
    with open_checkpoint(source) as reader, single_threaded_copies():
        program, axes = program_for_layout(reader.metadata, aoa_config, layout)
        tensors, _ = assign_writes(rank_descriptions(program, axes, layout))
        planner = Planner(reader.metadata, program)
        total = sum(numel(s.local_shape) * dtype_itemsize(t.dtype) for t in tensors.values() for s in t.shards)
        with staged_directory(out_dir) as tmp:
            bar = _byte_bar(total, show_progress)
            writer = DcpWriter(tmp, tensors, reader.metadata.nested)
            try:
                for k in program.destination_keys():
                    shards = tensors[k].shards if k in tensors else []
                    whole = read_destination(reader, planner, k) if len(shards) > 1 else None
                    for s in shards:
                        if whole is not None:
                            t = whole[tuple(slice(o, o + n) for o, n in zip(s.global_offset, s.local_shape))]
                        else:
                            t = read_destination(reader, planner, k, offset=s.global_offset,
                                                 local_shape=s.local_shape)
                        n = writer.put(k, s, t)
                        if bar is not None:
                            bar.update(n)
                    del whole
                for k, v in reader.metadata.objects.items():
                    writer.put_object(k, v)
                writer.finish()
            finally:
                writer.close()
            if bar is not None:
                bar.close()
            if copy_side_files:
                for name, f in side_files(source).items():
                    copy_file(f, tmp / name)
            # read back from the staged copy: an object store holds oarlock checkpoints only, so the published
            # prefix would not open here (torch's DCP readers for S3 read it)
            meta = parse_dcp_metadata(tmp)[0]
            publish_directory(tmp, out_dir, overwrite=overwrite)
    return meta


def _byte_bar(total: int, show: bool | None) -> Any:
    if show is False:
        return None
    import sys

    from tqdm.auto import tqdm

    env = os.environ.get("OARLOCK_PROGRESS")
    disable = (env == "0") if env is not None else (not sys.stderr.isatty() if show is None else False)
    return tqdm(total=total, desc="convert", unit="B", unit_scale=True, disable=disable, file=sys.stderr,
                dynamic_ncols=True, leave=False)
