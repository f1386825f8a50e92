"""oarlock.memory: allocator simulator, pointer-stable VMM remap allocator, and memory observer.

Public names: traces (:class:`Trace`, :func:`load_trace`, :func:`synthesize_moe`, ``trace_from_*``), allocator
models (:data:`ALLOCATORS`, :func:`make_allocator`, ...), the VMM allocator (:class:`RemapAllocator`,
:class:`VmmArena`, :class:`PagedHeap`), drivers, the simulator (:func:`replay`, :func:`compare_allocators`,
:func:`min_feasible_capacity`) and the observer (:func:`trace_region`, :func:`memory_summary`,
:func:`render_memory_html`, :func:`render_png`). Background and formats: ``docs/memory-debug.md``.
Submodules import lazily (on first use of a name) so ``import oarlock.memory`` stays cheap; ``dir()`` and
``help()`` still list every public name.
"""

from __future__ import annotations

from oarlock.lazy import lazy_exports
from oarlock.memory.errors import (DriverError, DriverUnavailable, MemoryToolError, SimulatedOOM,
                                   TraceFormatError, UnsafeTraceError)

_LAZY = {
    "Trace": "trace", "MoEConfig": "trace", "load_trace": "trace", "synthesize_moe": "trace",
    "trace_from_snapshot": "trace", "trace_from_profiler": "trace", "trace_from_chrome": "trace",
    "trace_from_ops": "trace",
    "ALLOCATORS": "allocators", "make_allocator": "allocators", "TorchCaching": "allocators",
    "TorchExpandable": "allocators", "PaddleVmm": "allocators", "GMLakeStitch": "allocators",
    "Oracle": "allocators",
    "RemapAllocator": "vmm", "VmmArena": "vmm", "PagedHeap": "vmm",
    "CountingDriver": "driver", "FakeDriver": "driver", "CudaDriver": "driver",
    "replay": "simulate", "compare_allocators": "simulate", "min_feasible_capacity": "simulate", "ReplayResult": "simulate",
    "format_table": "simulate",
    "trace_region": "observe", "memory_summary": "observe", "render_memory_html": "observe", "render_png": "observe",
    "render_html": "observe",  # the former name of render_memory_html, kept for compatibility
}

__all__ = sorted([*(n for n in _LAZY if n != "render_html"), "MemoryToolError", "TraceFormatError",
                  "UnsafeTraceError", "SimulatedOOM", "DriverError", "DriverUnavailable"])

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
