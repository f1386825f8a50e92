"""Allocator models that replay a trace (``docs/memory-debug.md`` section 4). One interface for all:

``malloc(size, stream=0, category=None) -> block`` (``block.addr``, ``block.size``; raises
:class:`~oarlock.memory.errors.SimulatedOOM`), ``free(block)``, ``reserved`` (physical bytes held),
``calls`` (a Counter of driver calls), ``counters`` (policy events), ``blocks()`` (``(addr, size, state,
pool)`` tuples) and ``free_block_sizes()``.

* :class:`Oracle`: reserved == allocated; the floor.
* :class:`TorchCaching`: PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``): 512 B
  rounding, small (<= 1 MiB, 2 MiB segments) and large pools (20 MiB segments below 10 MiB, else rounded to
  2 MiB) per stream, best fit by (size, address), the two split rules, coalescing within a segment only,
  ``max_split_size``, and on a failed ``cudaMalloc`` the release of every unsplit cached segment then retry.
* :class:`TorchExpandable`: ``expandable_segments:True``: one growing VA segment per (stream, pool),
  2 MiB / 20 MiB pages, lowest-address placement, split when >= 512 B remain, unmap of every page under a
  free block on OOM.
* :class:`PaddleVmm`: Paddle 3.3's ``VirtualMemoryAutoGrowthBestFitAllocator``: one VA-contiguous heap,
  256 B alignment, best fit, ``NeedSplit``, tail growth by ``request - free tail`` rounded to 2 MiB, and
  copy compaction (``TotalMemoryCompactor``) on OOM (``compact="oom"``, FLAGS_native_compact) or on every
  miss that holes could serve (``compact="eager"``: the reference lower bound; pointers change).
* :class:`GMLakeStitch`: GMLake (ASPLOS'24) virtual-memory stitching on top of the caching rules: large
  requests rounded to 2 MiB chunks; when no single free block fits, free blocks are stitched into one new
  VA range (only for requests >= ``frag_limit``).
* ``remap``: :class:`oarlock.memory.vmm.RemapAllocator`, oarlock's pointer-stable policy (2 MiB small
  pages, 32 MiB large pages); ``remap_fine``: the same with ``mixed=True`` (32 MiB handles plus 2 MiB
  granules at hole edges: less fragmentation, more driver calls); ``remap_binary``: ``mixed="binary"`` with
  64 MiB large pages (each hole's remainder mapped with power-of-two handles, at most 5 per run).
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Any

from oarlock.memory.driver import CountingDriver
from oarlock.memory.errors import MemoryToolError, SimulatedOOM
from oarlock.memory.vmm import (FREE, GAP, MIN_BLOCK, HeapViews, PagedHeap, RemapAllocator, page_runs,
                                round_up)

MiB = 1 << 20
K_SMALL_SIZE = 1 * MiB  # kSmallSize
K_SMALL_BUFFER = 2 * MiB  # kSmallBuffer
K_LARGE_BUFFER = 20 * MiB  # kLargeBuffer
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
K_ROUND_LARGE = 2 * MiB  # kRoundLarge
DRIVER_CALLS = ("cudaMalloc", "cudaFree", "reserve", "free_va", "create", "release", "map", "set_access", "unmap")


def _key(t: tuple) -> tuple:
    return t[0], t[1]


class Oracle:
    """Reserved bytes always equal allocated bytes (after 512 B rounding): the theoretical floor."""

    name = "oracle"

    def __init__(self, capacity: int | None = None):
        self.capacity, self.reserved, self.calls, self.counters = capacity, 0, Counter(), Counter()
        self._next = 0

    def malloc(self, size: int, stream: int = 0, category: str | None = None) -> Any:
        r = max(MIN_BLOCK, round_up(size, MIN_BLOCK))
        if self.capacity is not None and self.reserved + r > self.capacity:
            raise SimulatedOOM(f"oracle: {r} more bytes exceed capacity {self.capacity}", r, self.capacity,
                               self.reserved)
        self.reserved += r
        b = _CBlock(self._next, r, None, None)
        self._next += r
        return b

    def free(self, block: Any) -> None:
        self.reserved -= block.size

    def blocks(self) -> list[tuple]:
        return []

    def free_block_sizes(self) -> list[int]:
        return []


class _CBlock:
    __slots__ = ("addr", "size", "free", "prev", "next", "seg", "pool", "stream", "parts")

    def __init__(self, addr: int, size: int, seg: Any, pool: Any, stream: int = 0):
        self.addr, self.size, self.seg, self.pool, self.stream = addr, size, seg, pool, stream
        self.free, self.prev, self.next, self.parts = False, None, None, None


class TorchCaching:
    """PyTorch's native CUDA caching allocator (rules in the module docstring).

    Args:
        capacity: bytes ``cudaMalloc`` may hand out in total (None: unlimited).
        max_split_size: ``max_split_size_mb`` in bytes (None: unlimited, PyTorch's default).
        max_non_split_rounding_size: bytes an oversize block may exceed a large request by (20 MiB default).
    Counters: ``cudaMalloc``, ``cudaFree``, ``synchronize`` (each release of cached blocks),
    ``num_alloc_retries``, ``num_ooms``.
    """

    name = "caching"

    def __init__(self, capacity: int | None = None, max_split_size: int | None = None,
                 max_non_split_rounding_size: int = 20 * MiB):
        self.capacity = capacity
        self.max_split = max_split_size if max_split_size is not None else 1 << 62
        self.max_non_split = max_non_split_rounding_size
        self.pools: dict[tuple[int, bool], list] = {}
        self.segments: dict[int, _CBlock] = {}  # segment address -> head block
        self.seg_sizes: dict[int, int] = {}
        self.reserved = 0
        self.calls: Counter = Counter()
        self.counters: Counter = Counter()
        self._next_addr = 1 << 40

    # ------------------------------------------------------------------ sizes (CUDACachingAllocator.cpp)
    @staticmethod
    def round_size(size: int) -> int:
        return MIN_BLOCK if size < MIN_BLOCK else round_up(size, MIN_BLOCK)

    @staticmethod
    def allocation_size(size: int) -> int:
        if size <= K_SMALL_SIZE:
            return K_SMALL_BUFFER
        if size < K_MIN_LARGE_ALLOC:
            return K_LARGE_BUFFER
        return round_up(size, K_ROUND_LARGE)

    def should_split(self, block: _CBlock, size: int, small: bool) -> bool:
        remaining = block.size - size
        if small:
            return remaining >= MIN_BLOCK
        return size < self.max_split and remaining > K_SMALL_SIZE

    # ------------------------------------------------------------------ malloc / free
    def malloc(self, size: int, stream: int = 0, category: str | None = None) -> _CBlock:
        rsize = self.round_size(size)
        small = rsize <= K_SMALL_SIZE
        pool_key = (stream, small)
        pool = self.pools.setdefault(pool_key, [])
        b = self._get_free_block(pool, rsize)
        if b is None:
            b = self._fallback(rsize, stream, small, pool_key)
        if self.should_split(b, rsize, small):
            rest = _CBlock(b.addr + rsize, b.size - rsize, b.seg, pool_key, stream)
            rest.free, rest.prev, rest.next = True, b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = rsize
            self._pool_add(rest)
        b.free = False
        return b

    def _fallback(self, rsize: int, stream: int, small: bool, pool_key: tuple) -> _CBlock:
        """No cached block fits: cudaMalloc a segment; on failure release cached segments and retry."""
        alloc = self.allocation_size(rsize)
        b = self._alloc_block(alloc, stream, pool_key)
        if b is None:
            self.counters["num_alloc_retries"] += 1
            self.release_cached_blocks()
            b = self._alloc_block(alloc, stream, pool_key)
        if b is None:
            self.counters["num_ooms"] += 1
            raise SimulatedOOM(f"{self.name}: cannot allocate {rsize} bytes (segment of {alloc}): "
                               f"{self.reserved} of {self.capacity} bytes reserved", rsize, self.capacity,
                               self.reserved)
        return b

    def free(self, block: _CBlock) -> None:
        if block.free:
            raise MemoryToolError(f"{self.name}: double free of block at {block.addr:#x}")
        block.free = True
        p, n = block.prev, block.next
        if p is not None and p.free:  # merge into the previous block (keeps segment heads stable)
            self._pool_remove(p)
            p.size += block.size
            p.next = n
            if n is not None:
                n.prev = p
            block = p
        n = block.next
        if n is not None and n.free:
            self._pool_remove(n)
            block.size += n.size
            block.next = n.next
            if n.next is not None:
                n.next.prev = block
        self._pool_add(block)

    def release_cached_blocks(self) -> int:
        """``cudaFree`` every cached segment that is wholly free (one device sync). Returns bytes freed."""
        self.counters["synchronize"] += 1
        freed = 0
        for pool in self.pools.values():
            for t in [t for t in pool if t[2].prev is None and t[2].next is None]:
                b = t[2]
                pool.remove(t)
                self._free_segment(b)
                freed += b.size
        return freed

    # ------------------------------------------------------------------ helpers
    def _get_free_block(self, pool: list, rsize: int) -> _CBlock | None:
        k = bisect.bisect_left(pool, (rsize, -1), key=_key)
        if k == len(pool):
            return None
        b = pool[k][2]
        if rsize < self.max_split and b.size >= self.max_split:
            return None  # do not return an oversize block for a small request
        if rsize >= self.max_split and b.size >= rsize + self.max_non_split:
            return None  # nor one much larger than a large request
        del pool[k]
        return b

    def _alloc_block(self, alloc: int, stream: int, pool_key: tuple) -> _CBlock | None:
        if self.capacity is not None and self.reserved + alloc > self.capacity:
            return None
        self.calls["cudaMalloc"] += 1
        addr = self._next_addr
        self._next_addr += round_up(alloc, K_SMALL_BUFFER)
        self.reserved += alloc
        b = _CBlock(addr, alloc, addr, pool_key, stream)
        self.segments[addr] = b
        self.seg_sizes[addr] = alloc
        return b

    def _free_segment(self, b: _CBlock) -> None:
        self.calls["cudaFree"] += 1
        self.reserved -= self.seg_sizes.pop(b.seg)
        del self.segments[b.seg]

    def _pool_add(self, b: _CBlock) -> None:
        bisect.insort(self.pools[b.pool], (b.size, b.addr, b), key=_key)

    def _pool_remove(self, b: _CBlock) -> None:
        pool = self.pools[b.pool]
        k = bisect.bisect_left(pool, (b.size, b.addr), key=_key)
        assert pool[k][2] is b
        del pool[k]

    def blocks(self) -> list[tuple[int, int, str, str]]:
        out = []
        for head in self.segments.values():
            b = head
            while b is not None:
                out.append((b.addr, b.size, "free" if b.free else "active",
                            f"{'small' if b.pool[1] else 'large'}/s{b.pool[0]}"))
                b = b.next
        return out

    def free_block_sizes(self) -> list[int]:
        return [t[0] for pool in self.pools.values() for t in pool]

    def check(self) -> None:
        total = 0
        for seg, head in self.segments.items():
            b, cur = head, seg
            assert head.prev is None
            while b is not None:
                assert b.addr == cur, (b.addr, cur)
                if b.next is not None:
                    assert not (b.free and b.next.free), "unmerged free neighbours"
                cur += b.size
                b = b.next
            assert cur == seg + self.seg_sizes[seg]
            total += self.seg_sizes[seg]
        assert total == self.reserved


class TorchExpandable(HeapViews):
    """PyTorch's ``expandable_segments:True`` (rules in the module docstring).

    Args:
        capacity: physical bytes (None: unlimited).
        small_page / large_page: page sizes of the small and large pools (2 MiB / 20 MiB).
    """

    name = "expandable"

    def __init__(self, capacity: int | None = None, small_page: int = 2 * MiB, large_page: int = 20 * MiB,
                 driver: Any = None):
        self.capacity = capacity
        self.driver = driver or CountingDriver(granularity=2 * MiB)
        self.pages = {True: small_page, False: large_page}
        self.heaps: dict[tuple[int, bool], PagedHeap] = {}
        self.counters: Counter = Counter()

    @property
    def calls(self) -> Counter:
        return self.driver.calls

    @property
    def reserved(self) -> int:
        return sum(h.mapped_bytes() for h in self.heaps.values())

    def _heap(self, stream: int, small: bool) -> PagedHeap:
        h = self.heaps.get((stream, small))
        if h is None:
            page = self.pages[small]
            # VA of 9/8 of device memory per segment (issue pytorch#186213); 1 TiB when unlimited
            size = round_up(self.capacity * 9 // 8 if self.capacity else 1 << 40, page)
            h = self.heaps[(stream, small)] = PagedHeap(self.driver.reserve(size), size, page,
                                                        f"{'small' if small else 'large'}/s{stream}")
        return h

    def malloc(self, size: int, stream: int = 0, category: str | None = None) -> Any:
        rsize = max(MIN_BLOCK, round_up(size, MIN_BLOCK))
        heap = self._heap(stream, rsize <= K_SMALL_SIZE)
        b = heap.best_fit(rsize)
        if b is not None:
            return heap.carve(b.addr, rsize)
        for attempt in (0, 1):
            addr = self._candidate(heap, rsize)
            pages = heap.unmapped_pages(addr, addr + rsize)
            if self.capacity is None or self.reserved + len(pages) * heap.page <= self.capacity:
                break
            if attempt == 0:  # the OOM path: unmap every free page, then look again
                self.counters["num_alloc_retries"] += 1
                self.release_cached_blocks()
        else:
            self.counters["num_ooms"] += 1
            raise SimulatedOOM(f"{self.name}: cannot map {len(pages)} pages of {heap.page} for {rsize} bytes: "
                               f"{self.reserved} of {self.capacity} bytes mapped", rsize, self.capacity,
                               self.reserved)
        handles = [self.driver.create(heap.page) for _ in pages]
        for p, h in zip(pages, handles):
            self.driver.map(heap.base + p * heap.page, heap.page, h)
        for first, n in page_runs(pages):  # map_block: one set_access per unmapped block
            self.driver.set_access(heap.base + first * heap.page, n * heap.page)
        heap.pages_mapped(pages, handles)
        return heap.carve(addr, rsize)

    def _candidate(self, heap: PagedHeap, rsize: int) -> int:
        """Lowest unmapped block (with the free block just before it) whose run can hold the request."""
        for start, end, blocks in heap.runs():
            for k, g in enumerate(blocks):
                if g.state != GAP:
                    continue
                c = blocks[k - 1] if k and blocks[k - 1].state == FREE else g
                if end - c.addr >= rsize:
                    return c.addr
        raise SimulatedOOM(f"{self.name}: segment VA exhausted for {rsize} bytes", rsize, self.capacity,
                           self.reserved)

    def free(self, block: Any) -> None:
        block.heap.release(block)

    def release_cached_blocks(self) -> int:
        """Unmap and release every page lying wholly under a free block (PyTorch's OOM path)."""
        self.counters["synchronize"] += 1
        freed = 0
        for heap in self.heaps.values():
            pages = [p for p, _ in heap.reclaimable()]
            for p in pages:
                self.driver.unmap(heap.base + p * heap.page, heap.page)
            for h in heap.pages_unmapped(pages):
                self.driver.release(h)
                freed += heap.page
        return freed

    def check(self) -> None:
        for h in self.heaps.values():
            h.check()


class _PBlock:
    __slots__ = ("addr", "size", "free")

    def __init__(self, addr: int, size: int, free: bool):
        self.addr, self.size, self.free = addr, size, free


class PaddleVmm:
    """Paddle 3.3's VMM auto-growth best-fit allocator with copy compaction (rules in the module docstring).

    Args:
        capacity: physical bytes (None: unlimited).
        compact: ``"none"``, ``"oom"`` (compact when growth would exceed the capacity; Paddle's
            FLAGS_native_compact) or ``"eager"`` (compact on every miss when free holes exist: the copy-based
            lower bound on reserved memory).
        granularity: growth unit (2 MiB). alignment: request alignment (256 B).
    Counters: ``bytes_moved``, ``compactions``, ``pointer_changes``, ``synchronize`` (2 per compaction).
    """

    name = "paddle_vmm"

    def __init__(self, capacity: int | None = None, compact: str = "oom", granularity: int = 2 * MiB,
                 alignment: int = 256):
        if compact not in ("none", "oom", "eager"):
            raise MemoryToolError(f"PaddleVmm: compact must be none, oom or eager, got {compact!r}")
        self.capacity, self.compact_mode, self.gran, self.align = capacity, compact, granularity, alignment
        self.base = 1 << 40
        self.blocks_: list[_PBlock] = []
        self.free_set: list[tuple[int, int, _PBlock]] = []
        self.reserved = 0
        self.calls: Counter = Counter({"reserve": 1})
        self.counters: Counter = Counter()
        if compact == "eager":
            self.name = "paddle_compact"

    def _index(self, b: _PBlock) -> int:
        k = bisect.bisect_left(self.blocks_, b.addr, key=lambda x: x.addr)
        assert self.blocks_[k] is b
        return k

    def _fadd(self, b: _PBlock) -> None:
        bisect.insort(self.free_set, (b.size, b.addr, b), key=_key)

    def _fdel(self, b: _PBlock) -> None:
        k = bisect.bisect_left(self.free_set, (b.size, b.addr), key=_key)
        assert self.free_set[k][2] is b
        del self.free_set[k]

    def malloc(self, size: int, stream: int = 0, category: str | None = None) -> _PBlock:
        rsize = max(self.align, round_up(size, self.align))
        k = bisect.bisect_left(self.free_set, (rsize, -1), key=_key)
        if k < len(self.free_set):
            b = self.free_set[k][2]
        else:
            b = self._extend_or_compact(rsize)
        self._fdel(b)
        # NeedSplit: hand out the front part, keep the rest free
        if b.size > 2 * rsize or b.size - rsize > self.align:
            rest = _PBlock(b.addr + rsize, b.size - rsize, True)
            self.blocks_.insert(self._index(b) + 1, rest)
            self._fadd(rest)
            b.size = rsize
        b.free = False
        return b

    def _tail_free(self) -> int:
        return self.blocks_[-1].size if self.blocks_ and self.blocks_[-1].free else 0

    def _extend_or_compact(self, rsize: int) -> _PBlock:
        holes = sum(t[0] for t in self.free_set) - self._tail_free()
        if self.compact_mode == "eager" and holes > 0:
            self.compact()
        grow = round_up(rsize - self._tail_free(), self.gran)
        if self.capacity is not None and self.reserved + grow > self.capacity:
            if self.compact_mode != "none" and holes > 0:
                self.compact()
                grow = round_up(max(0, rsize - self._tail_free()), self.gran)
            if self.reserved + grow > self.capacity:
                raise SimulatedOOM(f"{self.name}: growth of {grow} bytes exceeds capacity {self.capacity} "
                                   f"({self.reserved} reserved)", rsize, self.capacity, self.reserved)
        if grow:
            self.calls["create"] += 1
            self.calls["map"] += 1
            self.calls["set_access"] += 1
            top = self.base + self.reserved
            self.reserved += grow
            if self.blocks_ and self.blocks_[-1].free:
                t = self.blocks_[-1]
                self._fdel(t)
                t.size += grow
                self._fadd(t)
            else:
                t = _PBlock(top, grow, True)
                self.blocks_.append(t)
                self._fadd(t)
        return self.blocks_[-1]

    def free(self, b: _PBlock) -> None:
        if b.free:
            raise MemoryToolError(f"{self.name}: double free at {b.addr:#x}")
        k = self._index(b)
        b.free = True
        if k + 1 < len(self.blocks_) and self.blocks_[k + 1].free:
            n = self.blocks_.pop(k + 1)
            self._fdel(n)
            b.size += n.size
        if k > 0 and self.blocks_[k - 1].free:
            p = self.blocks_[k - 1]
            self._fdel(p)
            p.size += b.size
            self.blocks_.pop(k)
            b = p
        self._fadd(b)

    def compact(self) -> int:
        """Move every used block down to the start of the heap (cudaMemcpy D2D, two device syncs), leaving
        one free tail; block addresses change. Returns bytes moved (Paddle's ``TotalMemoryCompactor``)."""
        moved, cur, used = 0, self.base, []
        for b in self.blocks_:
            if not b.free:
                if b.addr != cur:
                    moved += b.size
                    self.counters["pointer_changes"] += 1
                    b.addr = cur
                used.append(b)
                cur += b.size
        self.blocks_ = used
        self.free_set = []
        if cur < self.base + self.reserved:
            t = _PBlock(cur, self.base + self.reserved - cur, True)
            self.blocks_.append(t)
            self._fadd(t)
        self.counters["compactions"] += 1
        self.counters["bytes_moved"] += moved
        self.counters["synchronize"] += 2
        return moved

    def blocks(self) -> list[tuple[int, int, str, str]]:
        return [(b.addr, b.size, "free" if b.free else "active", "vmm") for b in self.blocks_]

    def free_block_sizes(self) -> list[int]:
        return [t[0] for t in self.free_set]

    def check(self) -> None:
        cur = self.base
        for k, b in enumerate(self.blocks_):
            assert b.addr == cur
            assert not (k and b.free and self.blocks_[k - 1].free)
            cur += b.size
        assert cur == self.base + self.reserved


class GMLakeStitch(TorchCaching):
    """GMLake-style virtual-memory stitching (ASPLOS'24, ``intelligent-machine-learning/glake``).

    Small requests follow the caching allocator. Large requests are rounded to 2 MiB chunks and segments
    are created at exactly that size (one ``cuMemCreate`` + ``cuMemMap`` per chunk). When no single free
    block fits and the request is at least ``frag_limit`` bytes, free blocks of the same stream (largest
    first, the last one split at a chunk boundary) are stitched: a new VA range is reserved and their
    chunks are mapped into it, without copying. Freeing a stitched block frees its parts and unmaps the
    stitched view (simplification: no sBlock cache, i.e. ``reuseLimit`` 0). On OOM, cached segments are
    released as in the caching allocator.
    """

    name = "gmlake"

    def __init__(self, capacity: int | None = None, frag_limit: int = 32 * MiB, chunk: int = 2 * MiB):
        super().__init__(capacity)
        self.frag_limit, self.chunk = frag_limit, chunk

    def should_split(self, block: _CBlock, size: int, small: bool) -> bool:
        if small:
            return block.size - size >= MIN_BLOCK
        return block.size - size >= self.chunk

    def malloc(self, size: int, stream: int = 0, category: str | None = None) -> _CBlock:
        if size <= K_SMALL_SIZE:
            return super().malloc(size, stream, category)
        rsize = round_up(size, self.chunk)
        pool_key = (stream, False)
        pool = self.pools.setdefault(pool_key, [])
        if pool and pool[-1][0] < rsize and rsize >= self.frag_limit and \
                sum(t[0] for t in pool) >= rsize:
            return self._stitch(pool, rsize, stream)
        return super().malloc(rsize, stream, category)

    def allocation_size(self, size: int) -> int:
        return K_SMALL_BUFFER if size <= K_SMALL_SIZE else round_up(size, self.chunk)

    def _stitch(self, pool: list, rsize: int, stream: int) -> _CBlock:
        parts, need = [], rsize
        while need > 0:
            size, addr, b = pool.pop()  # largest first
            if b.size > need:  # split: the front joins the stitch, the rest stays cached
                rest = _CBlock(b.addr + need, b.size - need, b.seg, b.pool, stream)
                rest.free, rest.prev, rest.next = True, b, b.next
                if b.next is not None:
                    b.next.prev = rest
                b.next = rest
                b.size = need
                self._pool_add(rest)
            b.free = False
            parts.append(b)
            need -= b.size
        self.calls["reserve"] += 1
        self.calls["map"] += rsize // self.chunk
        self.calls["set_access"] += 1
        self.counters["stitches"] += 1
        s = _CBlock(self._next_addr, rsize, None, None, stream)
        self._next_addr += round_up(rsize, K_SMALL_BUFFER)
        s.parts = parts
        return s

    def free(self, block: _CBlock) -> None:
        if block.parts is None:
            return super().free(block)
        self.calls["unmap"] += block.size // self.chunk
        self.calls["free_va"] += 1
        for p in block.parts:
            super().free(p)
        block.parts = []

    def _alloc_block(self, alloc: int, stream: int, pool_key: tuple) -> _CBlock | None:
        b = super()._alloc_block(alloc, stream, pool_key)
        if b is not None:  # VMM segment: one reserve, a create + map per chunk, one set_access
            self.calls["cudaMalloc"] -= 1
            n = max(1, alloc // self.chunk)
            self.calls.update({"reserve": 1, "create": n, "map": n, "set_access": 1})
        return b

    def _free_segment(self, b: _CBlock) -> None:
        super()._free_segment(b)
        self.calls["cudaFree"] -= 1
        n = max(1, b.size // self.chunk)
        self.calls.update({"unmap": n, "release": n, "free_va": 1})


ALLOCATORS: dict[str, Any] = {
    "oracle": Oracle,
    "caching": TorchCaching,
    "expandable": TorchExpandable,
    "paddle_vmm": lambda capacity=None, **kw: PaddleVmm(capacity, compact=kw.pop("compact", "oom"), **kw),
    "paddle_compact": lambda capacity=None, **kw: PaddleVmm(capacity, compact="eager", **kw),
    "gmlake": GMLakeStitch,
    "remap": lambda capacity=None, **kw: RemapAllocator(capacity=capacity, **kw),
    "remap_fine": lambda capacity=None, **kw: _named(RemapAllocator(capacity=capacity, mixed=True, **kw),
                                                     "remap_fine"),
    "remap_binary": lambda capacity=None, **kw: _named(
        RemapAllocator(capacity=capacity, mixed="binary", large_page=kw.pop("large_page", 64 * MiB), **kw),
        "remap_binary"),
}
DEFAULT_ALLOCATORS = ("caching", "expandable", "paddle_vmm", "paddle_compact", "gmlake", "remap", "remap_fine",
                      "oracle")


def _named(model: Any, name: str) -> Any:
    model.name = name
    return model


def make_allocator(name: str, capacity: int | None = None, **knobs: Any) -> Any:
    """A fresh allocator model by name (one of :data:`ALLOCATORS`) with ``capacity`` bytes.

    Raises:
        MemoryToolError: naming the unknown allocator and listing the known ones.
    """
    if name not in ALLOCATORS:
        raise MemoryToolError(f"unknown allocator {name!r}; known: {', '.join(ALLOCATORS)}")
    return ALLOCATORS[name](capacity=capacity, **knobs)


def driver_calls(calls: Counter) -> int:
    """Total driver calls of a model: cudaMalloc/cudaFree or the VMM calls (reserve, create, map, ...)."""
    return sum(v for k, v in calls.items() if k in DRIVER_CALLS)
