"""oarlock's remap allocator: pointer-stable defragmentation by moving physical pages, not data.

A :class:`PagedHeap` is one reserved virtual-address range cut into blocks that are ACTIVE (handed out),
FREE (mapped, unused) or GAP (no physical pages behind them; always page-aligned). Physical memory comes
in driver handles covering one page, or (``mixed=True``) several consecutive pages.

:class:`RemapAllocator` (the policy; ``docs/memory-debug.md`` section 4, after Paddle's post-3.3
``FreeBlockRemapCompactor`` and PyTorch's expandable segments) serves a request by

1. best fit among FREE blocks (lowest size, then address; the front of a block is handed out);
2. on a miss, picking the run of non-ACTIVE VA that needs the fewest new pages (then the lowest address),
   and obtaining those pages by (a) unmapped spare handles, (b) **unmapping pages that lie wholly under
   FREE blocks elsewhere** (they become GAP) and mapping those handles at the target, and only then
   (c) creating new handles within the capacity.

Live blocks never move and no pointer changes, so the policy can sit under PyTorch tensors. The same code
drives a :class:`~oarlock.memory.driver.CountingDriver` in the simulator, a
:class:`~oarlock.memory.driver.FakeDriver` in tests (which checks that data survive) and a
:class:`~oarlock.memory.driver.CudaDriver` on GPUs (:class:`VmmArena`).
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Any, Iterable

from oarlock.memory.errors import DriverError, MemoryToolError, SimulatedOOM

MiB = 1 << 20
ACTIVE, FREE, GAP = 0, 1, 2
STATE_NAMES = {ACTIVE: "active", FREE: "free", GAP: "gap"}
MIN_BLOCK = 512  # every request is rounded up to this (PyTorch's kMinBlockSize)


def round_up(n: int, m: int) -> int:
    """``n`` rounded up to a multiple of ``m``."""
    return -(-n // m) * m


class Block:
    """A contiguous VA range of one heap. ``addr``/``size`` in bytes; ``state`` ACTIVE, FREE or GAP."""

    __slots__ = ("addr", "size", "state", "heap", "requested")

    def __init__(self, addr: int, size: int, state: int, heap: Any = None):
        self.addr, self.size, self.state, self.heap = addr, size, state, heap
        self.requested = size

    @property
    def end(self) -> int:
        return self.addr + self.size

    def __repr__(self) -> str:
        return f"Block({self.addr:#x}, {self.size}, {STATE_NAMES[self.state]})"


class PagedHeap:
    """Block and page bookkeeping of one VA range ``[base, base + size)`` (no driver calls).

    Invariants (checked by :meth:`check`): blocks tile the range in address order; neighbouring FREE
    blocks and neighbouring GAP blocks are merged; every page overlapping a FREE or ACTIVE block is mapped
    and no page inside a GAP block is.
    """

    def __init__(self, base: int, size: int, page: int, name: str = "heap"):
        if size % page:
            raise MemoryToolError(f"{name}: size {size} must be a multiple of the page size {page}")
        self.base, self.size, self.page, self.name = base, size, page, name
        self.blocks: list[Block] = [Block(base, size, GAP, self)]
        self.starts: list[int] = [base]
        self.free: list[tuple[int, int, Block]] = []  # (size, addr, block) of FREE blocks, sorted
        self.pages: dict[int, int] = {}  # page index -> driver handle
        self.spans: dict[int, tuple[int, int]] = {}  # handle -> (first page, pages); a handle may span pages

    # ------------------------------------------------------------------ primitive edits
    def _index(self, addr: int) -> int:
        return bisect.bisect(self.starts, addr) - 1

    def _free_add(self, b: Block) -> None:
        bisect.insort(self.free, (b.size, b.addr, b), key=lambda t: (t[0], t[1]))

    def _free_remove(self, b: Block) -> None:
        k = bisect.bisect_left(self.free, (b.size, b.addr), key=lambda t: (t[0], t[1]))
        assert self.free[k][2] is b, (self.free[k], b)
        del self.free[k]

    def _replace(self, i: int, new: list[Block]) -> None:
        old = self.blocks[i]
        if old.state == FREE:
            self._free_remove(old)
        self.blocks[i:i + 1] = new
        self.starts[i:i + 1] = [b.addr for b in new]
        for b in new:
            if b.state == FREE:
                self._free_add(b)

    def _merge_around(self, i: int) -> int:
        """Merge block i with same-state (FREE or GAP) neighbours; returns the merged block's index."""
        b = self.blocks[i]
        if b.state == ACTIVE:
            return i
        lo = i - 1 if i > 0 and self.blocks[i - 1].state == b.state else i
        hi = i + 1 if i + 1 < len(self.blocks) and self.blocks[i + 1].state == b.state else i
        if lo == hi:
            return i
        parts = self.blocks[lo:hi + 1]
        if b.state == FREE:
            for q in parts:
                self._free_remove(q)
        m = Block(parts[0].addr, sum(q.size for q in parts), b.state, self)
        self.blocks[lo:hi + 1] = [m]
        self.starts[lo:hi + 1] = [m.addr]
        if b.state == FREE:
            self._free_add(m)
        return lo

    def _convert(self, lo: int, hi: int, frm: int, to: int) -> Block:
        """Turn ``[lo, hi)``, which must lie inside one block of state ``frm``, into state ``to``."""
        i = self._index(lo)
        b = self.blocks[i]
        if b.state != frm or not (b.addr <= lo < hi <= b.end):
            raise MemoryToolError(f"{self.name}: [{lo:#x}, {hi:#x}) is not inside one "
                                  f"{STATE_NAMES[frm]} block (found {b})")
        mid = Block(lo, hi - lo, to, self)
        new = ([Block(b.addr, lo - b.addr, frm, self)] if lo > b.addr else []) + [mid] + \
              ([Block(hi, b.end - hi, frm, self)] if hi < b.end else [])
        self._replace(i, new)
        if to != ACTIVE:
            self._merge_around(i + (lo > b.addr))
        return mid

    # ------------------------------------------------------------------ queries
    def best_fit(self, size: int) -> Block | None:
        """Smallest FREE block of at least ``size`` bytes (lowest address among equals)."""
        k = bisect.bisect_left(self.free, (size, -1), key=lambda t: (t[0], t[1]))
        return self.free[k][2] if k < len(self.free) else None

    def runs(self) -> list[tuple[int, int, list[Block]]]:
        """Maximal runs of neighbouring non-ACTIVE blocks: ``(start, end, blocks)`` in address order."""
        out, cur = [], []
        for b in self.blocks:
            if b.state == ACTIVE:
                if cur:
                    out.append((cur[0].addr, cur[-1].end, cur))
                cur = []
            else:
                cur.append(b)
        if cur:
            out.append((cur[0].addr, cur[-1].end, cur))
        return out

    def unmapped_pages(self, lo: int, hi: int) -> list[int]:
        """Indices of the pages overlapping ``[lo, hi)`` that have no physical page."""
        p0, p1 = (lo - self.base) // self.page, (hi - self.base - 1) // self.page
        return [p for p in range(p0, p1 + 1) if p not in self.pages]

    def reclaimable(self, exclude: tuple[int, int] = (0, 0)) -> list[tuple[int, int]]:
        """``(page, hole_size)`` for every mapped page lying wholly under a FREE block (of ``hole_size``
        bytes) and outside ``exclude``."""
        out = []
        for size, addr, b in self.free:
            p0 = round_up(b.addr - self.base, self.page) // self.page
            p1 = (b.end - self.base) // self.page
            for p in range(p0, p1):
                va = self.base + p * self.page
                if va + self.page <= exclude[0] or va >= exclude[1]:
                    out.append((p, size))
        return out

    def reclaimable_handles(self, exclude: tuple[int, int] = (0, 0)) -> list[tuple[int, int, int, int]]:
        """``(handle, pages, hole_size, first_page)`` for every handle whose pages all lie under one FREE
        block (of ``hole_size`` bytes) and outside ``exclude``."""
        out = []
        for size, addr, b in self.free:
            p0 = round_up(b.addr - self.base, self.page) // self.page
            p1 = (b.end - self.base) // self.page
            seen = set()
            for p in range(p0, p1):
                h = self.pages[p]
                if h in seen:
                    continue
                seen.add(h)
                first, n = self.spans[h]
                lo, hi = self.base + first * self.page, self.base + (first + n) * self.page
                if first >= p0 and first + n <= p1 and (hi <= exclude[0] or lo >= exclude[1]):
                    out.append((h, n, size, first))
        return out

    def gap_pages(self, blocks: Iterable[Block], lo: int, hi: int) -> int:
        """Number of unmapped pages that ``[lo, hi)`` overlaps among ``blocks``."""
        n = 0
        for b in blocks:
            if b.state == GAP and b.addr < hi and b.end > lo:
                s, e = max(b.addr, lo) - self.base, min(b.end, hi) - self.base
                n += -(-e // self.page) - s // self.page
        return n

    def mapped_bytes(self) -> int:
        return len(self.pages) * self.page

    # ------------------------------------------------------------------ edits used by policies
    def carve(self, addr: int, size: int) -> Block:
        """Hand out ``[addr, addr + size)``, which must lie inside one FREE block, as an ACTIVE block."""
        return self._convert(addr, addr + size, FREE, ACTIVE)

    def release(self, block: Block) -> None:
        """ACTIVE -> FREE, merging with FREE neighbours."""
        i = self._index(block.addr)
        if self.blocks[i] is not block:
            raise MemoryToolError(f"{self.name}: {block} is not a live block of this heap")
        block.state = FREE
        self._free_add(block)
        self._merge_around(i)

    def pages_mapped(self, pages: Iterable[int], handles: Iterable[int]) -> None:
        """Record that ``pages`` (currently GAP) now have one-page ``handles`` behind them: GAP -> FREE."""
        self.spans_mapped([(p, 1, h) for p, h in zip(pages, handles)])

    def spans_mapped(self, spans: Iterable[tuple[int, int, int]]) -> None:
        """Record ``(first_page, pages, handle)`` mappings over GAP pages: GAP -> FREE."""
        for first, n, h in spans:
            for p in range(first, first + n):
                if p in self.pages:
                    raise MemoryToolError(f"{self.name}: page {p} is already mapped")
                self.pages[p] = h
            self.spans[h] = (first, n)
            lo = self.base + first * self.page
            self._convert(lo, lo + n * self.page, GAP, FREE)

    def handles_unmapped(self, handles: Iterable[int]) -> None:
        """Record that ``handles`` (each wholly under one FREE block) were unmapped: FREE -> GAP."""
        for h in handles:
            first, n = self.spans.pop(h)
            lo = self.base + first * self.page
            self._convert(lo, lo + n * self.page, FREE, GAP)
            for p in range(first, first + n):
                del self.pages[p]

    def pages_unmapped(self, pages: Iterable[int]) -> list[int]:
        """Record that ``pages`` (wholly under FREE blocks) lost their physical pages: FREE -> GAP.
        Returns their handles."""
        out = [self.pages[p] for p in pages]
        self.handles_unmapped(out)
        return out

    def check(self) -> None:
        """Assert the invariants (tests)."""
        cur = self.base
        keys = sorted(self.pages)
        for k, b in enumerate(self.blocks):
            assert b.addr == cur and b.size > 0 and self.starts[k] == b.addr, (k, b)
            cur = b.end
            if k and b.state != ACTIVE:
                assert self.blocks[k - 1].state != b.state, ("unmerged", self.blocks[k - 1], b)
            p0, p1 = (b.addr - self.base) // self.page, (b.end - 1 - self.base) // self.page
            if b.state == GAP:
                assert (b.addr - self.base) % self.page == 0 and b.size % self.page == 0, b
                k = bisect.bisect_left(keys, p0)
                assert k == len(keys) or keys[k] > p1, ("mapped page under a gap", b)
            else:
                assert all(p in self.pages for p in range(p0, p1 + 1)), ("unmapped", b)
        assert cur == self.base + self.size
        assert sorted(t[:2] for t in self.free) == sorted((b.size, b.addr) for b in self.blocks if b.state == FREE)


class HeapViews:
    """Block views shared by the allocators built on :class:`PagedHeap` (``self.heaps``: name -> heap)."""

    heaps: dict[str, PagedHeap]

    def blocks(self) -> list[tuple[int, int, str, str]]:
        """``(addr, size, state, heap)`` of every non-GAP block, for views."""
        return [(b.addr, b.size, STATE_NAMES[b.state], h.name) for h in self.heaps.values() for b in h.blocks
                if b.state != GAP]

    def free_block_sizes(self) -> list[int]:
        """Sizes of the FREE (mapped, unused) blocks."""
        return [t[0] for h in self.heaps.values() for t in h.free]


class RemapAllocator(HeapViews):
    """The remap allocator over any driver (see the module docstring for the policy).

    Physical memory comes in fixed pages: one granule (the driver granularity, 2 MiB on current GPUs) in the
    small heap and ``large_page`` bytes in the large heap. With ``mixed=True`` the large heap is instead
    tracked per granule and a miss maps each run of missing granules with as many ``large_page`` handles as
    fit plus single granules at the ends: hole edges then waste at most one granule (less fragmentation) at
    the price of more driver calls. Handles lying wholly under free blocks are reclaimed by size.

    Args:
        driver: a driver (default: a :class:`~oarlock.memory.driver.CountingDriver` with 2 MiB granularity).
        capacity: physical bytes the pool may hold (None: the driver's limit only).
        small_size: requests up to this many bytes (after rounding to 512 B) go to the small heap (one-granule
            handles only), larger ones to the large heap (PyTorch's 1 MiB ``kSmallSize``).
        large_page: bytes of a large handle, a multiple of the granularity (default 16 granules = 32 MiB);
            equal to the granularity for fixed one-granule pages.
        mixed: map the large heap with large handles plus single granules at run ends (see above);
            ``"binary"``: large handles plus power-of-two handles for the rest of each run (an 11-granule
            remainder gets 8 + 2 + 1), so a hole edge wastes nothing and costs at most log2(large_page /
            granule) extra handles.
        va_size: bytes of VA reserved per heap (default: 4x capacity, or 1 TiB without a capacity).
        stable_categories: trace categories routed to a third heap for long-lived tensors (e.g.
            ``("parameter", "optimizer")``, Paddle V2's lifetime pools); empty disables routing.
        before_unmap: called before pages are unmapped (a device sync on real GPUs, so no kernel still
            reads a freed block whose pages move).

    Raises:
        SimulatedOOM: a request cannot be served within ``capacity`` even after reclaiming every handle
            under a free block.
    """

    name = "remap"

    def __init__(self, driver: Any = None, capacity: int | None = None, small_size: int = 1 * MiB,
                 large_page: int | None = None, va_size: int | None = None,
                 stable_categories: Iterable[str] = (), before_unmap: Any = None, mixed: bool | str = False):
        from oarlock.memory.driver import CountingDriver

        self.driver = driver if driver is not None else CountingDriver()
        self.page = g = self.driver.granularity()
        large_page = large_page or 16 * g
        if large_page <= 0 or large_page % g:
            raise MemoryToolError(f"remap: large page size {large_page} is not a positive multiple of the "
                                  f"granularity {g}")
        self.big = large_page // g  # granules per large handle
        if mixed not in (False, True, "binary"):
            raise MemoryToolError(f"remap: mixed={mixed!r}: expected False, True or 'binary'")
        self.mixed = mixed
        self.capacity = capacity
        self.small_size = small_size
        self.va_size = round_up(va_size or (4 * capacity if capacity else 1 << 40), large_page)
        self.stable = frozenset(stable_categories)
        self.before_unmap = before_unmap
        self.heaps: dict[str, PagedHeap] = {}
        self.spare: dict[int, list[int]] = {}  # granules per handle -> created handles not mapped anywhere
        self.handles: Counter = Counter()  # granules per handle -> live handles (mapped or spare)
        self.counters: Counter = Counter()

    # ------------------------------------------------------------------ public
    @property
    def reserved(self) -> int:
        """Physical bytes held (every live handle, mapped or spare)."""
        return sum(k * n for k, n in self.handles.items()) * self.page

    @property
    def spare_bytes(self) -> int:
        """Physical bytes of created handles that are not mapped anywhere."""
        return sum(k * len(hs) for k, hs in self.spare.items()) * self.page

    @property
    def calls(self) -> Counter:
        return self.driver.calls

    def malloc(self, size: int, stream: int = 0, category: str | None = None) -> Block:
        """A pointer-stable ACTIVE block of ``round_up(size, 512)`` bytes (``block.addr`` is the device
        pointer). ``stream`` is ignored: frees are stream-ordered (see :class:`VmmArena`). Raises
        :class:`SimulatedOOM`."""
        if size < 0:
            raise MemoryToolError(f"malloc: size must be >= 0, got {size}")
        rsize = max(MIN_BLOCK, round_up(size, MIN_BLOCK))
        heap = self._heap(self._pool_of(rsize, category))
        b = heap.best_fit(rsize)
        if b is not None:
            self.counters["hits"] += 1
            addr = b.addr
        else:
            addr = self._grow(heap, rsize)
        blk = heap.carve(addr, rsize)
        blk.requested = size
        return blk

    def free(self, block: Block) -> None:
        """Return ``block`` to its heap (no driver call; its pages are reclaimed only when needed)."""
        block.heap.release(block)

    def empty_cache(self) -> int:
        """Unmap and release every handle wholly under a free block and every spare handle; returns bytes."""
        for heap in self.heaps.values():
            self._unmap(heap, [c[0] for c in heap.reclaimable_handles()])
        return self._release_spare(lambda k: True)

    def check(self) -> None:
        for h in self.heaps.values():
            h.check()
        for k, n in self.handles.items():
            mapped = sum(1 for h in self.heaps.values() for f, c in h.spans.values() if c * self._unit(h) == k)
            assert mapped + len(self.spare.get(k, [])) == n, (k, mapped, n)

    # ------------------------------------------------------------------ policy
    def _pool_of(self, rsize: int, category: str | None) -> str:
        if category is not None and category in self.stable:
            return "stable"
        return "small" if rsize <= self.small_size else "large"

    def _heap(self, name: str) -> PagedHeap:
        h = self.heaps.get(name)
        if h is None:
            page = self.page if name == "small" or self.mixed else self.big * self.page
            h = self.heaps[name] = PagedHeap(self.driver.reserve(self.va_size), self.va_size, page, name)
        return h

    def _unit(self, heap: PagedHeap) -> int:
        """Granules per page of ``heap``."""
        return heap.page // self.page

    def _placement(self, heap: PagedHeap, size: int) -> tuple[int, list[int]]:
        """The address in ``heap`` needing the fewest new granules for ``size`` bytes (then the lowest), and
        those granules."""
        best: tuple[int, int] | None = None
        for start, end, blocks in heap.runs():
            if end - start < size:
                continue
            cands = {b.addr for b in blocks if b.addr + size <= end}
            cands.add(start)
            cands.add(end - size)
            for a in cands:
                key = (heap.gap_pages(blocks, a, a + size), a)
                if best is None or key < best:
                    best = key
        if best is None:
            raise SimulatedOOM(f"{heap.name}: virtual address range of {heap.size} bytes exhausted "
                               f"(request {size})", size, self.capacity, self.reserved)
        a = best[1]
        return a, heap.unmapped_pages(a, a + size)

    def _grow(self, heap: PagedHeap, size: int) -> int:
        if self.mixed == "binary" and heap.name != "small":
            return self._grow_binary(heap, size)
        a, pages = self._placement(heap, size)
        self.counters["misses"] += 1
        big = self.big if self.mixed and heap.name != "small" else 1
        unit = self._unit(heap)
        # cut each run of missing granules into large spans, then single granules at its end
        spans: list[list[int]] = []  # [first, granules]
        for first, n in page_runs(pages):
            while n >= big > 1:
                spans.append([first, big])
                first, n = first + big, n - big
            spans += [[first + i, 1] for i in range(n)]
        exclude = (a, a + size)
        got: list[tuple[int, int, int]] = []  # (first, granules, handle)
        # large spans: a spare or reclaimed large handle, else the same granules as single handles
        large = [sp for sp in spans if sp[1] > 1]
        hs = self._obtain(len(large), big * unit, heap, exclude)
        for sp, h in zip(large, hs):
            got.append((sp[0], sp[1], h))
        singles = [sp[0] for sp in spans if sp[1] == 1] + \
            [sp[0] + i for sp in large[len(hs):] for i in range(sp[1])]
        pending_large = large[len(hs):]
        avail = len(self.spare.get(unit, [])) + sum(
            1 for hp in self.heaps.values() for c in hp.reclaimable_handles(exclude if hp is heap else (0, 0))
            if c[1] * self._unit(hp) == unit) if pending_large else 0
        if pending_large and avail < len(singles):  # not enough single granules: create the large ones
            singles = [sp[0] for sp in spans if sp[1] == 1]
        else:
            pending_large = []
        hs = self._obtain(len(singles), unit, heap, exclude)
        got += [(p, 1, h) for p, h in zip(singles, hs)]

        def create() -> None:
            for p in singles[len(hs):]:
                got.append((p, 1, self._create(unit, size, heap, exclude)))
            for sp in pending_large:
                got.append((sp[0], sp[1], self._create(sp[1] * unit, size, heap, exclude)))

        return self._commit(heap, a, len(pages), got, create)

    def _commit(self, heap: PagedHeap, a: int, n_pages: int, got: list[tuple[int, int, int]],
                collect: Any) -> int:
        """Run ``collect()`` (which appends ``(first, granules, handle)`` to ``got``), then map ``got`` and
        return ``a``; on an out-of-memory every handle gathered so far goes back to the spare lists."""
        unit = self._unit(heap)
        try:
            collect()
        except SimulatedOOM:
            for _, k, h in got:
                self.spare.setdefault(k * unit, []).append(h)
            raise
        self._map(heap, got)
        self.counters["pages_mapped"] += n_pages
        return a

    def _grow_binary(self, heap: PagedHeap, size: int) -> int:
        """``mixed="binary"``: each run of missing granules is cut into large handles, then the remainder into
        power-of-two handles (largest first: at most log2(large_page / granule) of them per run), each size
        served by spare or reclaimed handles of that size before new ones are created."""
        a, pages = self._placement(heap, size)
        self.counters["misses"] += 1
        unit = self._unit(heap)
        spans: list[tuple[int, int]] = []  # (first granule, granules)
        for first, n in page_runs(pages):
            k = self.big
            while n:
                while k > n:
                    k //= 2
                spans.append((first, k))
                first, n = first + k, n - k
        exclude = (a, a + size)
        got: list[tuple[int, int, int]] = []

        def collect() -> None:
            for k in sorted({k for _, k in spans}, reverse=True):
                want = [f for f, kk in spans if kk == k]
                hs = self._obtain(len(want), k * unit, heap, exclude)
                got.extend((f, k, h) for f, h in zip(want, hs))
                for f in want[len(hs):]:
                    got.append((f, k, self._create(k * unit, size, heap, exclude)))

        return self._commit(heap, a, len(pages), got, collect)

    def _obtain(self, n: int, k: int, target: PagedHeap, exclude: tuple[int, int]) -> list[int]:
        """Up to ``n`` handles of ``k`` granules: spare ones, then ones reclaimed from under free blocks."""
        spare = self.spare.setdefault(k, [])
        out = spare[:n]
        del spare[:n]
        if len(out) < n:
            out += self._reclaim(n - len(out), k, target, exclude)
        return out

    def _create(self, k: int, size: int, target: PagedHeap, exclude: tuple[int, int]) -> int:
        if self.capacity is not None and self.reserved + k * self.page > self.capacity:
            self._release_spare(lambda kk: kk != k, target, exclude)  # give back handles of the other size
        if self.capacity is not None and self.reserved + k * self.page > self.capacity:
            raise SimulatedOOM(f"remap: cannot map {size} bytes: {self.reserved} of {self.capacity} bytes "
                               "held and no handle lies under a free block", size, self.capacity, self.reserved)
        h = self.driver.create(k * self.page)
        self.handles[k] += 1
        return h

    def _reclaim(self, n: int, k: int, target: PagedHeap, exclude: tuple[int, int]) -> list[int]:
        """Unmap up to ``n`` handles of ``k`` granules lying wholly under FREE blocks (any heap; not inside
        ``exclude`` of the target heap) and return them."""
        # Smallest holes first (they are the fragmentation), then the highest address (keeps heaps dense).
        cand = sorted((size, -first, name, h) for name, heap in self.heaps.items()
                      for h, kk, size, first in heap.reclaimable_handles(exclude if heap is target else (0, 0))
                      if kk * self._unit(heap) == k)[:n]
        got: list[int] = []
        for name in sorted({c[2] for c in cand}):
            hs = [c[3] for c in cand if c[2] == name]
            self._unmap(self.heaps[name], hs, keep=False)
            got += hs
        if got:
            self.counters["remaps"] += 1
            self.counters["granules_remapped"] += len(got) * k
        return got

    def _release_spare(self, which: Any, target: PagedHeap | None = None,
                       exclude: tuple[int, int] = (0, 0)) -> int:
        """Unmap every handle under a free block (outside ``exclude`` of ``target``) into the spare lists,
        then release the spare handles whose granule count satisfies ``which``; returns bytes released."""
        for heap in self.heaps.values():
            ex = exclude if heap is target else (0, 0)
            self._unmap(heap, [c[0] for c in heap.reclaimable_handles(ex) if which(c[1] * self._unit(heap))])
        n = 0
        for k, hs in self.spare.items():
            if which(k) and hs:
                for h in hs:
                    self.driver.release(h)
                self.handles[k] -= len(hs)
                n += len(hs) * k * self.page
                self.counters["handles_released"] += len(hs)
                hs.clear()
        return n

    def _unmap(self, heap: PagedHeap, handles: list[int], keep: bool = True) -> None:
        """Unmap ``handles`` from ``heap``; with ``keep`` they go to the spare lists."""
        if not handles:
            return
        if self.before_unmap is not None:
            self.before_unmap()
        for h in handles:
            first, k = heap.spans[h]
            self.driver.unmap(heap.base + first * heap.page, k * heap.page)
            if keep:
                self.spare.setdefault(k * self._unit(heap), []).append(h)
        heap.handles_unmapped(handles)

    def _map(self, heap: PagedHeap, spans: list[tuple[int, int, int]]) -> None:
        for first, k, h in spans:  # k pages of this heap
            self.driver.map(heap.base + first * heap.page, k * heap.page, h)
        granules = [p for first, k, _ in spans for p in range(first, first + k)]
        for first, n in page_runs(granules):  # one set_access per contiguous run
            self.driver.set_access(heap.base + first * heap.page, n * heap.page)
        heap.spans_mapped(spans)


def page_runs(pages: Iterable[int]) -> list[tuple[int, int]]:
    """``(first, count)`` of each run of consecutive page indices."""
    out: list[list[int]] = []
    for p in sorted(pages):
        if out and p == out[-1][0] + out[-1][1]:
            out[-1][1] += 1
        else:
            out.append([p, 1])
    return [(a, b) for a, b in out]


class VmmArena:
    """Explicit CUDA tensors from a :class:`RemapAllocator` on the real driver (the driver protocol:
    ``docs/memory-debug.md`` section 5): ``arena.empty(shape, dtype)`` returns a ``torch.Tensor`` on
    ``cuda:device`` whose memory is a remap-pool block; the block returns to the pool when the tensor (and
    every view of it) is garbage-collected. Pointers never move, so the tensors are safe to use anywhere.

    Frees are stream-ordered like PyTorch's caching allocator: a freed block is reused at once on the same
    stream, and before any page is unmapped the pool synchronises the device, so no kernel still reads a
    page that moves.

    Raises:
        DriverUnavailable: no GPU, no CUDA driver or no cuda-python.
    """

    def __init__(self, device: int = 0, capacity: int | None = None, driver: Any = None):
        import torch

        from oarlock.memory.driver import CudaDriver

        self.device = device
        drv = driver or CudaDriver(device)
        total = drv.mem_info()[1]
        self.pool = RemapAllocator(drv, capacity=capacity or total, va_size=2 * total,
                                   before_unmap=lambda: torch.cuda.synchronize(device))

    def empty(self, shape: Iterable[int] | int, dtype: Any = None) -> Any:
        """An uninitialised tensor of ``shape`` and ``dtype`` (default float32) in the arena."""
        import torch

        dtype = dtype or torch.float32
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = max(1, int(torch.Size(shape).numel()) * dtype.itemsize)
        block = self.pool.malloc(nbytes)
        holder = _ArenaBlock(self.pool, block)
        raw = torch.as_tensor(holder, device=f"cuda:{self.device}")  # holds `holder` until freed
        return raw[: torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)

    def stats(self) -> dict[str, int]:
        alloc = sum(s for _, s, st, _ in self.pool.blocks() if st == "active")
        return {"allocated": alloc, "reserved": self.pool.reserved, **self.pool.calls}


class _ArenaBlock:
    """Exposes a pool block through ``__cuda_array_interface__`` (bytes) and frees it when collected."""

    def __init__(self, pool: RemapAllocator, block: Block):
        self.pool, self.block = pool, block
        self.__cuda_array_interface__ = {"shape": (block.size,), "typestr": "|u1", "data": (block.addr, False),
                                         "version": 3, "strides": None}

    def __del__(self) -> None:
        try:
            self.pool.free(self.block)
        except (MemoryToolError, DriverError):  # pragma: no cover - interpreter shutdown
            pass
