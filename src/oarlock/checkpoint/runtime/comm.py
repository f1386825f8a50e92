"""Distributed data movement for loads: node-local files, one reader per file, slices shipped to consumers,
and the communication-free warm restart (``docs/checkpoint-format.md``, "Loading").

Visibility. Each rank passes *its own* view of the checkpoint as ``path``: on a shared filesystem every rank
sees every file; with node-local disks each rank's directory holds only its node's data files (and possibly no
``metadata.json``: then the lowest rank that has it broadcasts its text). One ``all_gather_object`` of the
directory listings tells every rank who sees what.

Readers. When some rank needs bytes from a file it cannot see (or ``comm_method`` forces communication), every
needed file gets exactly one reader (:func:`oarlock.checkpoint.planning.assign.assign_readers`: a rank that needs it if
one sees it, byte-balanced, deterministic). A *piece* is one distinct stored slice some rank needs (its file,
tensor, flat start, array shape and box); it is read once, by its file's reader, and shipped to every other
rank that needs it.

Transfers (``comm_method``):

* ``"grouped_send_recv"``: pieces in one global order (sorted, identical on every rank), cut into batches of at
  most :data:`BATCH_BYTES`; per batch the readers read their pieces, every rank posts its sends and receives
  together with ``torch.distributed.batch_isend_irecv`` and waits. Receive buffers are allocated when the batch
  that carries them starts and freed as soon as their bytes are copied into the targets.
* ``"broadcast"``: one ``broadcast`` per piece from its reader over the whole group; every rank joins (ranks
  that do not need the piece receive it into a scratch buffer), as PaddlePaddle's default method does.
* ``"auto"``: direct byte-range reads when every rank sees every file it needs (a shared filesystem), else
  ``"grouped_send_recv"``.

Devices: buffers live on the backend's device (CUDA for NCCL, CPU for gloo); reads land in CPU memory and are
moved once; copies into targets on any device go through ``Tensor.copy_``.

Warm restart (:func:`try_warm_start`): every data file records, in its safetensors header, the shard box of
each tensor it holds. A load whose requests equal, on every rank, exactly the entries of that rank's own file
(a same-layout restart of a ``save_replicas=True`` checkpoint, or of any layout without replicas) reads only its
own file, with one ``all_reduce`` of a flag and no data communication.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from oarlock.checkpoint.planning.assign import assign_readers
from oarlock.checkpoint.runtime.dist import DistWrapper
from oarlock.checkpoint.errors import CheckpointError
from oarlock.checkpoint.runtime.executor import LoadReport, place, source_shaped_view
from oarlock.checkpoint.formats import load_formats
from oarlock.checkpoint.model.grid import GridLayout, data_file_name, rank_of_file
from oarlock.checkpoint.integrity import (OVERLAP, hash_beside, overlapped_error, verify_own_file,
                                         verify_reads_for_others)
from oarlock.checkpoint.model.metadata import METADATA_FILE, SAVE_ID_HEADER
from oarlock.checkpoint.formats.reader import CheckpointReader, checkpoint_file
from oarlock.checkpoint.storage.safetensors import SafetensorsFile
from oarlock.checkpoint.model.names import SHARDS_DIGEST_HEADER, SHARDS_HEADER, WORLD_HEADER
from oarlock.checkpoint.planning.save import shards_digest, sharded_weight_record
from oarlock.checkpoint.storage import INCOMPLETE_MARKER
from oarlock.checkpoint.runtime.view import View
from oarlock.checkpoint.model.traversal import collect_leaves, set_path
from oarlock.utils import dtype_itemsize, numel, submit, torch_dtype

#: The ``comm_method`` values of :func:`oarlock.checkpoint.load_state_dict`: ``"auto"`` (byte-range reads where every
#: rank sees the files it needs, else slices shipped between ranks), ``"grouped_send_recv"`` or ``"broadcast"``.
COMM_METHODS = ("auto", "grouped_send_recv", "broadcast")
BATCH_BYTES = 128 * 1024 * 1024  # bytes of pieces per grouped send/recv batch (bounds receive buffers)


def check_comm_method(comm_method: str) -> None:
    """Raises:
        CheckpointError: ``comm_method`` is not one of :data:`COMM_METHODS` (naming the valid ones)."""
    if comm_method not in COMM_METHODS:
        raise CheckpointError(f"comm_method={comm_method!r} is not supported; use one of "
                              f"{', '.join(repr(m) for m in COMM_METHODS)}")


@dataclass
class CommStats:
    """What a load moved on this rank (copied into :class:`~oarlock.checkpoint.api.LoadReport`)."""

    method: str = "direct"
    bytes_read: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    bytes_hashed: int = 0  # blocks hashed for pieces read only for other ranks
    files_read: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- load execution

def _piece(it: Any) -> tuple:
    return (it.file, it.name, it.src_key, it.src_flat_start, tuple(it.src_shape), tuple(it.src_box))


def _direct_view(entries: list | None, device: torch.device) -> torch.Tensor | None:
    """The target region a piece lands in unchanged, when it is this rank's only use of the piece, needs no
    permutation or cast, and is contiguous memory on ``device`` (then reads and receives go straight there)."""
    if not entries or len(entries) != 1:
        return None
    it, target = entries[0]
    if it.permute is not None or it.dtype is not None or target.device != device:
        return None
    v = source_shaped_view(it, target)
    return v if v.is_contiguous() else None


def execute(reader: CheckpointReader, work: list[tuple[Any, torch.Tensor]], *, comm_method: str, view: View | None,
            dist: DistWrapper, direct: Callable[[CheckpointReader, list], int], verify_checksums: bool = False
            ) -> CommStats:
    """Run this rank's read items ``work`` ((ReadItem, target tensor) pairs). Collective unless the group has one
    rank. ``direct(reader, work)`` performs byte-range reads into targets and returns the bytes read.
    ``verify_checksums``: also hash the blocks this rank reads only for ranks that cannot see their file
    (``CommStats.bytes_hashed``); what ranks read for themselves was verified before (``verify_group``).

    Raises:
        CheckpointError: (every rank alike) a needed file visible to no rank; a piece read for another rank
            whose file is truncated or lacks the array (:class:`CheckpointFormatError`) or whose blocks do not
            match their checksums (:class:`ChecksumError`), before any piece is read or written.
    """
    stats = CommStats()
    world = dist.size
    if world == 1 or view is None:
        stats.bytes_read = direct(reader, work)
        stats.files_read = list(reader.files_opened)
        return stats
    files = reader.metadata.files
    sets = [next(iter(view.visible.values()))] if view.same and view.visible else list(view.visible.values())
    if comm_method == "auto" and (view.store or all(f in v for v in sets for f in files)):
        # every rank lists every data file (a shared filesystem): no further exchange needed
        stats.bytes_read = direct(reader, work)
        stats.files_read = list(reader.files_opened)
        return stats
    rank = dist.rank
    mine: dict[tuple, list] = {}
    for it, target in work:
        mine.setdefault(_piece(it), []).append((it, target))
    # visibility of the data files themselves (stat, so files in subdirectories of the checkpoint count too)
    seen = sorted(reader.visible_files())
    both = dist.all_gather_object((sorted(mine), seen))
    gathered = [b[0] for b in both]
    visible = {r: set(b[1]) for r, b in enumerate(both)}
    if comm_method == "auto":
        if all(p[0] in visible[r] for r, ps in enumerate(gathered) for p in ps):
            stats.bytes_read = direct(reader, work)
            stats.files_read = list(reader.files_opened)
            return stats
        comm_method = "grouped_send_recv"
    stats.method = comm_method
    consumers: dict[tuple, list[int]] = {}
    for r, ps in enumerate(gathered):
        for p in ps:
            consumers.setdefault(p, []).append(r)
    tensors = reader.metadata.tensors
    pbytes = {p: numel(b - a for a, b in p[5]) * dtype_itemsize(tensors[p[2]].dtype) for p in consumers}
    needs: dict[int, dict[str, int]] = {r: {} for r in range(world)}
    file_bytes: dict[str, int] = {}
    for p, cs in consumers.items():
        file_bytes[p[0]] = file_bytes.get(p[0], 0) + pbytes[p]
        for r in cs:
            needs[r][p[0]] = needs[r].get(p[0], 0) + pbytes[p]
    readers = assign_readers(needs, visible, file_bytes)  # raises alike on every rank
    order = sorted(consumers)
    # The pieces this rank reads only for other ranks were checked by nobody (the load checks, and verifies, what
    # each rank reads for itself in the files it sees): their files are opened here (the header's data offsets
    # against the file size: a truncated copy), their arrays checked and, with ``verify_checksums``, the blocks
    # they touch hashed; the ranks agree before any piece is read, sent or written into a target.
    err = None
    try:
        theirs = [p for p in order if readers[p[0]] == rank and p not in mine]
        for p in theirs:
            reader.check_read(p[2], p[0], p[1], p[3], p[4])
        if verify_checksums and theirs:
            stats.bytes_hashed = verify_reads_for_others(reader, theirs, (it for it, _ in work))
    except Exception as e:  # reported on every rank alike
        err = e
    dist.check(err)
    remote = [p for p in order if any(c != readers[p[0]] for c in consumers[p])]
    device = dist.comm_device()

    def read(p: tuple) -> torch.Tensor:
        # straight into this rank's own target when it needs the piece as is; the target region is then sent
        out = _direct_view(mine.get(p), torch.device("cpu"))
        t = reader.read_box(p[2], p[0], p[1], p[3], p[4], p[5], out=out)
        stats.bytes_read += pbytes[p]
        return t.to(device) if t.device != device else t

    def alloc(p: tuple) -> torch.Tensor:
        v = _direct_view(mine.get(p), device)  # receive straight into the target when possible
        if v is not None:
            return v
        return torch.empty([b - a for a, b in p[5]], dtype=torch_dtype(tensors[p[2]].dtype), device=device)

    with torch.no_grad():
        if comm_method == "broadcast":
            _broadcast(remote, readers, consumers, mine, dist, stats, read, alloc, pbytes)
        else:
            _grouped(remote, readers, consumers, mine, dist, stats, read, alloc, pbytes)
        # pieces only this rank needs, from a file it reads itself: straight into the targets
        local = [w for p in order if readers[p[0]] == rank and consumers[p] == [rank] for w in mine[p]]
        stats.bytes_read += direct(reader, local)
    stats.files_read = list(reader.files_opened)
    return stats


def _grouped(remote, readers, consumers, mine, dist, stats, read, alloc, pbytes) -> None:
    from concurrent.futures import ThreadPoolExecutor

    batches: list[list[tuple]] = []
    size = 0
    for p in remote:  # the same cut on every rank: computed from all-gathered data only
        if not batches or size + pbytes[p] > BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(p)
        size += pbytes[p]

    def read_batch(batch: list[tuple]) -> dict[tuple, torch.Tensor]:
        return {p: read(p) for p in batch if readers[p[0]] == dist.rank}

    # the next batch is read in a thread (preads release the GIL) while this one is on the wire
    with ThreadPoolExecutor(1) as pool:
        nxt = submit(pool, read_batch, batches[0]) if batches else None
        for k, batch in enumerate(batches):
            bufs = nxt.result()
            nxt = submit(pool, read_batch, batches[k + 1]) if k + 1 < len(batches) else None
            _exchange(batch, bufs, readers, consumers, mine, dist, stats, alloc, pbytes)


def _exchange(batch, bufs, readers, consumers, mine, dw, stats, alloc, pbytes) -> None:
    """One batch: post every send and receive of this rank together, wait, place the received pieces."""
    import torch.distributed as dist

    rank, group = dw.rank, dw.group
    ops = []
    for p in batch:
        src = readers[p[0]]
        if src == rank:
            for c in consumers[p]:
                if c != rank:
                    ops.append(dist.P2POp(dist.isend, bufs[p], dw.global_rank(c), group))
                    stats.messages_sent += 1
                    stats.bytes_sent += pbytes[p]
        elif rank in consumers[p]:
            bufs[p] = alloc(p)  # allocated when its batch starts
            ops.append(dist.P2POp(dist.irecv, bufs[p], dw.global_rank(src), group))
            stats.bytes_received += pbytes[p]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    for p in batch:
        buf = bufs.pop(p, None)
        if buf is not None and p in mine:
            for it, target in mine[p]:
                place(buf, it, target)
        del buf  # freed as soon as its slices are placed


def _broadcast(remote, readers, consumers, mine, dw, stats, read, alloc, pbytes) -> None:
    import torch.distributed as dist

    rank = dw.rank
    for p in remote:
        src = readers[p[0]]
        if src == rank:
            buf = read(p)
            stats.messages_sent += 1
            stats.bytes_sent += pbytes[p]
        else:
            buf = alloc(p)
            stats.bytes_received += pbytes[p]
        dist.broadcast(buf, src=dw.global_rank(src), group=dw.group)
        if p in mine:
            for it, target in mine[p]:
                place(buf, it, target)
        del buf


# ---------------------------------------------------------------- warm restart

def _warm_matches(meta: Any, leaves: Any, data_file: str) -> bool:
    """Whether ``metadata.json`` describes every requested shard as stored, with the requested global shape and
    dtype, in ``data_file`` under its key, and holds every requested JSON object."""
    for sw in leaves.shards:
        d = sw.desc
        t = meta.tensors.get(d.key)
        if t is None or tuple(t.global_shape) != tuple(d.global_shape) or t.dtype != d.dtype:
            return False
        fr = tuple(d.flattened_range) if d.flattened_range is not None else None
        if isinstance(t.grid, GridLayout) and t._shards is None:  # a grid record: the rule, not a list, says what the file holds
            cell = t.grid.cell_of(t.global_shape, d.global_offset) if t.global_shape else ()
            if fr is not None or cell is None or data_file_name(t.grid.writer(cell)) != data_file:
                return False
            bounds = t.grid.bounds(t.global_shape)
            if tuple(b[e + 1] - b[e] for b, e in zip(bounds, cell)) != tuple(d.local_shape):
                return False
            continue
        if not any(s.file == data_file and s.name == d.key and tuple(s.global_offset) == tuple(d.global_offset)
                   and tuple(s.local_shape) == tuple(d.local_shape) and s.flattened_range == fr for s in t.shards):
            return False
    return all(k in meta.objects for k in leaves.objects)


def try_warm_start(state_dict: Any, path: str | os.PathLike, dist: DistWrapper, data_file: str, *,
                   verify_checksums: bool = True, leaves: Any = None) -> LoadReport | None:
    """Same-layout restart without planning or communication (see ``docs/checkpoint-format.md``, warm restart).
    ``leaves``: the state's :func:`~oarlock.checkpoint.model.traversal.collect_leaves`, when the caller has them.

    Each rank compares its requested shards with the shard records in the header of its own data file
    ``data_file`` and with ``metadata.json`` (global shapes, dtypes, shard boxes, file; a rank whose node-local
    directory lacks ``metadata.json`` relies on the ranks that have it); one ``all_gather_object`` of the match
    flags and save ids decides for all: the path is taken only when every rank matched and every data file and
    ``metadata.json`` belong to the same save. On a match every rank reads its own
    file straight into its targets and a :class:`~oarlock.checkpoint.runtime.executor.LoadReport` with
    ``comm_method="warm"`` is returned; otherwise None (nothing was written) and the normal load runs. With
    ``verify_checksums`` every rank first verifies all blocks of its own file (:mod:`oarlock.checkpoint.integrity`;
    ``LoadReport.bytes_hashed``) and the ranks agree on the verdict (one more ``all_reduce`` of a flag) before any
    target is written.

    Raises:
        ChecksumError: on every rank alike, when some rank's own file does not match its checksums.
        CheckpointError (or the format error of the failing read): on every rank alike when a read fails on any
            rank after the ranks agreed on the warm path.
    """
    t_start = time.perf_counter()
    p = Path(path)
    ok = has_meta = False
    sf = meta = None
    file_id = meta_id = None
    try:
        leaves = collect_leaves(state_dict) if leaves is None else leaves
        fpath = checkpoint_file(p, data_file, str(p))
        if p.is_dir() and not (p / INCOMPLETE_MARKER).exists() and fpath.is_file():
            sf = SafetensorsFile(fpath)
            rec = sf.header_metadata.get(SHARDS_HEADER)
            digest = sf.header_metadata.get(SHARDS_DIGEST_HEADER)
            file_id = sf.header_metadata.get(SAVE_ID_HEADER)
            mine = {sw.key: sharded_weight_record(sw) for sw in leaves.shards}
            ok = sf.header_metadata.get(WORLD_HEADER) == str(dist.size) and (
                json.loads(rec) == mine if rec is not None else digest is not None and digest == shards_digest(mine))
            has_meta = (p / METADATA_FILE).exists()
            if ok and has_meta:  # validated against metadata.json like every other load
                with load_formats()["oarlock"].open(p, partial=True) as r:
                    meta = r.metadata
                meta_id = meta.save_id
                ok = _warm_matches(meta, leaves, data_file)
                if ok:  # a packed file's pieces are located from the metadata's grid records
                    sf.use_packed(meta.packed_layout(), rank_of_file(data_file))
            elif leaves.objects or sf.packed:
                ok = False
    except Exception:  # any doubt: the normal path reports errors properly
        ok = False
    # one all_reduce decides for all: every rank matched (its metadata.json, if it has one, is of its file's
    # save), some rank read metadata.json, and every rank's data file is of one save (equal codes: min == max)
    ok = ok and (not has_meta or meta_id == file_id)
    code = int.from_bytes(hashlib.sha256(file_id.encode()).digest()[:7], "little") + 1 if file_id else 0
    lo, hi = dist.min_max([int(ok), int(has_meta), code])
    ok = lo[0] == 1 and hi[1] == 1 and lo[2] == hi[2]
    if not ok:
        if sf is not None:
            sf.close()
        return None
    report = LoadReport(comm_method="warm", files_read=[data_file])
    report.phases["plan"] = time.perf_counter() - t_start
    if verify_checksums == OVERLAP:
        return _warm_overlapped(report, p, data_file, sf, leaves, state_dict, meta, dist)
    if verify_checksums:
        # the whole own file is read: each rank hashes all of it (and nothing else), and the ranks agree before
        # any rank writes a target, so a corrupt file on one rank leaves every rank's targets untouched
        err = None
        try:
            report.bytes_hashed = verify_own_file(p, data_file)
        except Exception as e:  # reported to every rank by the check below
            err = e
        t_verdict = time.perf_counter()
        report.phases["verify"] = t_verdict - t_start - report.phases["plan"]
        try:
            dist.check(err)
        except BaseException:
            sf.close()
            raise
        report.phases["verdict"] = time.perf_counter() - t_verdict
    t_read = time.perf_counter()

    # every rank is on the warm path now: a read error on one rank must reach all of them (they would otherwise
    # go on into their next collective and wait for this rank forever)
    dist.run(_read_own_file, report, sf, leaves, state_dict, meta)
    report.phases["read"] = time.perf_counter() - t_read
    return report


def _read_own_file(report: LoadReport, sf: SafetensorsFile, leaves: Any, state_dict: Any, meta: Any) -> None:
    """The warm path's reads: every requested shard straight from this rank's own file into its target (the file
    is closed after), then the non-tensor values; adds the bytes to ``report.bytes_read``."""
    try:
        with torch.no_grad():
            for sw in leaves.shards:
                dt, shape, _, _ = sf.entries[sw.key]
                t = sw.local_tensor
                out = t.view(shape) if t.is_contiguous() else torch.empty(shape, dtype=t.dtype)
                sf.read_box(sw.key, 0, shape, tuple((0, n) for n in shape), dt, out)
                if out is not t and out.data_ptr() != t.data_ptr():
                    t.copy_(out.view(t.shape))
                report.bytes_read += numel(shape) * dtype_itemsize(dt)
    finally:
        sf.close()
    if leaves.objects:
        objects = meta.objects
        for k, path_ in leaves.object_paths.items():
            if k in objects:
                set_path(state_dict, path_, objects[k])


def _warm_overlapped(report: LoadReport, root: Any, data_file: str, sf: SafetensorsFile, leaves: Any,
                     state_dict: Any, meta: Any, dist: DistWrapper) -> LoadReport:
    """The warm path with ``verify_checksums="overlap"``: this rank's own file is hashed on a second thread while it
    is read into the targets (the disk is read once), then the ranks agree on the verdict; a mismatch raises on
    every rank, saying the targets hold unspecified contents."""
    def hash_own() -> None:
        report.bytes_hashed = verify_own_file(root, data_file, workers=1)  # one thread: the reads have the pool

    t_read = time.perf_counter()
    # the read's own error (raised on every rank by dist.run) propagates once the hashing has stopped
    err, report.phases["read"] = hash_beside(hash_own, lambda: dist.run(_read_own_file, report, sf, leaves,
                                                                          state_dict, meta))
    t1 = time.perf_counter()
    report.phases["verify"] = t1 - t_read - report.phases["read"]
    err = overlapped_error(err)
    dist.check(err)
    report.phases["verdict"] = time.perf_counter() - t1
    return report
