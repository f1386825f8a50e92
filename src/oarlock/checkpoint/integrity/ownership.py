"""Which blocks a load's reads touch, and which rank hashes each: :func:`block_bytes` (the bytes a read of a box
takes from each block of a safetensors file, exact for strided boxes), :func:`touched_blocks` (a rank's read items
summed per block) and :func:`block_owners` (the collective that gives each touched block to the rank reading the
largest share of it, in one ``all_reduce``)."""

from __future__ import annotations

import functools
import math
from typing import Any, Iterable, Sequence

from oarlock.checkpoint.integrity.checksums import FileChecksums
from oarlock.checkpoint.model.boxes import box_volume
from oarlock.checkpoint.storage import storage_for
from oarlock.checkpoint.storage.s3 import kept_room
from oarlock.utils import dtype_itemsize


def _read_layout(reader: Any, file: str, name: str, flat_start: int, shape: Sequence[int],
                 box: Sequence[tuple[int, int]]) -> tuple[int, int, list[int], list[tuple[int, int]]] | None:
    """Where a read of ``box`` lies in safetensors data file ``file``: ``(base, itemsize, strides, box)``, with
    ``base`` the file offset of the read array's element 0 and C-order ``strides`` in elements (a 0-d array is
    seen as shape ``(1,)``); None when the box is empty, the tensor is not in the file, or ``file`` is not a
    safetensors file."""
    if not file.endswith(".safetensors") or any(b <= a for a, b in box):
        return None
    f = reader.safetensors_file(file)
    e = f.entries.get(name)
    if e is None:
        return None
    dtype, _, begin, _ = e
    isz = dtype_itemsize(dtype)
    if not len(shape):
        shape, box = (1,), [(0, 1)]
    return f.data_start + begin + int(flat_start) * isz, isz, c_strides(tuple(shape)), box


@functools.lru_cache(maxsize=4096)
def c_strides(shape: tuple[int, ...]) -> list[int]:
    """C-order strides in elements of an array of ``shape`` (cached: a checkpoint has few distinct shapes)."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * int(shape[d + 1])
    return strides


def _elements_before(x: int, strides: list[int], box: list[tuple[int, int]], inner: list[int]) -> int:
    """How many elements of ``box`` (of a C-order array with ``strides``) lie at flat offsets below ``x``;
    ``inner[d]``: elements of the box in dimensions after ``d``. O(ndim): only the index of dimension ``d`` that
    holds offset ``x`` is partly below it."""
    n = 0
    for d, ((a, b), s) in enumerate(zip(box, strides)):
        k, x = divmod(x, s)  # x falls in index k of dimension d, x elements into it
        n += max(0, min(k, b) - a) * inner[d]
        if not a <= k < b:
            break
    return n


def block_bytes(reader: Any, fc: FileChecksums, name: str, flat_start: int, shape: Sequence[int],
                box: Sequence[tuple[int, int]]) -> dict[int, int]:
    """Bytes a read of ``box`` of stored tensor ``name`` (an array of ``shape`` starting ``flat_start`` elements
    into it) takes from each block of data file ``fc.file``: block index -> bytes, exact for strided boxes (a
    column slice of a row-major tensor takes a part of every block its span crosses). Empty for empty boxes and
    files that are not safetensors."""
    lay = _read_layout(reader, fc.file, name, flat_start, shape, box)
    if lay is None:
        return {}
    base, isz, strides, box = lay
    first = sum(a * s for (a, _), s in zip(box, strides))
    last = sum((b - 1) * s for (_, b), s in zip(box, strides))
    blocks = fc.block_range(base + first * isz, base + (last + 1) * isz)
    if len(blocks) == 1:  # the common case of many small shards: no per-dimension counting
        return {blocks[0]: math.prod(b - a for a, b in box) * isz}
    inner = [1] * len(box)
    for d in range(len(box) - 2, -1, -1):
        inner[d] = inner[d + 1] * (box[d + 1][1] - box[d + 1][0])

    def before(pos: int) -> int:  # elements of the read starting below file offset pos
        return _elements_before(-(-(pos - base) // isz), strides, box, inner)

    out = {}
    for b in blocks:
        n = (before(min(fc.size, (b + 1) * fc.block_size)) - before(b * fc.block_size)) * isz
        if n > 0:
            out[b] = n
    return out


def touched_blocks(reader: Any, items: Iterable[Any], checksums: dict[str, FileChecksums],
                   file_bytes: dict[str, int] | None = None, files: set[str] | None = None
                   ) -> dict[str, dict[int, int]]:
    """The blocks this rank's read items touch in the data files it can see, with the bytes it reads from each:
    file -> block index -> bytes (summed over items, at most the block's length). Items are
    :class:`~oarlock.checkpoint.planning.load.ReadItem` s (``file``, ``name``, ``src_flat_start``, ``src_shape``,
    ``src_box``); files without recorded checksums and files this rank cannot see are left out. ``file_bytes``:
    the bytes the items need per file where already summed (the load's prepared reads), used for one-block
    files instead of summing the items again. ``files``: the files of ``items`` when known (``items`` is then
    iterated once, as it comes: a load's items made file by file are never all held at once)."""
    if files is None:
        items = items if isinstance(items, (list, tuple)) else list(items)
        files = {it.file for it in items}
    visible = reader.visible_files(files)  # only the files this rank reads
    out: dict[str, dict[int, int]] = {}
    state: dict[str, tuple | None] = {}  # file -> (checksums, per-block bytes, one block?); None: not summed here
    sizes: dict[str, int] = {}  # item size per key
    tensors = reader.metadata.tensors

    def one_block(f: str, fc: FileChecksums) -> bool:
        return fc.size <= fc.block_size and f.endswith(".safetensors")

    for f, n in (file_bytes or {}).items():
        fc = checksums.get(f)
        if fc is not None and f in visible and one_block(f, fc):
            out[f] = {0: min(n, fc.size)}
            state[f] = None  # summed already: its items are skipped below
    for it in items:
        entry = state.get(it.file, False)
        if entry is False:
            fc = checksums.get(it.file)
            entry = state[it.file] = None if fc is None or it.file not in visible else \
                (fc, out.setdefault(it.file, {}), one_block(it.file, fc))
        if entry is None:
            continue
        fc, per, single = entry
        if single:
            # a one-block file (many small shards): every byte read is in block 0, no layout needed
            isz = sizes.get(it.src_key)
            if isz is None:
                isz = sizes[it.src_key] = dtype_itemsize(tensors[it.src_key].dtype)
            n = box_volume(it.src_box) * isz
            if n:
                per[0] = min(per.get(0, 0) + n, fc.size)
            continue
        for b, n in block_bytes(reader, fc, it.name, it.src_flat_start, it.src_shape, it.src_box).items():
            per[b] = min(per.get(b, 0) + n, fc.block_length(b))
    return {f: per for f, per in out.items() if per}


#: A block goes to the rank reading the largest share of it, counted in 1/LEVELS of the block: ranks whose shares
#: differ by less (a column slice each) share such blocks round robin instead of one rank taking them all.
LEVELS = 16


#: Blocks given in turn to ranks with equal shares of them go in runs of this many consecutive blocks (32 MiB).
OWNER_RUN = 8


def block_owners(touched: dict[str, dict[int, int]], checksums: dict[str, FileChecksums], dist: Any
                 ) -> dict[str, list[int]]:
    """Collective over ``dist`` (a :class:`~oarlock.checkpoint.runtime.dist.DistWrapper`; every rank calls it, with
    ``touched`` empty where it reads nothing): the blocks this rank hashes for the group, file -> block indices.

    The blocks of all files in ``checksums`` are numbered globally (files sorted, each file's blocks in order),
    so the exchange is one ``all_reduce`` MAX of an int64 vector of one entry per block of the checkpoint,
    whatever the world size. A rank puts into the entry of each block it touches ``(level + 1) << shift | low``:
    ``level`` its share of the block in sixteenths (dithered per block, so near-equal shares seldom fall on two
    sides of a step), ``low = (rank + q) % world + 1`` with ``q = s + b // run`` for block ``b`` of a file whose
    blocks start at global index ``s``, distinct per rank, so the maximum names one toucher, and equal shares give
    runs of ``run`` consecutive blocks to each toucher in turn: ``run`` is the file's block count over the world
    size, between 1 and :data:`OWNER_RUN` (long runs: each owner reads long stretches of a file, which the disk
    streams, where single blocks in turn made two owners of one file each read every other block; short ones for
    small files, which would otherwise go whole to one rank). Without a process group this rank owns every block
    it touches.
    """
    if not dist.active:
        return {f: sorted(per) for f, per in touched.items()}
    import torch

    files = sorted(checksums)
    world, rank = dist.size, dist.rank
    start, run, total = {}, {}, 0
    for f in files:
        start[f] = total
        run[f] = max(1, min(OWNER_RUN, checksums[f].n_blocks // world))
        total += checksums[f].n_blocks
    shift = max(8, world.bit_length())
    idx, val = [], []
    for f, per in touched.items():
        fc = checksums[f]
        for b, n in per.items():
            g = start[f] + b
            length = fc.block_length(b)
            # a fixed sequence spread over [0, 1) in 1/65536 (golden-ratio steps), starting at one half: even
            # splits (a half, a quarter, ...) then sit mid-step, never on the step between two levels
            dither = (g * 40503 + 0x8000) & 0xFFFF
            level = (min(n, length) * LEVELS * 65536 // length + dither) >> 16
            idx.append(g)
            val.append(((level + 1) << shift) | ((rank + start[f] + b // run[f]) % world + 1))
    prio = torch.zeros(total, dtype=torch.int64)
    if idx:
        prio[torch.tensor(idx, dtype=torch.int64)] = torch.tensor(val, dtype=torch.int64)
    prio = dist.all_max_tensor(prio)
    g = torch.arange(total, dtype=torch.int64)
    counts = torch.tensor([checksums[f].n_blocks for f in files], dtype=torch.int64)
    s0 = torch.repeat_interleave(torch.tensor([start[f] for f in files], dtype=torch.int64), counts)
    q = s0 + torch.div(g - s0, torch.repeat_interleave(torch.tensor([run[f] for f in files], dtype=torch.int64),
                                                       counts), rounding_mode="floor")
    owner = torch.remainder((prio & ((1 << shift) - 1)) - 1 - q, world)
    mine = ((prio > 0) & (owner == rank)).nonzero().flatten().tolist()
    out: dict[str, list[int]] = {}
    fi = 0
    for gi in mine:  # ascending: walk the files along
        while gi >= start[files[fi]] + checksums[files[fi]].n_blocks:
            fi += 1
        out.setdefault(files[fi], []).append(gi - start[files[fi]])
    return out


def whole_blocks_read(reader: Any, touched: dict[str, dict[int, int]], owned: dict[str, list[int]],
                       checksums: dict[str, FileChecksums]) -> dict[str, list[int]]:
    """Blocks of objects in a store that this rank reads (almost) whole but another rank owns: hashed here too,
    so that the one fetch that verifies them also serves this rank's reads (a second rank reading a block would
    otherwise fetch it once more after the verdict, in a phase of its own). Bounded by the room left in the
    budget of kept blocks once the owned ones are in (:func:`~oarlock.checkpoint.storage.s3.kept_room`); none
    on a filesystem, where a second read of a block costs little and each block is hashed once per group."""
    room = kept_room()
    if not room:
        return {}
    objects = [f for f in sorted(touched) if not storage_for(reader.path_of(f)).mappable]
    room -= sum(checksums[f].block_length(b) for f in objects for b in owned.get(f, ()))
    out: dict[str, list[int]] = {}
    for f in objects:
        fc, mine = checksums[f], set(owned.get(f, ()))
        for b, n in sorted(touched[f].items()):
            length = fc.block_length(b)
            if b in mine or n * 8 < length * 7 or length > room:
                continue
            out.setdefault(f, []).append(b)
            room -= length
    return out
