"""Virtual-memory drivers behind one protocol: counting (simulation), fake (checks and data) and CUDA.

The protocol is the CUDA driver's VMM API (``docs/memory-debug.md`` section 5), with byte sizes and integer
addresses/handles:

``granularity()``, ``reserve(size) -> va``, ``free_va(va, size)``, ``create(size) -> handle``,
``release(handle)``, ``map(va, size, handle)``, ``set_access(va, size)``, ``unmap(va, size)``,
``mem_info() -> (free, total)``, and ``calls``: a :class:`collections.Counter` of calls by name.

:class:`CudaDriver` maps these one-to-one onto ``cuMemAddressReserve``, ``cuMemAddressFree``,
``cuMemCreate``, ``cuMemRelease``, ``cuMemMap``, ``cuMemSetAccess``, ``cuMemUnmap`` and ``cuMemGetInfo``
through ``cuda-python`` on the device's primary context (the one PyTorch uses).
"""

from __future__ import annotations

import bisect
from collections import Counter

from oarlock.memory.errors import DriverError, DriverUnavailable, SimulatedOOM

MiB = 1 << 20


class CountingDriver:
    """Bookkeeping-only driver for simulation: hands out addresses and handle ids, counts calls and
    physical bytes, and fails ``create`` beyond ``memory`` bytes (None = unlimited) with
    :class:`SimulatedOOM`. Does no validity checks (see :class:`FakeDriver`)."""

    VA_BASE = 1 << 40

    def __init__(self, granularity: int = 2 * MiB, memory: int | None = None):
        if granularity <= 0 or granularity & (granularity - 1):
            raise DriverError(f"granularity must be a power of two, got {granularity}")
        self._gran = granularity
        self.memory = memory
        self.calls: Counter = Counter()
        self.physical = 0  # bytes of live handles
        self.handle_sizes: dict[int, int] = {}
        self._next_va = self.VA_BASE
        self._next_handle = 1

    def granularity(self) -> int:
        """Bytes: the unit of ``create`` sizes and of map/unmap addresses and sizes."""
        return self._gran

    def reserve(self, size: int) -> int:
        self.calls["reserve"] += 1
        va = self._next_va
        self._next_va += -(-size // (1 << 30)) * (1 << 30) + (1 << 30)  # a guard gigabyte between ranges
        return va

    def free_va(self, va: int, size: int) -> None:
        self.calls["free_va"] += 1

    def create(self, size: int) -> int:
        if self.memory is not None and self.physical + size > self.memory:
            raise SimulatedOOM(f"create({size}): {self.physical} of {self.memory} bytes in use", size,
                               self.memory, self.physical)
        self.calls["create"] += 1
        h = self._next_handle
        self._next_handle += 1
        self.handle_sizes[h] = size
        self.physical += size
        return h

    def release(self, handle: int) -> None:
        self.calls["release"] += 1
        self.physical -= self.handle_sizes.pop(handle)

    def map(self, va: int, size: int, handle: int) -> None:
        self.calls["map"] += 1

    def set_access(self, va: int, size: int) -> None:
        self.calls["set_access"] += 1

    def unmap(self, va: int, size: int) -> None:
        self.calls["unmap"] += 1

    def mem_info(self) -> tuple[int, int]:
        total = self.memory if self.memory is not None else 1 << 50
        return total - self.physical, total


class FakeDriver(CountingDriver):
    """A pure-Python driver that enforces the CUDA VMM contract and (optionally) stores bytes.

    Checks: map/unmap ranges are granularity-aligned and inside a reservation; a map targets unmapped VA
    with a live handle of exactly that size; unmap covers whole mappings; access must be set before
    :meth:`read`/:meth:`write`. With ``store_data=True`` each handle owns a ``bytearray`` and reads and
    writes go through the page table, so tests can check that data survive remapping.

    Raises:
        DriverError: naming the call and address on any contract violation.
    """

    def __init__(self, granularity: int = 2 * MiB, memory: int | None = None, store_data: bool = False):
        super().__init__(granularity, memory)
        self.store_data = store_data
        self.ranges: dict[int, int] = {}  # reservation va -> size
        self.mapped: list[int] = []  # sorted mapping starts
        self.mappings: dict[int, tuple[int, int, bool]] = {}  # va -> (size, handle, accessible)
        self.data: dict[int, bytearray] = {}

    def _aligned(self, call: str, va: int, size: int) -> None:
        g = self._gran
        if va % g or size % g or size <= 0:
            raise DriverError(f"{call}(va={va:#x}, size={size}): not aligned to the granularity {g}")
        if not any(r <= va and va + size <= r + s for r, s in self.ranges.items()):
            raise DriverError(f"{call}(va={va:#x}, size={size}): outside every reserved range")

    def reserve(self, size: int) -> int:
        if size <= 0 or size % self._gran:
            raise DriverError(f"reserve(size={size}): size must be a positive multiple of {self._gran}")
        va = super().reserve(size)
        self.ranges[va] = size
        return va

    def free_va(self, va: int, size: int) -> None:
        if self.ranges.get(va) != size:
            raise DriverError(f"free_va(va={va:#x}, size={size}): not a reservation")
        if any(va <= m < va + size for m in self.mappings):
            raise DriverError(f"free_va(va={va:#x}): range still has mappings")
        super().free_va(va, size)
        del self.ranges[va]

    def create(self, size: int) -> int:
        if size <= 0 or size % self._gran:
            raise DriverError(f"create(size={size}): size must be a positive multiple of {self._gran}")
        h = super().create(size)
        if self.store_data:
            self.data[h] = bytearray(size)
        return h

    def release(self, handle: int) -> None:
        if handle not in self.handle_sizes:
            raise DriverError(f"release({handle}): no such handle")
        if any(m[1] == handle for m in self.mappings.values()):
            raise DriverError(f"release({handle}): handle is still mapped")
        super().release(handle)
        self.data.pop(handle, None)

    def map(self, va: int, size: int, handle: int) -> None:
        self._aligned("map", va, size)
        if self.handle_sizes.get(handle) != size:
            raise DriverError(f"map(va={va:#x}, size={size}, handle={handle}): handle is missing or of size "
                              f"{self.handle_sizes.get(handle)}")
        k = bisect.bisect(self.mapped, va)
        if k and self.mapped[k - 1] + self.mappings[self.mapped[k - 1]][0] > va or \
                k < len(self.mapped) and self.mapped[k] < va + size:
            raise DriverError(f"map(va={va:#x}, size={size}): overlaps an existing mapping")
        super().map(va, size, handle)
        self.mapped.insert(k, va)
        self.mappings[va] = (size, handle, False)

    def set_access(self, va: int, size: int) -> None:
        self._aligned("set_access", va, size)
        end, cur = va + size, va
        while cur < end:
            if cur not in self.mappings:
                raise DriverError(f"set_access(va={va:#x}, size={size}): {cur:#x} is not mapped")
            s, h, _ = self.mappings[cur]
            self.mappings[cur] = (s, h, True)
            cur += s
        if cur != end:
            raise DriverError(f"set_access(va={va:#x}, size={size}): ends inside a mapping")
        super().set_access(va, size)

    def unmap(self, va: int, size: int) -> None:
        self._aligned("unmap", va, size)
        end, cur, starts = va + size, va, []
        while cur < end:
            if cur not in self.mappings:
                raise DriverError(f"unmap(va={va:#x}, size={size}): {cur:#x} is not the start of a mapping")
            starts.append(cur)
            cur += self.mappings[cur][0]
        if cur != end:
            raise DriverError(f"unmap(va={va:#x}, size={size}): ends inside a mapping")
        for s in starts:
            del self.mappings[s]
            self.mapped.remove(s)
        super().unmap(va, size)

    def _translate(self, va: int, n: int):
        end = va + n
        while va < end:
            k = bisect.bisect(self.mapped, va) - 1
            if k < 0:
                raise DriverError(f"access at {va:#x}: not mapped")
            start = self.mapped[k]
            size, h, acc = self.mappings[start]
            if va >= start + size:
                raise DriverError(f"access at {va:#x}: not mapped")
            if not acc:
                raise DriverError(f"access at {va:#x}: set_access was not called")
            take = min(end, start + size) - va
            yield h, va - start, take
            va += take

    def write(self, va: int, payload: bytes) -> None:
        """Store ``payload`` at virtual address ``va`` (needs ``store_data=True``)."""
        if not self.store_data:
            raise DriverError("write: FakeDriver was created with store_data=False")
        pos = 0
        for h, off, n in self._translate(va, len(payload)):
            self.data[h][off:off + n] = payload[pos:pos + n]
            pos += n

    def read(self, va: int, n: int) -> bytes:
        """The ``n`` bytes at virtual address ``va`` (needs ``store_data=True``)."""
        if not self.store_data:
            raise DriverError("read: FakeDriver was created with store_data=False")
        return b"".join(bytes(self.data[h][off:off + k]) for h, off, k in self._translate(va, n))


class CudaDriver:
    """The CUDA driver's virtual-memory API through ``cuda-python`` (``cuda.bindings.driver``).

    Works on the primary context of ``device`` (shared with PyTorch). Physical memory is pinned device
    memory readable and writable from ``device`` only.

    Raises:
        DriverUnavailable: when cuda-python is missing, the driver library cannot be loaded, or there is
            no such device (so callers and tests can skip cleanly).
        DriverError: when a driver call fails, naming the call and the CUDA error string;
            ``cuMemCreate`` running out of memory raises :class:`SimulatedOOM` instead.
    """

    def __init__(self, device: int = 0):
        try:
            from cuda.bindings import driver as cu
        except ImportError as e:
            raise DriverUnavailable(f"cuda-python is not installed ({e}); pip install cuda-python") from None
        self.cu = cu
        self.device = device
        self.calls: Counter = Counter()
        self.handle_sizes: dict[int, int] = {}
        self._handles: dict[int, object] = {}
        self.physical = 0
        try:
            self._check("cuInit", cu.cuInit(0))
            dev = self._check("cuDeviceGet", cu.cuDeviceGet(device))
            self._ctx = self._check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(dev))
            self._check("cuCtxSetCurrent", cu.cuCtxSetCurrent(self._ctx))
        except DriverError as e:
            raise DriverUnavailable(str(e)) from None
        except Exception as e:  # cuda.pathfinder raises when libcuda.so is absent (no GPU driver)
            raise DriverUnavailable(f"CUDA driver library not usable: {type(e).__name__}: {e}") from None
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        self._prop = prop
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = device
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._desc = desc
        self._gran = int(self._check("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))

    def _check(self, call: str, ret):
        err, *rest = ret if isinstance(ret, tuple) else (ret,)
        if err != self.cu.CUresult.CUDA_SUCCESS:
            _, msg = self.cu.cuGetErrorString(err)
            text = msg.decode() if isinstance(msg, bytes) else str(msg)
            if err == self.cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                raise SimulatedOOM(f"{call}: {text}")
            raise DriverError(f"{call} failed: {err.name if hasattr(err, 'name') else err}: {text}")
        return rest[0] if len(rest) == 1 else (tuple(rest) if rest else None)

    def granularity(self) -> int:
        return self._gran

    def reserve(self, size: int) -> int:
        self.calls["reserve"] += 1
        return int(self._check("cuMemAddressReserve", self.cu.cuMemAddressReserve(size, self._gran, 0, 0)))

    def free_va(self, va: int, size: int) -> None:
        self.calls["free_va"] += 1
        self._check("cuMemAddressFree", self.cu.cuMemAddressFree(self.cu.CUdeviceptr(va), size))

    def create(self, size: int) -> int:
        self.calls["create"] += 1
        h = self._check("cuMemCreate", self.cu.cuMemCreate(size, self._prop, 0))
        key = int(h)
        self._handles[key] = h
        self.handle_sizes[key] = size
        self.physical += size
        return key

    def release(self, handle: int) -> None:
        self.calls["release"] += 1
        self._check("cuMemRelease", self.cu.cuMemRelease(self._handles.pop(handle)))
        self.physical -= self.handle_sizes.pop(handle)

    def map(self, va: int, size: int, handle: int) -> None:
        self.calls["map"] += 1
        self._check("cuMemMap", self.cu.cuMemMap(self.cu.CUdeviceptr(va), size, 0, self._handles[handle], 0))

    def set_access(self, va: int, size: int) -> None:
        self.calls["set_access"] += 1
        self._check("cuMemSetAccess", self.cu.cuMemSetAccess(self.cu.CUdeviceptr(va), size, [self._desc], 1))

    def unmap(self, va: int, size: int) -> None:
        self.calls["unmap"] += 1
        self._check("cuMemUnmap", self.cu.cuMemUnmap(self.cu.CUdeviceptr(va), size))

    def mem_info(self) -> tuple[int, int]:
        free, total = self._check("cuMemGetInfo", self.cu.cuMemGetInfo())
        return int(free), int(total)
