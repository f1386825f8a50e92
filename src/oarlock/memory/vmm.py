"""oarlock's remap allocator: pointer-stable defragmentation by moving physical pages, not data.

A :class:`PagedHeap` is one reserved virtual-address range cut into blocks that are ACTIVE (handed out),
FREE (mapped, unused) or GAP (no physical pages behind them; always page-aligned). Physical memory comes
in fixed-size pages (driver handles of ``page_size`` bytes).

:class:`RemapAllocator` (the policy; design brief sections 1.6 and 2.4(5), after Paddle's post-3.3
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
        """Record that ``pages`` (currently GAP) now have ``handles`` behind them: GAP -> FREE."""
        for p, h in zip(pages, handles):
            if p in self.pages:
                raise MemoryToolError(f"{self.name}: page {p} is already mapped")
            self.pages[p] = h
            lo = self.base + p * self.page
            self._convert(lo, lo + self.page, GAP, FREE)

    def pages_unmapped(self, pages: Iterable[int]) -> list[int]:
        """Record that ``pages`` (wholly under FREE blocks) lost their physical pages: FREE -> GAP.
        Returns their handles."""
        out = []
        for p in pages:
            lo = self.base + p * self.page
            self._convert(lo, lo + self.page, FREE, GAP)
            out.append(self.pages.pop(p))
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


class RemapAllocator:
    """The remap allocator over any driver (see the module docstring for the policy).

    Args:
        driver: a driver (default: a :class:`~oarlock.memory.driver.CountingDriver` with 2 MiB granularity).
        capacity: physical bytes the pool may hold (None: the driver's limit only).
        small_size: requests up to this many bytes (after rounding to 512 B) go to the small heap, larger
            ones to the large heap (PyTorch's 1 MiB ``kSmallSize``).
        small_page / large_page: physical page (handle) size of the small and large heaps, multiples of
            the driver granularity (default: the granularity, and 16 granules = 32 MiB with the usual 2 MiB
            granularity: bigger pages mean fewer driver calls, smaller ones less waste at hole edges; the
            reclaim step recovers most of that waste). Heaps with equal page sizes trade pages; under the
            capacity limit, free pages of other sizes are released to make room.
        va_size: bytes of VA reserved per heap (default: 4x capacity, or 1 TiB without a capacity).
        stable_categories: trace categories routed to a third heap (large pages) for long-lived tensors
            (e.g. ``("parameter", "optimizer")``, Paddle V2's lifetime pools); empty disables routing.
        before_unmap: called before pages are unmapped (a device sync on real GPUs, so no kernel still
            reads a freed block whose pages move).

    Raises:
        SimulatedOOM: a request cannot be served within ``capacity`` even after reclaiming every page under
            a free block.
    """

    name = "remap"

    def __init__(self, driver: Any = None, capacity: int | None = None, small_size: int = 1 * MiB,
                 small_page: int | None = None, large_page: int | None = None, va_size: int | None = None,
                 stable_categories: Iterable[str] = (), before_unmap: Any = None):
        from oarlock.memory.driver import CountingDriver

        self.driver = driver if driver is not None else CountingDriver()
        g = self.driver.granularity()
        self.page_of = {"small": small_page or g, "large": large_page or 16 * g}
        self.page_of["stable"] = self.page_of["large"]
        for k, v in self.page_of.items():
            if v <= 0 or v % g:
                raise MemoryToolError(f"remap: {k} page size {v} is not a positive multiple of the "
                                      f"granularity {g}")
        self.capacity = capacity
        self.small_size = small_size
        self.va_size = va_size or (4 * capacity if capacity else 1 << 40)
        self.stable = frozenset(stable_categories)
        self.before_unmap = before_unmap
        self.heaps: dict[str, PagedHeap] = {}
        self.spare: dict[int, list[int]] = {}  # page size -> created handles not mapped anywhere
        self.handles: Counter = Counter()  # page size -> live handles (mapped or spare)
        self.counters: Counter = Counter()

    # ------------------------------------------------------------------ public
    @property
    def reserved(self) -> int:
        """Physical bytes held (every live handle, mapped or spare)."""
        return sum(size * n for size, n in self.handles.items())

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
        """Unmap and release every page wholly under a free block and every spare handle; returns bytes."""
        n = 0
        for heap in self.heaps.values():
            self.spare.setdefault(heap.page, []).extend(
                self._unmap(heap, [p for p, _ in heap.reclaimable()]))
        for size, handles in self.spare.items():
            for h in handles:
                self.driver.release(h)
                n += size
            self.handles[size] -= len(handles)
            handles.clear()
        return n

    def blocks(self) -> list[tuple[int, int, str, str]]:
        """``(addr, size, state, heap)`` of every non-GAP block, for views."""
        return [(b.addr, b.size, STATE_NAMES[b.state], h.name) for h in self.heaps.values() for b in h.blocks
                if b.state != GAP]

    def free_block_sizes(self) -> list[int]:
        """Sizes of the FREE (mapped, unused) blocks."""
        return [t[0] for h in self.heaps.values() for t in h.free]

    def check(self) -> None:
        for h in self.heaps.values():
            h.check()
        for size, n in self.handles.items():
            mapped = sum(len(h.pages) for h in self.heaps.values() if h.page == size)
            assert mapped + len(self.spare.get(size, [])) == n, (size, mapped, n)

    # ------------------------------------------------------------------ policy
    def _pool_of(self, rsize: int, category: str | None) -> str:
        if category is not None and category in self.stable:
            return "stable"
        return "small" if rsize <= self.small_size else "large"

    def _heap(self, name: str) -> PagedHeap:
        h = self.heaps.get(name)
        if h is None:
            page = self.page_of[name]
            size = round_up(self.va_size, page)
            h = self.heaps[name] = PagedHeap(self.driver.reserve(size), size, page, name)
        return h

    def _placement(self, heap: PagedHeap, size: int) -> tuple[int, list[int]]:
        """The address in ``heap`` needing the fewest new pages for ``size`` bytes (then the lowest), and
        those pages."""
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
        a, pages = self._placement(heap, size)
        self.counters["misses"] += 1
        spare = self.spare.setdefault(heap.page, [])
        handles = spare[:len(pages)]
        del spare[:len(pages)]
        if len(handles) < len(pages):
            handles += self._reclaim(len(pages) - len(handles), heap, (a, a + size))
        while len(handles) < len(pages):
            if self.capacity is not None and self.reserved + heap.page > self.capacity:
                self._release_other_sizes(heap.page)
            if self.capacity is not None and self.reserved + heap.page > self.capacity:
                spare.extend(handles)
                raise SimulatedOOM(f"remap: cannot map {size} bytes: {self.reserved} of {self.capacity} bytes "
                                   "held and no page lies under a free block", size, self.capacity, self.reserved)
            try:
                h = self.driver.create(heap.page)
            except SimulatedOOM:
                spare.extend(handles)
                raise
            self.handles[heap.page] += 1
            handles.append(h)
        self._map(heap, pages, handles)
        self.counters["pages_mapped"] += len(pages)
        return a

    def _reclaim(self, n: int, target: PagedHeap, exclude: tuple[int, int]) -> list[int]:
        """Unmap up to ``n`` pages lying wholly under FREE blocks of heaps with the target's page size
        (not inside ``exclude`` of the target heap) and return their handles."""
        # Smallest holes first (they are the fragmentation), then the highest address (keeps heaps dense).
        cand = sorted(((size, -p, name) for name, heap in self.heaps.items() if heap.page == target.page
                       for p, size in heap.reclaimable(exclude if heap is target else (0, 0))))[:n]
        got: list[int] = []
        for name in sorted({c[2] for c in cand}):
            got += self._unmap(self.heaps[name], [-c[1] for c in cand if c[2] == name])
        if got:
            self.counters["remaps"] += 1
            self.counters["pages_remapped"] += len(got)
        return got

    def _release_other_sizes(self, page: int) -> None:
        """Under the capacity limit: give back (unmap + release) free pages whose size differs from
        ``page`` so that pages of the needed size can be created."""
        for heap in self.heaps.values():
            if heap.page != page:
                self.spare.setdefault(heap.page, []).extend(
                    self._unmap(heap, [p for p, _ in heap.reclaimable()]))
        for size, handles in self.spare.items():
            if size != page and handles:
                for h in handles:
                    self.driver.release(h)
                self.handles[size] -= len(handles)
                self.counters["pages_released"] += len(handles)
                handles.clear()

    def _unmap(self, heap: PagedHeap, pages: list[int]) -> list[int]:
        if not pages:
            return []
        if self.before_unmap is not None:
            self.before_unmap()
        for p in pages:
            self.driver.unmap(heap.base + p * heap.page, heap.page)
        return heap.pages_unmapped(pages)

    def _map(self, heap: PagedHeap, pages: list[int], handles: list[int]) -> None:
        for p, h in zip(pages, handles):
            self.driver.map(heap.base + p * heap.page, heap.page, h)
        from oarlock.memory.allocators import _runs

        for first, n in _runs(pages):  # one set_access per contiguous run of pages
            self.driver.set_access(heap.base + first * heap.page, n * heap.page)
        heap.pages_mapped(pages, handles)


class VmmArena:
    """Explicit CUDA tensors from a :class:`RemapAllocator` on the real driver (integration mode 1 of the
    design brief, section 2.7): ``arena.empty(shape, dtype)`` returns a ``torch.Tensor`` on ``cuda:device``
    whose memory is a remap-pool block; the block returns to the pool when the tensor (and every view of
    it) is garbage-collected. Pointers never move, so the tensors are safe to use anywhere.

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
