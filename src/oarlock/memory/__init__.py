"""oarlock.memory: allocator simulator, pointer-stable VMM remap allocator, and memory observer.

Design: ``/work/shared/design/memory_debug.md`` sections 1-3.1 (Paddle 3.3's VMM allocator, PyTorch's
caching allocator and expandable segments, GMLake). Submodules import lazily so ``import oarlock.memory``
stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

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
    "trace_region": "observe", "memory_summary": "observe", "render_html": "observe", "render_png": "observe",
}

__all__ = sorted([*_LAZY, "MemoryToolError", "TraceFormatError", "UnsafeTraceError", "SimulatedOOM",
                  "DriverError", "DriverUnavailable"])


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"oarlock.memory.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'oarlock.memory' has no attribute {name!r}")
