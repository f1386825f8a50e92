"""The load executor: run planned read items into destination tensors.

A :class:`~oarlock.checkpoint.plan.ReadItem` says which box of which stored array lands where in a destination
shard (its box, or a flat range of a flattened shard), with an optional permutation and cast.
:func:`destination_view` is the one definition of "where": the view of the target tensor an item writes. Reads
go straight into that view when nothing needs permuting or casting (``os.preadv`` into the target's memory).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from oarlock.checkpoint.mapping import box_extent, box_slices, cast_tensor
from oarlock.checkpoint.objectstore import is_object_path, s3_concurrency
from oarlock.checkpoint.reader import CheckpointReader
from oarlock.checkpoint.sharded import box_volume
from oarlock.utils import dtype_itemsize, numel


@dataclass
class LoadReport:
    """What a load did not match (filled when ``strict=False``; with ``strict=True`` these raise).

    Attributes:
        missing_keys: requested keys (on any rank) the checkpoint or mapping program cannot provide; their
            targets are left untouched.
        unexpected_keys: stored keys that no rank requested (and no mapping read).
        bytes_read: bytes this rank read from the checkpoint's data files.
        comm_method: how data reached this rank: ``"direct"`` (own byte-range reads), ``"warm"`` (own file
            only, no communication), ``"grouped_send_recv"`` or ``"broadcast"`` (see :mod:`oarlock.checkpoint.comm`).
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


def execute_file(reader: CheckpointReader, file: str, work: list[tuple[Any, torch.Tensor]],
                 cache: dict | None = None) -> int:
    """Run the items of one data file: when they are many small reads of a dense region (a reshard across many
    small shards), read the span they cover once (one ``preadv``) and copy every box out of that buffer; else
    item by item (:func:`execute_items`). Returns the bytes the items need."""
    tensors = reader.metadata.tensors
    if len(work) < 4 or type(reader).read_box is not CheckpointReader.read_box or not file.endswith(".safetensors"):
        return sum(execute_items(reader, t, [it]) for it, t in work)
    f = reader.safetensors_file(file)
    cache = {} if cache is None else cache  # target -> numpy view, shared by the files of one load
    fast, slow = [], []
    # per key and per stored array: thousands of items share them (many shards of one file, many tensors)
    dtypes: dict[str, tuple[str, int]] = {}
    strides_of: dict[tuple, list[int]] = {}
    begins: dict[tuple, int] = {}
    lo, hi, need, nbytes = None, 0, 0, 0
    data_start = f.data_start
    for it, target in work:
        dt = dtypes.get(it.src_key)
        if dt is None:
            dtype = tensors[it.src_key].dtype
            dt = dtypes[it.src_key] = (dtype, dtype_itemsize(dtype))
        dtype, isz = dt
        src_box = it.src_box
        nbytes += box_volume(src_box) * isz
        arr = _np_target(target, cache) if it.permute is None and it.dtype is None else None
        dst = _np_destination(it, arr) if arr is not None and arr.itemsize == isz else None
        if dst is None:
            slow.append((it, target))
            continue
        ck = (it.name, it.src_flat_start, it.src_shape)
        begin = begins.get(ck)
        if begin is None:
            begin = begins[ck] = data_start + f.check_array(it.name, it.src_flat_start, it.src_shape, dtype) \
                + int(it.src_flat_start) * isz
        sk = (it.src_shape, isz)
        strides = strides_of.get(sk)
        if strides is None:
            strides = [isz] * len(it.src_shape)
            for d in range(len(it.src_shape) - 2, -1, -1):
                strides[d] = strides[d + 1] * int(it.src_shape[d + 1])
            strides_of[sk] = strides
        start = stop = begin
        for (x, y), st in zip(src_box, strides):
            start += x * st
            stop += (y - 1) * st
        stop += isz
        fast.append((it, dst, start, strides))
        if lo is None or start < lo:
            lo = start
        if stop > hi:
            hi = stop
        need += stop - start
    if fast:
        # worth it only for many small reads: large ones go straight into their targets with no extra copy
        if hi - lo > COALESCE_MAX_BYTES or hi - lo > COALESCE_MAX_WASTE * need or need > len(fast) * (256 << 10):
            return sum(execute_items(reader, t, [it]) for it, t in work)
        buf = np.empty(hi - lo, dtype=np.uint8)
        f.read_into(memoryview(buf), lo)  # os.preadv locally, ranged GETs of exactly the span in a store
        for it, dst, start, strides in fast:
            # the box as a strided view of the buffer (numpy accepts unaligned items), copied into the target
            src = np.ndarray(tuple(y - x for x, y in it.src_box), dtype=dst.dtype, buffer=buf, offset=start - lo,
                             strides=strides)
            np.copyto(dst, src.reshape(dst.shape) if src.shape != dst.shape else src)
    for it, target in slow:
        execute_items(reader, target, [it])
    return nbytes


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


def execute_work(reader: CheckpointReader, work: list[tuple[Any, torch.Tensor]], threads: int | None = None) -> int:
    """Run ``(read item, target)`` pairs; returns the bytes read.

    Large loads (at least :data:`PARALLEL_MIN_BYTES`) run on a small pool of reader threads (``threads``, default
    :func:`io_threads`), as DCP's and Paddle's readers do: ``os.preadv`` and tensor copies release the GIL, so
    reads of different byte ranges overlap. The work is cut into contiguous runs of the given order (one file
    read front to back per thread where possible); items write disjoint parts of their targets, so the result is
    the same as a sequential run. Every data file is opened before the threads start. Readers of formats that
    override ``read_box`` (their own data files) always read in the calling thread.
    """
    n = threads or io_threads()
    if threads is None and is_object_path(reader.root):  # an object store: latency-bound GETs in flight together
        n = max(n, s3_concurrency())
    tensors = reader.metadata.tensors
    sizes: dict[str, int] = {}  # item size per key: a load has thousands of items per key
    total = 0
    for it, _ in work:
        isz = sizes.get(it.src_key)
        if isz is None:
            isz = sizes[it.src_key] = dtype_itemsize(tensors[it.src_key].dtype)
        total += box_volume(it.src_box) * isz
    # only the base class's safetensors byte-range reads are known to be thread safe (formats may cache state)
    base_reads = type(reader).read_box is CheckpointReader.read_box
    if n <= 1 or len(work) < 2 or total < PARALLEL_MIN_BYTES or not base_reads:
        by_file: dict[str, list] = {}
        for it, target in work:
            by_file.setdefault(it.file, []).append((it, target))
        views: dict = {}
        return sum(execute_file(reader, f, w, views) for f, w in by_file.items())
    for f in sorted({it.file for it, _ in work}):
        reader.safetensors_file(f)  # open (and cache) here: the cache is not shared-write safe
    chunks: list[list[tuple[Any, torch.Tensor]]] = [[]]
    size, share = 0, total / n
    for it, target in work:
        if size >= share and len(chunks) < n:
            chunks.append([])
            size = 0
        chunks[-1].append((it, target))
        size += it.numel * dtype_itemsize(reader.metadata.tensors[it.src_key].dtype)

    def run(chunk: list[tuple[Any, torch.Tensor]]) -> int:
        with torch.no_grad():  # grad mode is per thread: targets may be parameters
            return sum(execute_items(reader, target, [it]) for it, target in chunk)

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(chunks), thread_name_prefix="oarlock-read") as pool:
        return sum(pool.map(run, chunks))
