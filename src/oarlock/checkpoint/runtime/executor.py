"""The load executor: run planned read items into destination tensors.

A :class:`~oarlock.checkpoint.planning.load.ReadItem` says which box of which stored array lands where in a destination
shard (its box, or a flat range of a flattened shard), with an optional permutation and cast.
:func:`destination_view` is the one definition of "where": the view of the target tensor an item writes. Reads
go straight into that view when nothing needs permuting or casting (``os.preadv`` into the target's memory).
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from oarlock.checkpoint.model.mapping import box_extent, box_slices, cast_tensor
from oarlock.checkpoint.storage import storage_for
from oarlock.checkpoint.formats.reader import CheckpointReader
from oarlock.checkpoint.model.sharded import box_volume
from oarlock.utils import dtype_itemsize, numel, submit


@dataclass
class LoadReport:
    """What a load did not match (filled when ``strict=False``; with ``strict=True`` these raise).

    Attributes:
        missing_keys: requested keys (on any rank) the checkpoint or mapping program cannot provide; their
            targets are left untouched.
        unexpected_keys: stored keys that no rank requested (and no mapping read).
        bytes_read: bytes this rank read from the checkpoint's data files.
        comm_method: how data reached this rank: ``"direct"`` (own byte-range reads), ``"warm"`` (own file
            only, no communication), ``"grouped_send_recv"`` or ``"broadcast"`` (see
            :mod:`oarlock.checkpoint.runtime.comm`).
        files_read: data files this rank opened.
        bytes_sent, bytes_received: tensor bytes this rank sent to / received from other ranks.
        messages_sent: point-to-point sends (or broadcasts as the source) this rank issued.
        bytes_hashed: bytes of data files this rank hashed to verify block checksums before writing: its share of
            the blocks the group's reads touch (each hashed by one rank), or its whole own file on the warm path;
            0 with ``verify_checksums=False`` or a checkpoint without checksums.
    """

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    bytes_read: int = 0
    comm_method: str = "direct"
    files_read: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    bytes_hashed: int = 0
    skipped_keys: list[str] = field(default_factory=list)
    """requested keys an AOA config deliberately does not load (``_ -> key``, or named like a key dropped with
    ``key -> _``): left untouched, and no error under ``strict=True``."""
    phases: dict[str, float] = field(default_factory=dict)
    """seconds this rank spent in each phase of the load, in order: ``plan`` (metadata, requests, planning, the
    checks of every read), ``verify`` (hashing this rank's share of the touched blocks), ``verdict`` (waiting
    for the group's verdict), ``read`` (reading into the targets, with any exchange between ranks). Wall-clock
    time, for benchmarks and profiles."""


def read_order(it: Any) -> tuple:
    """Sort key of read items: file, tensor, position in the tensor (sequential reads)."""
    return (it.file, it.name, it.src_flat_start, it.src_box)


def destination_view(it: Any, target: torch.Tensor) -> torch.Tensor:
    """The view of ``target`` (a destination shard) that read item ``it`` writes: its ``dst_box`` inside the
    ``dst_shape`` array starting ``dst_flat_start`` elements into ``target`` (the whole target for a regular
    shard)."""
    if it.dst_flat_start or target.dim() != len(it.dst_shape):
        view = target.reshape(-1)[it.dst_flat_start:it.dst_flat_start + numel(it.dst_shape)].view(it.dst_shape)
    else:
        view = target
    return view[box_slices(it.dst_box)]


def source_shaped_view(it: Any, target: torch.Tensor) -> torch.Tensor:
    """:func:`destination_view` seen with the extent of the item's source box, for reads and receives straight into
    the target when nothing needs permuting or casting (an AOA ``reshape=`` may add or remove unit axes between
    the two boxes; viewing through unit axes never copies)."""
    view = destination_view(it, target)
    ext = box_extent(it.src_box)
    return view if tuple(view.shape) == ext else view.view(ext)


def place(buf: torch.Tensor, it: Any, target: torch.Tensor) -> None:
    """Copy ``buf`` (the item's source box, as read or received) into its place in ``target``, permuting and
    casting on the way; nothing to do when ``buf`` already is that place."""
    view = destination_view(it, target)
    t = buf.permute(*it.permute) if it.permute is not None else buf
    if t.shape != view.shape:  # unit axes added or removed by a reshape
        view = view.view(t.shape)
    if view.data_ptr() == buf.data_ptr() and view.shape == buf.shape:
        return
    view.copy_(cast_tensor(t, it.dtype))


def execute_items(reader: CheckpointReader, target: torch.Tensor, items: list[Any]) -> int:
    """Run one target's read items (in file order); returns the bytes read."""
    nbytes = 0
    for it in sorted(items, key=read_order):
        if it.permute is None and it.dtype is None:
            dst = source_shaped_view(it, target)
            reader.read_box(it.src_key, it.file, it.name, it.src_flat_start, it.src_shape, it.src_box, out=dst)
        else:
            place(reader.read_box(it.src_key, it.file, it.name, it.src_flat_start, it.src_shape, it.src_box), it,
                  target)
        nbytes += it.numel * dtype_itemsize(reader.metadata.tensors[it.src_key].dtype)
    return nbytes


#: A file's reads are coalesced into one read of the span they cover when the span is at most this many bytes ...
COALESCE_MAX_BYTES = 64 * 1024 * 1024
#: ... and at most this many times the bytes the items need (else each item reads its own byte ranges).
COALESCE_MAX_WASTE = 16
_INT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _np_target(target: torch.Tensor, cache: dict) -> np.ndarray | None:
    """``target``'s memory as a numpy array of unsigned integers of the same item size (copies move bytes, so the
    dtype only needs the right width: bfloat16 and float8 work too), or None when not possible (not CPU)."""
    key = id(target)
    if key not in cache:
        arr = None
        if target.device.type == "cpu" and target.element_size() in _INT_OF_SIZE:
            t = target.detach()
            int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
            try:
                arr = t.view(int_dtype).numpy().view(_INT_OF_SIZE[t.element_size()])
            except (RuntimeError, TypeError, ValueError):
                arr = None
        cache[key] = (target, arr)  # the target is kept alive with its id
    return cache[key][1]


def _np_destination(it: Any, arr: np.ndarray) -> np.ndarray | None:
    """:func:`destination_view` on a numpy view of the target; None when it would need a copy (a flat or reshaped
    view of non-contiguous memory)."""
    if it.dst_flat_start or arr.ndim != len(it.dst_shape):
        if not arr.flags.c_contiguous:
            return None
        arr = arr.reshape(-1)[it.dst_flat_start:it.dst_flat_start + numel(it.dst_shape)].reshape(it.dst_shape)
    view = arr[tuple(slice(a, b) for a, b in it.dst_box)] if it.dst_box else arr[...]  # 0-d: a view, not a scalar
    ext = tuple(b - a for a, b in it.src_box)
    if view.shape != ext:
        if numel(view.shape) != numel(ext):
            return None
        try:
            view = view.reshape(ext) if view.flags.c_contiguous else view.view().reshape(ext)
        except ValueError:
            return None
    return view


@dataclass
class Lookups:
    """What the files of one load share while their items are prepared: thousands of items share a key's dtype, a
    box shape, a target (a reshard of many small shards spends its time per item, not in the reads).

    ``views``: target id -> (target, numpy view) (:func:`_np_target`); ``dtypes``: key -> (dtype, item size);
    ``geometry``: (stored shape, box, item size) -> (first byte, last byte + 1, extent, byte strides, bytes);
    ``slices``: destination box -> slices."""

    views: dict = field(default_factory=dict)
    dtypes: dict = field(default_factory=dict)
    geometry: dict = field(default_factory=dict)
    slices: dict = field(default_factory=dict)


@dataclass
class FileReads:
    """The checked reads of one data file's items, worked out before anything is written (:func:`prepare_file`).

    ``fast``: ``(destination array, slices or None, first byte, geometry)`` of the items (the destination is
    ``array[slices]`` when slices are given, else the array itself) that can be copied out of one read of the
    span ``[lo, hi)`` of the file (``need`` bytes of it used); ``slow``: ``(item, target)`` pairs read item by item
    (a permutation, a cast, a target numpy cannot view); ``coalesce``: whether the fast items are read as one span
    (many small reads of a dense region), else every item is read by itself (:func:`execute_items`) and
    ``fast``/``slow`` are left empty (nothing per item is held until the reads); None: the items were checked but
    their reads are worked out again when the file is read (:func:`prepare_work` of a :class:`FileWork`);
    ``nbytes``: the bytes all the items need."""

    fast: list = field(default_factory=list)
    slow: list = field(default_factory=list)
    lo: int = 0
    hi: int = 0
    need: int = 0
    nbytes: int = 0
    coalesce: bool | None = False


def prepare_file(reader: CheckpointReader, file: str, work: list[tuple[Any, torch.Tensor]],
                 cache: Lookups | None = None) -> FileReads:
    """Check the items of one data file (the file opens and belongs to this save, each stored array is there with
    its key's dtype and holds the array the item reads from) and work out where each item's bytes are, without
    reading data. Files read item by item whatever their items (few items, formats with data files of their own)
    have their items checked with :meth:`~oarlock.checkpoint.formats.reader.CheckpointReader.check_read` and only their
    bytes counted. ``cache``: the :class:`Lookups` shared by the files of one load.

    Raises:
        CheckpointFormatError: naming the file and tensor.
    """
    if len(work) < 4 or type(reader).read_box is not CheckpointReader.read_box or not file.endswith(".safetensors"):
        reader.check_items(it for it, _ in work)
        tensors = reader.metadata.tensors
        return FileReads(nbytes=sum(box_volume(it.src_box) * dtype_itemsize(tensors[it.src_key].dtype)
                                    for it, _ in work))
    tensors = reader.metadata.tensors
    f = reader.safetensors_file(file)
    cache = Lookups() if cache is None else cache
    views, dtypes, geometry, slices = cache.views, cache.dtypes, cache.geometry, cache.slices
    out = FileReads()
    fast, slow = out.fast, out.slow
    lo, hi, need, nbytes = None, 0, 0, 0
    data_start = f.data_start
    check_array = f.check_array
    packed_begin = getattr(f.entries, "packed_begin", None)  # packed data files: pieces located arithmetically
    for it, target in work:
        dt = dtypes.get(it.src_key)
        if dt is None:
            dtype = tensors[it.src_key].dtype
            dt = dtypes[it.src_key] = (dtype, dtype_itemsize(dtype))
        dtype, isz = dt
        src_box, src_shape = it.src_box, it.src_shape
        # the check of every item, fast or slow, before anything is written
        flat = it.src_flat_start
        b = packed_begin(it.name, dtype, src_shape) if packed_begin is not None and not flat else None
        begin = data_start + (b if b is not None else check_array(it.name, flat, src_shape, dtype)) + int(flat) * isz
        gk = (src_shape, src_box, isz)
        geo = geometry.get(gk)
        if geo is None:
            strides = [isz] * len(src_shape)
            for d in range(len(src_shape) - 2, -1, -1):
                strides[d] = strides[d + 1] * int(src_shape[d + 1])
            first = last = 0
            for (x, y), st in zip(src_box, strides):
                first += x * st
                last += (y - 1) * st
            geo = geometry[gk] = (first, last + isz, tuple(y - x for x, y in src_box), tuple(strides),
                                  box_volume(src_box) * isz)
        nbytes += geo[4]
        dst = sl = None
        if it.permute is None and it.dtype is None:
            arr = views.get(id(target))
            arr = arr[1] if arr is not None else _np_target(target, views)
            if arr is not None and arr.itemsize == isz:
                # the common case of _np_destination inline (a box of a regular target), its slices cached by box
                if not it.dst_flat_start and arr.ndim == len(it.dst_shape):
                    sl = slices.get(it.dst_box)
                    if sl is None:
                        sl = slices[it.dst_box] = tuple(slice(a, b) for a, b in it.dst_box)
                    dst = arr[sl] if sl else arr[...]  # 0-d: a view, not a scalar
                    if dst.shape != geo[2]:
                        dst, sl = _np_destination(it, arr), None
                    else:
                        dst = arr  # kept as (target array, shared slices): the view is made again at the read
                else:
                    dst = _np_destination(it, arr)
        if dst is None:
            slow.append((it, target))
            continue
        start, stop = begin + geo[0], begin + geo[1]
        # a numpy view costs ~140 bytes more than a reference to the target and to slices shared by every item
        # with the same destination box; a coalesced file keeps one entry per item until its read
        fast.append((dst, sl, start, geo))
        if lo is None or start < lo:
            lo = start
        if stop > hi:
            hi = stop
        need += stop - start
    out.nbytes = nbytes
    if fast:
        out.lo, out.hi, out.need = lo, hi, need
        # worth it only for many small reads: large ones go straight into their targets with no extra copy
        out.coalesce = not (hi - lo > COALESCE_MAX_BYTES or hi - lo > COALESCE_MAX_WASTE * need
                            or need > len(fast) * (256 << 10))
    if not out.coalesce:  # read item by item: the views are not kept until the reads (millions at scale)
        out.fast, out.slow = [], []
    return out


#: A load of at least this many read items holds them as a :class:`FileWork` (made file by file when needed) ...
STREAM_MIN_ITEMS = 1 << 18
#: ... and keeps the coalesced reads worked out by :func:`prepare_work` for at most this many items in all (the
#: files beyond are checked then, and worked out again at their read).
RETAIN_ITEMS = 1 << 18


class FileWork:
    """A rank's ``(read item, target)`` pairs held as the planner's compact groups (each
    :data:`~oarlock.checkpoint.planning.load.ItemGroup` with its target) plus listed pairs, made file by file on
    demand: a
    rank that reads millions of stored pieces holds the pairs of one data file at a time, not all of them (a load
    from thousands of FSDP ranks). Memory: the templates (one per grid geometry) and one label per key, instead of
    ~400 bytes per read item.

    ``files``: the data files read, sorted; ``len()``: the number of pairs; iterating yields every pair, file by
    file (each file's pairs unsorted, see :meth:`pairs_of`)."""

    def __init__(self, pairs: list[tuple[Any, torch.Tensor]], groups: list[tuple[tuple, list, torch.Tensor]]):
        self._listed: dict[str, list] = {}
        for it, target in pairs:
            self._listed.setdefault(it.file, []).append((it, target))
        # one entry per template (shared by the keys of a geometry): its pieces by file, and the (label, target)
        # pairs that use it
        self._templates: dict[int, tuple[dict[str, list], list, list]] = {}
        count = len(pairs)
        for label, tmpl, target in groups:
            entry = self._templates.get(id(tmpl))
            if entry is None:
                by_file: dict[str, list] = {}
                for f in tmpl:
                    by_file.setdefault(f[1], []).append(f)
                for pieces in by_file.values():  # (src_flat_start, src_box): read order within one stored array
                    pieces.sort(key=lambda f: (f[2], f[4]))
                entry = self._templates[id(tmpl)] = (by_file, [], tmpl)  # tmpl kept alive with its id
            entry[1].append((label, target))
            count += len(tmpl)
        for _, users, _ in self._templates.values():
            users.sort(key=lambda u: u[0][3])  # by stored key: with the pieces sorted, a template's items are in
            # read order for any file, and a file read through one template needs no sort
        files = set(self._listed)
        for by_file, _, _ in self._templates.values():
            files.update(by_file)
        self.files = sorted(files)
        self._count = count

    def __len__(self) -> int:
        return self._count

    def pairs_of(self, file: str, ordered: bool = True) -> list[tuple[Any, torch.Tensor]]:
        """The pairs reading from ``file``, in :func:`read_order` when ``ordered`` (else in runs of it, one per
        template: what checks, hashing and coalesced reads need, without a sort of millions of items)."""
        from oarlock.checkpoint.planning.load import ReadItem

        out = list(self._listed.get(file, ()))
        sources = len(out) > 0
        new = tuple.__new__  # ReadItem(...) without the named tuple constructor's Python frame
        for by_file, users, _ in self._templates.values():
            pieces = by_file.get(file)
            if pieces:
                sources += 1
                # plan.expand_group inline, one comprehension per template and file (a rank makes millions of
                # these); users outer, pieces inner: read order
                out.extend([(new(ReadItem, (u[0], u[1], u[2], f[0], u[3], f[1], u[3], f[2], f[3], f[4], None, u[4])),
                             t) for u, t in users for f in pieces])
        if sources > 1 and ordered:
            out.sort(key=lambda p: read_order(p[0]))
        return out

    def __iter__(self):
        for f in self.files:
            yield from self.pairs_of(f, ordered=False)


def prepare_work(reader: CheckpointReader, work: "list[tuple[Any, torch.Tensor]] | FileWork",
                 files: set[str] | None = None, on_file: Any = None) -> dict[str, FileReads]:
    """:func:`prepare_file` of every data file of ``work`` (``(read item, target)`` pairs), or of those in
    ``files``: the load calls it on everything a rank reads itself before the first target byte is written and
    keeps the files open, so that the reads see the files it checked; :func:`execute_work` then reuses the result.
    For a :class:`FileWork` the files are checked one at a time, and a coalesced file's reads are kept only within
    :data:`RETAIN_ITEMS` in all (a file left out of the result was checked and is worked out again at its read;
    the returned dict then maps it to a :class:`FileReads` with ``coalesce=None`` carrying only ``nbytes``);
    ``on_file(file, pairs, file_reads)`` is then called for each file while its pairs are at hand (the load sums
    the checksum blocks they touch in the same pass).

    Raises:
        CheckpointFormatError: naming the file and tensor.
    """
    if isinstance(work, FileWork):
        shared, out, kept = Lookups(), {}, 0
        for f in work.files:
            if files is not None and f not in files:
                continue
            pairs = work.pairs_of(f, ordered=False)
            p = prepare_file(reader, f, pairs, shared)
            if on_file is not None:
                on_file(f, pairs, p)
            if p.coalesce:
                if kept + len(pairs) > RETAIN_ITEMS:
                    p = FileReads(nbytes=p.nbytes, coalesce=None)
                else:
                    kept += len(pairs)
            out[f] = p
        return out
    by_file: dict[str, list] = {}
    for it, target in work:
        if files is None or it.file in files:
            by_file.setdefault(it.file, []).append((it, target))
    shared = Lookups()
    return {f: prepare_file(reader, f, w, shared) for f, w in by_file.items()}


def execute_file(reader: CheckpointReader, file: str, work: list[tuple[Any, torch.Tensor]],
                 cache: Lookups | None = None, prepared: FileReads | None = None) -> int:
    """Run the items of one data file: when they are many small reads of a dense region (a reshard across many
    small shards), read the span they cover once (one ``preadv``) and copy every box out of that buffer; else
    item by item (:func:`execute_items`). ``prepared``: this file's :func:`prepare_file` (worked out here when
    None). Returns the bytes the items need."""
    p = prepared if prepared is not None and prepared.coalesce is not None else prepare_file(reader, file, work, cache)
    if not p.coalesce:  # item by item, in read order (sequential reads of the file)
        return sum(execute_items(reader, t, [it]) for it, t in sorted(work, key=lambda w: read_order(w[0])))
    buf = np.empty(p.hi - p.lo, dtype=np.uint8)
    reader.safetensors_file(file).read_into(memoryview(buf), p.lo)  # os.preadv; ranged GETs in a store
    lo, ndarray, copyto = p.lo, np.ndarray, np.copyto
    for dst, sl, start, (_, _, ext, strides, _) in p.fast:
        if sl is not None:  # (target array, slices): the destination view
            dst = dst[sl] if sl else dst[...]
        # the box as a strided view of the buffer (numpy accepts unaligned items), copied into the target
        src = ndarray(ext, dtype=dst.dtype, buffer=buf, offset=start - lo, strides=strides)
        copyto(dst, src if src.shape == dst.shape else src.reshape(dst.shape))
    for it, target in p.slow:
        execute_items(reader, target, [it])
    return p.nbytes


#: Loads moving less than this read in the calling thread only (a pool costs more than it saves).
PARALLEL_MIN_BYTES = 64 * 1024 * 1024


def io_threads() -> int:
    """Reader threads of one load: ``OARLOCK_IO_THREADS`` when set (1 disables the pool), else
    ``min(4, CPUs)``."""
    env = os.environ.get("OARLOCK_IO_THREADS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            pass
    return max(1, min(4, os.cpu_count() or 1))


_pool_local = threading.local()


@functools.lru_cache(maxsize=None)
def _shared_pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"oarlock-io{workers}")


if hasattr(os, "register_at_fork"):  # a forked child inherits the pools but not their threads
    os.register_at_fork(after_in_child=_shared_pool.cache_clear)


def pool_map(fn: Any, items: Any, workers: int) -> list:
    """``[fn(x) for x in items]`` on up to ``workers`` threads kept for the life of the process (one pool per
    size: a load's reads and hashing start no thread, which on a loaded machine cost milliseconds each). Every
    call has finished when this returns, also when one raised (the first exception, in item order, is
    re-raised). Called from one of these threads, or with one worker or item, it runs inline (no nesting)."""
    items = list(items)
    if workers <= 1 or len(items) <= 1 or getattr(_pool_local, "inside", False):
        return [fn(x) for x in items]

    def run(x: Any) -> Any:
        _pool_local.inside = True
        return fn(x)

    pool = _shared_pool(workers)
    futures = [submit(pool, run, x) for x in items]
    wait(futures)
    return [f.result() for f in futures]


def execute_work(reader: CheckpointReader, work: list[tuple[Any, torch.Tensor]], threads: int | None = None,
                 prepared: dict[str, FileReads] | None = None) -> int:
    """Run ``(read item, target)`` pairs; returns the bytes read.

    Large loads (at least :data:`PARALLEL_MIN_BYTES`) run on a small pool of reader threads (``threads``, default
    :func:`io_threads`), as DCP's and Paddle's readers do: ``os.preadv`` and tensor copies release the GIL, so
    reads of different byte ranges overlap. The work is cut into contiguous runs of the given order (one file
    read front to back per thread where possible); items write disjoint parts of their targets, so the result is
    the same as a sequential run. Every data file is opened before the threads start. Readers of formats that
    override ``read_box`` (their own data files) always read in the calling thread. ``prepared``: the
    :func:`prepare_work` of ``work`` (checked and located before anything was written), reused by the reads.
    """
    n = threads or io_threads()
    conc = storage_for(reader.root).read_concurrency
    if threads is None and conc:  # a latency-bound store: its requests in flight together
        n = max(n, conc)
    tensors = reader.metadata.tensors
    prepared = prepared or {}
    if isinstance(work, FileWork):
        return _execute_streamed(reader, work, n, prepared)
    by_file: dict[str, list] = {}
    for it, target in work:
        by_file.setdefault(it.file, []).append((it, target))
    sizes: dict[str, int] = {}  # item size per key: a load has thousands of items per key
    volumes: dict[tuple, int] = {}  # ... and they share a few box shapes
    total = 0
    for f, w in by_file.items():
        p = prepared.get(f)
        if p is not None:  # summed when it was prepared
            total += p.nbytes
            continue
        for it, _ in w:
            isz = sizes.get(it.src_key)
            if isz is None:
                isz = sizes[it.src_key] = dtype_itemsize(tensors[it.src_key].dtype)
            v = volumes.get(it.src_box)
            if v is None:
                v = volumes[it.src_box] = box_volume(it.src_box)
            total += v * isz
    # only the base class's safetensors byte-range reads are known to be thread safe (formats may cache state)
    base_reads = type(reader).read_box is CheckpointReader.read_box
    if n <= 1 or len(work) < 2 or total < PARALLEL_MIN_BYTES or not base_reads:
        shared = Lookups()
        return sum(execute_file(reader, f, w, shared, prepared.get(f)) for f, w in by_file.items())
    for f in sorted(by_file):
        reader.safetensors_file(f)  # open (and cache) here: the cache is not shared-write safe
    return _read_items_on_pool(reader, work, n)


def _contiguous_runs(things: list, sizes: list[int], n: int) -> list[list]:
    """``things`` cut, in order, into at most ``n`` runs of about equal total ``sizes``."""
    share = sum(sizes) / n
    runs: list[list] = [[]]
    acc = 0
    for x, size in zip(things, sizes):
        if acc >= share and len(runs) < n:
            runs.append([])
            acc = 0
        runs[-1].append(x)
        acc += size
    return runs


def _on_pool(fn: Any, runs: list[list]) -> int:
    """``sum(fn(run) for run in runs)``, one reader thread per run (without grad mode: it is per thread, and
    targets may be parameters)."""
    def run(r: list) -> int:
        with torch.no_grad():
            return fn(r)

    return sum(pool_map(run, runs, len(runs)))


def _read_items_on_pool(reader: CheckpointReader, work: list[tuple[Any, torch.Tensor]], n: int) -> int:
    """``work`` read item by item on ``n`` threads, cut into contiguous runs of about equal bytes (the files are
    open already)."""
    tensors = reader.metadata.tensors
    sizes = [box_volume(it.src_box) * dtype_itemsize(tensors[it.src_key].dtype) for it, _ in work]
    return _on_pool(lambda pairs: sum(execute_items(reader, t, [it]) for it, t in pairs),
                    _contiguous_runs(work, sizes, n))


def _execute_streamed(reader: CheckpointReader, work: FileWork, n: int, prepared: dict[str, FileReads]) -> int:
    """:func:`execute_work` of a :class:`FileWork`: each file's pairs are made, read and dropped in turn. With ``n``
    threads and at least :data:`PARALLEL_MIN_BYTES`, the files are cut into ``n`` contiguous runs of about equal
    bytes (by their prepared sizes); with fewer files than threads, each file's items are spread over them."""
    files = work.files
    sizes = [prepared[f].nbytes if f in prepared else 1 for f in files]
    if n <= 1 or sum(sizes) < PARALLEL_MIN_BYTES or type(reader).read_box is not CheckpointReader.read_box:
        shared = Lookups()
        return sum(execute_file(reader, f, work.pairs_of(f, ordered=False), shared, prepared.get(f)) for f in files)
    for f in files:
        reader.safetensors_file(f)  # open (and cache) here: the cache is not shared-write safe
    if len(files) < n:  # fewer files than threads: each file's items are spread over the pool, as listed loads do
        return sum(_execute_file_threaded(reader, f, work.pairs_of(f), n, prepared.get(f)) for f in files)

    def run(fs: list[str]) -> int:
        shared = Lookups()  # per thread: its caches are not shared-write safe
        return sum(execute_file(reader, f, work.pairs_of(f, ordered=False), shared, prepared.get(f)) for f in fs)

    return _on_pool(run, _contiguous_runs(files, sizes, n))


def _execute_file_threaded(reader: CheckpointReader, file: str, work: list[tuple[Any, torch.Tensor]], n: int,
                           prepared: FileReads | None) -> int:
    """One file's pairs (in read order) on ``n`` threads, cut into contiguous runs of about equal bytes; a file
    whose reads are coalesced is read as one span by :func:`execute_file`."""
    if prepared is None or prepared.coalesce is not False or len(work) < 2:
        return execute_file(reader, file, work, Lookups(), prepared)
    return _read_items_on_pool(reader, work, n)
