"""The remap allocator and the drivers: fake-driver contract, data surviving remaps, real CUDA when present."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oarlock.memory import DriverError, DriverUnavailable, MemoryToolError, SimulatedOOM
from oarlock.memory.driver import CudaDriver, FakeDriver
from oarlock.memory.vmm import RemapAllocator

MiB = 1 << 20


def test_fake_driver_enforces_the_vmm_contract():
    d = FakeDriver(granularity=4096, store_data=True)
    va = d.reserve(16 * 4096)
    h = d.create(4096)
    with pytest.raises(DriverError, match="not aligned"):
        d.map(va + 100, 4096, h)
    with pytest.raises(DriverError, match="outside every reserved range"):
        d.map(va + 64 * 4096, 4096, h)
    with pytest.raises(DriverError, match="handle is missing or of size"):
        d.map(va, 8192, h)
    d.map(va, 4096, h)
    with pytest.raises(DriverError, match="overlaps"):
        d.map(va, 4096, d.create(4096))
    with pytest.raises(DriverError, match="set_access was not called"):
        d.read(va, 4)
    d.set_access(va, 4096)
    d.write(va + 10, b"abc")
    assert d.read(va + 10, 3) == b"abc"
    with pytest.raises(DriverError, match="still mapped"):
        d.release(h)
    with pytest.raises(DriverError, match="not the start of a mapping"):
        d.unmap(va + 4096, 4096)
    d.unmap(va, 4096)
    d.release(h)
    with pytest.raises(DriverError, match="not mapped"):
        d.read(va, 1)


def test_remap_reuses_pages_under_free_blocks_before_creating():
    d = FakeDriver(granularity=2 * MiB, store_data=True)
    m = RemapAllocator(d, large_page=2 * MiB)
    a, b, c = (m.malloc(4 * MiB) for _ in range(3))  # [0,4) [4,8) [8,12): six 2 MiB pages
    d.write(b.addr, b"B" * 4 * MiB)
    b_addr = b.addr
    m.free(a)
    m.free(c)
    x = m.malloc(8 * MiB)
    # cheapest placement is c's hole extended by two pages; those pages come from a's hole, unmapped there
    assert x.addr == c.addr and m.reserved == 12 * MiB
    assert (d.calls["create"], d.calls["map"], d.calls["unmap"]) == (6, 8, 2)
    assert b.addr == b_addr and d.read(b.addr, 4 * MiB) == b"B" * 4 * MiB  # pointer and data unchanged
    d.write(x.addr, b"X" * 8 * MiB)
    assert d.read(x.addr + 8 * MiB - 1, 1) == b"X"
    m.check()
    with pytest.raises(SimulatedOOM):  # nothing free left to reclaim and a 12 MiB cap
        RemapAllocator(FakeDriver(), capacity=12 * MiB, large_page=2 * MiB).malloc(14 * MiB)


def test_remap_empty_cache_and_bad_pages():
    d = FakeDriver()
    m = RemapAllocator(d)
    m.free(m.malloc(40 * MiB))  # fixed 32 MiB large pages: two of them
    assert (d.calls["create"], d.calls["map"], d.calls["set_access"]) == (2, 2, 1)
    assert m.empty_cache() == 64 * MiB and m.reserved == 0 and d.physical == 0
    d = FakeDriver()
    m = RemapAllocator(d, mixed=True)
    m.free(m.malloc(40 * MiB))  # mixed: 20 granules = one 32 MiB handle, then four 2 MiB ones
    assert (d.calls["create"], d.calls["map"], d.calls["set_access"]) == (5, 5, 1)
    assert m.empty_cache() == 40 * MiB and m.reserved == 0 and d.physical == 0
    d = FakeDriver()
    m = RemapAllocator(d, mixed="binary")
    m.free(m.malloc(46 * MiB))  # binary: 23 granules = 16 + 4 + 2 + 1 granule handles (32, 8, 4, 2 MiB)
    assert (d.calls["create"], d.calls["map"], d.calls["set_access"]) == (4, 4, 1)
    assert sorted(m.handles.elements()) == [1, 2, 4, 16]
    assert m.empty_cache() == 46 * MiB and m.reserved == 0 and d.physical == 0
    with pytest.raises(MemoryToolError, match="large page size 3"):
        RemapAllocator(FakeDriver(), large_page=3 * MiB)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), cap_pages=st.sampled_from([None, 24, 40]),
       mixed=st.sampled_from([False, True, "binary"]))
def test_fake_driver_remap_keeps_data(seed, cap_pages, mixed):
    """Random malloc/free with every live block holding a distinct pattern: after each op (and the remaps
    it triggers) every live block reads back its own bytes at its original address."""
    g = 4096
    d = FakeDriver(granularity=g, store_data=True)
    m = RemapAllocator(d, capacity=cap_pages * g if cap_pages else None, small_size=1024,
                       large_page=(8 if mixed == "binary" else 2) * g, mixed=mixed)
    rng = random.Random(seed)
    live = {}
    for i in range(150):
        if live and rng.random() < 0.45:
            k = rng.choice(sorted(live))
            blk, pat = live.pop(k)
            assert d.read(blk.addr, len(pat)) == pat
            m.free(blk)
        else:
            n = rng.choice([100, 700, 3000, 9000, 20000])
            try:
                blk = m.malloc(n)
            except SimulatedOOM:
                continue
            pat = bytes([i % 251]) * n
            d.write(blk.addr, pat)
            live[i] = (blk, pat)
        for blk, pat in live.values():
            assert d.read(blk.addr, len(pat)) == pat
        m.check()
    assert m.counters["misses"] > 0


def _cuda_driver():
    try:
        return CudaDriver(0)
    except DriverUnavailable as e:
        pytest.skip(f"no CUDA driver: {e}")


def _stand_in_bindings(monkeypatch, cu_init) -> None:
    """Put a stand-in ``cuda.bindings.driver`` in ``sys.modules`` whose ``cuInit`` returns (or raises) what
    ``cu_init(CUresult)`` does, so the driver's refusal is exercised on any machine."""
    import enum
    import sys
    import types

    class CUresult(enum.IntEnum):  # the codes the driver wrapper reads
        CUDA_SUCCESS = 0
        CUDA_ERROR_OUT_OF_MEMORY = 2
        CUDA_ERROR_NO_DEVICE = 100

    drv = types.ModuleType("cuda.bindings.driver")
    drv.CUresult = CUresult
    drv.cuInit = lambda flags: cu_init(CUresult)
    drv.cuGetErrorString = lambda err: (CUresult.CUDA_SUCCESS, b"no CUDA-capable device is detected")
    pkg = types.ModuleType("cuda.bindings")
    pkg.driver = drv
    monkeypatch.setitem(sys.modules, "cuda.bindings", pkg)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", drv)


def _no_device(codes):
    return (codes.CUDA_ERROR_NO_DEVICE,)


def _no_library(codes):
    raise RuntimeError("libcuda.so.1: cannot open shared object file")


@pytest.mark.parametrize("cause,message", [
    ("no cuda-python", "cuda-python is not installed"),
    ("no device", "cuInit failed: CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected"),
    ("no driver library", "CUDA driver library not usable: RuntimeError: libcuda.so.1: cannot open shared object"),
])
def test_cuda_driver_unavailable_is_clean(monkeypatch, cause, message):
    """Without cuda-python, without a device or without the driver library, both the driver and the arena raise
    ``DriverUnavailable`` (a ``DriverError``, so one ``except`` covers it) naming the cause, and nothing else."""
    import sys

    from oarlock.memory.vmm import VmmArena

    if cause == "no cuda-python":
        monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # the import fails as if not installed
    else:
        _stand_in_bindings(monkeypatch, _no_device if cause == "no device" else _no_library)
    for make in (lambda: CudaDriver(0), lambda: VmmArena(0)):
        with pytest.raises(DriverUnavailable) as info:
            make()
        assert message in str(info.value) and isinstance(info.value, DriverError), str(info.value)


def test_cuda_driver_unavailable_on_this_machine_is_clean():
    """The real driver on a machine without a usable GPU (the CPU test machines): ``DriverUnavailable``, never
    another exception; on a GPU machine the driver opens and reports a granularity."""
    import torch

    try:
        drv = CudaDriver(0)
    except DriverUnavailable as e:
        assert not torch.cuda.is_available(), f"CUDA is available to torch but the driver refused: {e}"
        assert str(e), "the refusal names no cause"
    else:
        assert torch.cuda.is_available() and drv.granularity() > 0


@pytest.mark.cuda
def test_real_remap_works():
    drv = _cuda_driver()  # skips on machines without a GPU driver
    import torch

    m = RemapAllocator(drv, large_page=drv.granularity(), before_unmap=torch.cuda.synchronize)
    a, b, c = (m.malloc(2 * drv.granularity()) for _ in range(3))
    class Raw:  # exposes block b as CUDA bytes
        pass

    hb = Raw()
    hb.__cuda_array_interface__ = {"shape": (b.size,), "typestr": "|u1", "data": (b.addr, False), "version": 3,
                                   "strides": None}
    tb = torch.as_tensor(hb, device="cuda")
    tb.fill_(7)
    m.free(a)
    m.free(c)
    x = m.malloc(4 * drv.granularity())
    assert drv.calls["unmap"] == 2 and int(tb.sum()) == 7 * b.size
    del tb
    m.free(b)
    m.free(x)
    m.empty_cache()


@pytest.mark.cuda
def test_vmm_arena_tensors_on_gpu():
    _cuda_driver()
    import torch

    from oarlock.memory.vmm import VmmArena

    arena = VmmArena(0)
    t = arena.empty((1024, 1024), torch.bfloat16)
    t.fill_(1.5)
    u = arena.empty(10, torch.float32)
    assert t.is_cuda and t.dtype == torch.bfloat16 and float(t.float().sum()) == 1.5 * 1024 * 1024
    assert arena.stats()["allocated"] >= t.numel() * 2 + 40
    del t, u
    import gc

    gc.collect()
    assert arena.stats()["allocated"] == 0
