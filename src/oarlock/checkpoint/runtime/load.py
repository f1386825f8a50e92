"""The load pipeline behind :func:`oarlock.checkpoint.load_state_dict`: gather requests, open the checkpoint
(this rank's view of it), compile the mapping, plan, check, then execute.

Each rank reads the metadata itself, plans its reads with :mod:`oarlock.checkpoint.planning.load` (a pure function), and
reads exactly the byte ranges its own shards need, straight into the target tensors when no permutation or cast
is involved (:mod:`oarlock.checkpoint.runtime.executor`). Ranks exchange only small descriptions, through
:class:`~oarlock.checkpoint.runtime.dist.DistWrapper` so that errors (AOA errors included, with their class) are raised
on every rank alike; on a shared filesystem tensor data never crosses the network. With node-local disks each
file is read once and slices are shipped between ranks, and a same-layout restart reads only local files: see
:mod:`oarlock.checkpoint.runtime.comm`.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Mapping

import torch

from oarlock.checkpoint.runtime import comm
from oarlock.checkpoint.runtime.dist import DistWrapper
from oarlock.checkpoint.errors import CheckpointError, CheckpointMismatchError
from oarlock.checkpoint.runtime import executor
from oarlock.checkpoint.runtime.executor import FileWork, LoadReport, execute_work, prepare_work, read_order
from oarlock.checkpoint.integrity import OVERLAP, recorded, touched_blocks, verify_group, verify_mode
from oarlock.checkpoint.model.mapping import MappingProgram, TensorSpec
from oarlock.checkpoint.model.metadata import ALGORITHM_KEY, PARAM_GROUPS_KEY, CheckpointMetadata
from oarlock.checkpoint.planning.load import LoadPlan, Planner, ReadItem, source_specs
from oarlock.checkpoint.formats.reader import CheckpointReader
from oarlock.checkpoint.runtime.save import data_file_name
from oarlock.checkpoint.model.sharded import ShardedWeight
from oarlock.checkpoint.formats.opening import open_checkpoint
from oarlock.checkpoint.runtime.view import gather_view
from oarlock.checkpoint.storage import location, recover_publish, storage_for
from oarlock.checkpoint.model.traversal import Leaves, collect_leaves, set_path
from oarlock.utils import gc_paused


def compile_aoa_for_load(aoa_config: Any, source: dict[str, TensorSpec], destination: dict[str, TensorSpec],
                         meta: CheckpointMetadata | None = None, destination_shards: dict[str, int] | None = None
                         ) -> MappingProgram:
    """Compile ``aoa_config`` with the TP shard counts (distinct global offsets) of both sides: the
    ``fused_ffn`` / ``fused_qkv_old`` layouts depend on them (see ``docs/aoa.md``).

    Raises:
        AOAError / AOASyntaxError: a bad config (subclasses of CheckpointError).
    """
    from oarlock.checkpoint.aoa import compile_aoa, shard_counts  # the AOA engine imports this package's modules
    from oarlock.checkpoint.aoa.layout import relayout_config

    # a key saved in a TP-blocked layout at another degree: re-laid out, or an error naming the statement
    aoa_config = relayout_config(aoa_config, meta, destination_shards or {}) if meta is not None else aoa_config
    return compile_aoa(aoa_config, source, destination, source_shards=shard_counts(meta) if meta is not None else None,
                       destination_shards=destination_shards)


def dropped_data(unexpected: list[str], used: set[str]) -> list[str]:
    """Unexpected keys that sit in a module whose other tensors the load reads (``q_proj.bias`` next to a read
    ``q_proj.weight``): data a non-strict load would silently drop, unlike another pipeline stage's layers."""
    modules = {k.rsplit(".", 1)[0] for k in used if "." in k}
    return [k for k in unexpected if "." in k and k.rsplit(".", 1)[0] in modules]


def fmt_keys(keys: list[str], limit: int = 20) -> str:
    s = ", ".join(repr(k) for k in keys[:limit])
    return s + (f" ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def not_model_weights(meta: CheckpointMetadata) -> set[str]:
    """Stored keys a ``model_only`` load ignores: optimizer state tensors
    (:meth:`~oarlock.checkpoint.model.metadata.CheckpointMetadata.optimizer_state_keys`), the ``optimizer.*`` objects
    and
    the entries the format's reader marked as records of the training run
    (:attr:`~oarlock.checkpoint.model.metadata.CheckpointMetadata.non_model_keys`)."""
    return (set(meta.optimizer_state_keys()) | ({ALGORITHM_KEY, PARAM_GROUPS_KEY} & set(meta.objects))
            | set(meta.non_model_keys))


def not_mine(meta: CheckpointMetadata, model_only: bool, ignore: Any) -> Callable[[str], bool]:
    """Predicate over stored keys the caller declared not to be this load's (``model_only`` and
    ``ignore_unexpected`` of :func:`oarlock.checkpoint.load_state_dict`)."""
    import fnmatch

    opt = not_model_weights(meta) if model_only else set()
    if callable(ignore):
        return lambda k: k in opt or bool(ignore(k))
    if ignore is True:
        return lambda k: True
    pats = [ignore] if isinstance(ignore, str) else list(ignore or ())
    return lambda k: k in opt or any(fnmatch.fnmatchcase(k, p) for p in pats)


def model_wrapper_fit(state_dict: Mapping[str, Any], meta: CheckpointMetadata, wrapper: str = "model"
                      ) -> str | None:
    """For a ``model_only`` load: whether the target must be adapted to where the checkpoint keeps the model.

    ``"unwrap"``: the target is ``{"model": model.state_dict()}`` and the checkpoint stores the model's keys at
    the top level beside its optimizer records (torchtitan's flattened model states, ``{**model_sd, "optim":
    ...}``); ``"wrap"``: the target is a plain ``model.state_dict()`` and the checkpoint is torch's ``{"model":
    ..., "optim": ...}`` layout. Only when none of the target's tensor keys is stored as given and every one of
    them is stored the other way; None otherwise (the target is used as given)."""
    from oarlock.checkpoint.model.traversal import iter_leaves, leaf_key

    keys = [leaf_key(p, v) for p, v in iter_leaves(state_dict) if isinstance(v, (torch.Tensor, ShardedWeight))]
    stored = meta.tensors
    if not keys or any(k in stored for k in keys):
        return None
    pre = wrapper + "."
    if list(state_dict) == [wrapper] and isinstance(state_dict[wrapper], Mapping) \
            and all(k.startswith(pre) and k[len(pre):] in stored for k in keys):
        return "unwrap"
    return "wrap" if all(pre + k in stored for k in keys) else None


def fit_model_wrapper(state_dict: Mapping[str, Any], path: str | os.PathLike, dist: DistWrapper, view: Any
                      ) -> Mapping[str, Any]:
    """``state_dict`` adapted as :func:`model_wrapper_fit` decides on rank 0 (one decision for the group, so
    every rank requests the same keys); the target's tensors are the same objects (loaded in place)."""
    fit = None
    if dist.rank == 0:
        try:
            with open_checkpoint(path, view=view, rank=dist.rank) as r:
                fit = model_wrapper_fit(state_dict, r.metadata)
        except CheckpointError:
            fit = None  # the load itself reports an unreadable checkpoint
    if dist.active:
        fit = dist.broadcast_object(fit, 0)
    if fit == "unwrap":
        return state_dict["model"]
    return {"model": state_dict} if fit == "wrap" else state_dict


def request_record(leaves: Leaves, dist: DistWrapper, with_offsets: bool = True) -> dict:
    """What a rank tells the others about its load request: requested keys with global shape and dtype, requested
    objects, and, for the TP-degree-dependent AOA layouts, each key's shard count (from a DTensor's placements:
    the same on every rank of its mesh) or the offsets of other shards. For DTensor targets the record is the
    same on every rank of a mesh, so :func:`gather_requests` moves one copy per distinct record."""
    from oarlock.checkpoint.model.metadata import grid_cell_count
    from oarlock.checkpoint.runtime.save import dtensor_grid

    cache: dict = {}
    tensors: dict[str, tuple] = {}
    counts: dict[str, int] = {}
    offsets: list[tuple] = []
    for sw in leaves.shards:
        d = sw.desc
        tensors.setdefault(d.key, (tuple(d.global_shape), d.dtype))
        if not with_offsets:
            continue
        grid = dtensor_grid(sw, dist, cache) if sw.placement_layout is not None else None
        if grid is not None:
            counts[d.key] = grid_cell_count(tuple(d.global_shape), grid)
        elif d.numel:
            offsets.append((d.key, tuple(d.global_offset)))
    return {"tensors": tensors, "counts": counts, "offsets": offsets, "objects": sorted(leaves.objects)}


#: Above this many distinct request records, one all-gather moves them instead of one broadcast each.
MAX_BROADCAST_CLASSES = 8


def gather_requests(request: Callable[[], dict], dist: DistWrapper) -> list[dict]:
    """Collective: the distinct request records of the group (:func:`request_record`), in order of their lowest
    rank; raises alike on every rank when ``request`` fails on any. First one all-reduce of a few ints whatever the
    world size (:meth:`DistWrapper.agree` of a failure flag and the record's fingerprint): when no rank failed and
    every rank holds the same record (a load of DTensors), that is all. Otherwise one all-gather of a fixed-size
    fingerprint per rank, then one broadcast per distinct record (all-gather of the records when there are
    many)."""
    import hashlib
    import json as _json

    from oarlock.checkpoint.runtime.dist import error_report, fingerprint_words

    rec, err, fp = None, None, None
    try:
        rec = request()
        fp = hashlib.sha256(_json.dumps(rec, sort_keys=True, default=list).encode()).hexdigest()
    except Exception as e:
        err = e
    if dist.active and None not in dist.agree([int(err is not None)] + fingerprint_words(fp or "")) \
            and err is None:
        return [rec]
    both = dist.all_gather_object((None if err is None else error_report(err, dist.rank), fp))
    dist.raise_reports([b[0] for b in both], err)
    firsts: dict[str, int] = {}
    for r, (_, f) in enumerate(both):
        firsts.setdefault(f, r)
    if len(firsts) == 1:  # every rank holds the one record already
        return [rec]
    if len(firsts) > MAX_BROADCAST_CLASSES:
        every = dist.all_gather_object(rec)
        return [every[r] for r in sorted(firsts.values())]
    return [dist.broadcast_object(rec if dist.rank == r else None, r) for r in sorted(firsts.values())]


def destination_request(gathered: list[dict]) -> tuple[dict[str, TensorSpec], dict[str, int]]:
    """From the gathered request records (:func:`gather_requests`): every requested key's global spec, and its TP
    shard count (distinct offsets, or a DTensor grid's cell count) for the TP-dependent AOA layouts."""
    dest_all: dict[str, TensorSpec] = {}
    offsets: dict[str, set] = {}
    counts: dict[str, int] = {}
    for g in gathered:
        for k, (shape, dt) in g["tensors"].items():
            dest_all.setdefault(k, TensorSpec(tuple(shape), dt))
        for k, off in g["offsets"]:
            offsets.setdefault(k, set()).add(tuple(off))
        for k, n in g["counts"].items():
            counts[k] = max(counts.get(k, 0), n)
    counts.update({k: len(v) for k, v in offsets.items()})
    return dest_all, counts


def run_load(state_dict: Mapping[str, Any], path: str | os.PathLike, *, process_group: Any = None,
             aoa_config: Any = None, strict: bool = True, program: MappingProgram | None = None,
             comm_method: str = "auto", model_only: bool = False, ignore_unexpected: Any = False,
             verify_checksums: bool = True) -> LoadReport:
    """The body of :func:`oarlock.checkpoint.load_state_dict` (see there for arguments and errors). From an object
    store, the blocks this rank verifies are kept for the load's reads (fetched once, not twice)."""
    kw = dict(process_group=process_group, aoa_config=aoa_config, strict=strict, program=program,
              comm_method=comm_method, model_only=model_only, ignore_unexpected=ignore_unexpected,
              verify_checksums=verify_checksums)
    path = location(path)  # an unsupported URL scheme is refused here, never read as a local path
    # A load of many shards makes tens of thousands of short-lived plan objects: the cyclic collector's passes
    # over them showed as a large share of the executor's time in a profile of the 16 -> 8 scale_ranks load.
    with gc_paused(), storage_for(path).load_session():
        return _run_load(state_dict, path, **kw)


def _run_load(state_dict: Mapping[str, Any], path: str | os.PathLike, *, process_group: Any = None,
             aoa_config: Any = None, strict: bool = True, program: MappingProgram | None = None,
             comm_method: str = "auto", model_only: bool = False, ignore_unexpected: Any = False,
             verify_checksums: bool = True) -> LoadReport:
    """The body of :func:`oarlock.checkpoint.load_state_dict` (see there for arguments and errors)."""
    if aoa_config is not None and program is not None:
        raise CheckpointError("pass either aoa_config or program to load_state_dict, not both")
    comm.check_comm_method(comm_method)
    verify_checksums = verify_mode(verify_checksums)
    t_start = time.perf_counter()
    dist = DistWrapper(process_group)
    recover_publish(path)  # an interrupted replacement of this checkpoint is completed first (the warm path too)
    first, warm = _try_warm(state_dict, path, dist, aoa_config is None and program is None, verify_checksums)
    if warm is not None:
        return warm
    view = gather_view(path, dist) if dist.active else None
    if model_only and aoa_config is None and program is None:
        fitted = fit_model_wrapper(state_dict, path, dist, view)
        if fitted is not state_dict:  # keys re-wrapped: the leaves are collected again
            state_dict, first = fitted, None
    leaves = Leaves()

    def request() -> dict:
        nonlocal leaves
        leaves = first if first is not None else collect_leaves(state_dict)
        return request_record(leaves, dist, with_offsets=program is None)

    gathered = gather_requests(request, dist)
    reader: CheckpointReader | None = None
    plans: list[LoadPlan] = []
    work: list[tuple[ReadItem, torch.Tensor]] | FileWork = []  # (read item, target), in read order
    prepared: dict = {}  # data file -> its checked reads (executor.prepare_work)
    touched: dict | None = None  # file -> checksum block -> bytes this rank reads (FileWork: summed at the check)
    unexpected: list[str] = []
    used: set[str] = set()

    def plan() -> dict:
        nonlocal reader, program, unexpected, aoa_config, work, touched
        reader = open_checkpoint(path, view=view, rank=dist.rank)
        meta = reader.metadata
        missing: set[str] = set()
        dest_all, counts = destination_request(gathered)
        if aoa_config is None and program is None and meta.extra.get("tp_layouts"):
            aoa_config = []  # keys saved in a TP-blocked layout: compiled below, re-laid out if needed
        if aoa_config is not None:
            program = compile_aoa_for_load(aoa_config, source_specs(meta), dest_all, meta, counts)
        planner = Planner(meta, program)
        for sw in leaves.shards:
            d = sw.desc
            if d.key in meta.objects and d.key not in meta.tensors and aoa_config is None and program is None:
                raise CheckpointMismatchError(f"key {d.key!r}: the checkpoint holds a "
                                              f"{type(meta.objects[d.key]).__name__} object, the target is a tensor")
            p = planner.plan_rank([d], compact=True)
            plans.append(p)
            missing.update(p.missing_keys)
        missing.update(k for k in leaves.objects if k not in meta.objects)
        skipped = missing & set(getattr(planner.program, "skipped", ()) or ())  # '_ -> key': not loaded on purpose
        missing -= skipped
        used.update(_sources_read(planner, dest_all))  # what the whole group reads
        wanted_objects = {k for g in gathered for k in g["objects"]}
        unexpected = sorted([k for k in meta.tensors if k not in used]
                            + [k for k in meta.objects if k not in wanted_objects and k not in dest_all])
        # every item this rank reads itself is checked (file opens, same save, tensor holds the array) and located
        # before the first target byte is written; the files stay open, so the reads see what was checked
        work = _work_of(leaves, plans)
        plans.clear()  # the items live on in ``work``: one list of them, not two
        files = work.files if isinstance(work, FileWork) else {it.file for it, _ in work}
        checksums = recorded(meta, reader.path_of) if verify_checksums and isinstance(work, FileWork) else None
        if checksums:  # the blocks each file's pairs touch, summed while they are made for the check
            touched = {}

        def on_file(f: str, pairs: list, p: Any) -> None:
            touched.update(touched_blocks(reader, (it for it, _ in pairs), checksums, {f: p.nbytes}, {f}))
        prepared.update(prepare_work(reader, work, reader.visible_files(set(files)), on_file if checksums else None))
        return {"missing": sorted(missing), "skipped": sorted(skipped)} if missing or skipped else None

    try:
        # missing or skipped keys are rare: one fixed-size agreement that no rank has any, else an all-gather
        status = dist.gather_if_any(plan)
    except BaseException:
        if reader is not None:
            reader.close()
        raise
    assert reader is not None
    status = [s for s in status or () if s]  # ranks with something missing or skipped
    all_missing = sorted({k for s in status for k in s["missing"]})
    foreign = not_mine(reader.metadata, model_only, ignore_unexpected)
    unexpected_strict = [k for k in unexpected if not foreign(k)]
    if strict and (all_missing or unexpected_strict):
        reader.close()
        raise _mismatch(path, reader.metadata, all_missing, unexpected_strict, used, model_only)

    report = LoadReport(all_missing, unexpected, skipped_keys=sorted({k for s in status for k in s["skipped"]}))
    report.phases["plan"] = time.perf_counter() - t_start
    with reader, torch.no_grad():
        _read_phase(reader, work, prepared, touched, dist, view, comm_method, verify_checksums, report)
        for k, value in ((k, reader.metadata.objects[k]) for k in leaves.objects if k in reader.metadata.objects):
            set_path(state_dict, leaves.object_paths[k], value)
    return report


def _mismatch(path: Any, meta: Any, all_missing: list[str], unexpected_strict: list[str], used: set[str],
              model_only: bool) -> CheckpointMismatchError:
    """The error of a strict load with missing or unexpected keys, with the hint that fits them."""
    parts = []
    if all_missing:
        parts.append(f"missing keys (requested, not in the checkpoint): {fmt_keys(all_missing)}")
    if unexpected_strict:
        parts.append(f"unexpected keys (in the checkpoint, not requested): {fmt_keys(unexpected_strict)}")
    # optimizer state and training-run records (Megatron's common.* and *._extra_state*): model_only=True
    # is the fix for those, never an AOA statement
    run_records = not_model_weights(meta) if not model_only else set()
    weights = [k for k in unexpected_strict if k not in run_records]
    dropped = dropped_data(weights, used)
    if dropped:  # strict=False would silently lose these tensors: never suggest it
        hint = (f" ({fmt_keys(dropped, 5)} sit in modules whose other tensors this load reads (a bias beside its "
                "weight, say): loading without them "
                "gives wrong numbers. Map them with an AOA statement (a preset built from the model's "
                "config.json maps biases, see docs/aoa.md), or drop them deliberately with 'KEY -> _')")
    elif not unexpected_strict:  # only missing keys: neither model_only nor ignore_unexpected helps
        hint = (" (check the names: `oarlock inspect PATH` lists what the checkpoint holds; map stored keys to "
                "these with an AOA statement (docs/aoa.md), or pass strict=False to load the rest and get the "
                "missing keys in the returned LoadReport)")
    elif not weights:
        hint = (f" (none of them are model weights: this {meta.format} checkpoint's optimizer state and "
                "training-run records; pass model_only=True to load the model strictly without them)")
    else:
        hint = (" (pass strict=False to load the rest and get them in the returned LoadReport, or "
                "model_only=True / ignore_unexpected=GLOBS when the rest of the checkpoint is not this load's)")
    return CheckpointMismatchError(f"{path}: " + "; ".join(parts) + hint)


def _read_phase(reader: Any, work: Any, prepared: dict, touched: dict | None, dist: DistWrapper, view: Any,
                comm_method: str, verify_checksums: Any, report: LoadReport) -> None:
    """Verify the blocks the group reads (before any target byte is written, or beside the reads with
    ``"overlap"``), then read: fills ``report``'s byte counts and phases."""
    st = None

    def reads() -> None:
        nonlocal st
        # one rank's read error reaches every rank (they would otherwise run into their next collective)
        st = dist.run(comm.execute, reader, work, comm_method=comm_method, view=view, dist=dist,
                      direct=lambda r, w: execute_work(r, w, prepared=prepared if w is work else None),
                      verify_checksums=bool(verify_checksums))

    overlap = verify_checksums == OVERLAP
    if verify_checksums:  # collective: each touched block hashed by one rank, before any target is written
        # (or, with "overlap", while the reads write them); a FileWork's touched blocks were summed at the check
        items = () if isinstance(work, FileWork) else [it for it, _ in work]
        report.bytes_hashed = verify_group(reader, items, dist, {f: p.nbytes for f, p in prepared.items()},
                                           touched=touched, phases=report.phases,
                                           during=reads if overlap else None)
    if st is None:  # after the verdict: the read phase alone
        t_read = time.perf_counter()
        reads()
        report.phases["read"] = time.perf_counter() - t_read
    report.bytes_read, report.comm_method, report.files_read = st.bytes_read, st.method, st.files_read
    report.bytes_hashed += st.bytes_hashed
    report.bytes_sent, report.bytes_received, report.messages_sent = st.bytes_sent, st.bytes_received, st.messages_sent


def _try_warm(state_dict: Mapping[str, Any], path: Any, dist: DistWrapper, plain: bool, verify_checksums: Any
              ) -> tuple[Leaves | None, LoadReport | None]:
    """``(the state's leaves or None, the warm restart's report or None)``: the warm restart reads each rank's own
    file by descriptor (a restart on the disks the save wrote), so it is tried for a ``plain`` load (no mapping)
    from a store whose objects are local files. The leaves are collected once, for the normal path too."""
    if not plain or not storage_for(path).mappable:
        return None, None
    try:
        first = collect_leaves(state_dict)
    except Exception:  # reported by the normal path, on every rank alike
        first = None
    return first, comm.try_warm_start(state_dict, path, dist, data_file_name(dist.rank),
                                      verify_checksums=verify_checksums, leaves=first)


def _work_of(leaves: Leaves, plans: list[LoadPlan]) -> "list[tuple[ReadItem, torch.Tensor]] | FileWork":
    """The (read item, target) pairs of this rank in read order; millions of pieces stay the planner's groups
    (a :class:`FileWork`, made file by file when checked, hashed and read)."""
    if sum(p.item_count() for p in plans) < executor.STREAM_MIN_ITEMS:
        return [(it, sw.local_tensor) for sw, p in zip(leaves.shards, plans)
                for it in sorted(p.all_items(), key=read_order)]
    return FileWork([(it, sw.local_tensor) for sw, p in zip(leaves.shards, plans) for it in p.items],
                    [(label, tmpl, sw.local_tensor) for sw, p in zip(leaves.shards, plans) for label, tmpl in p.groups])


def _sources_read(planner: Planner, dest_all: Any) -> set[str]:
    """The stored keys the whole group's destinations read (and those an AOA config deletes on purpose): what is
    not among them is unexpected."""
    dest_keys = set(planner.program.destination_keys())
    used = {m.src_key for k in dest_all if k in dest_keys for m in planner.mappings(k)}
    return used | set(getattr(planner.program, "deleted_keys", ()) or ())
