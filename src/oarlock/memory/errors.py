"""Errors of :mod:`oarlock.memory`. Every message names the file, event, argument or allocator at fault."""

from oarlock.errors import OarlockError


class MemoryToolError(OarlockError):
    """Base of every :mod:`oarlock.memory` error."""


class TraceFormatError(MemoryToolError):
    """A trace file or object is not a readable memory trace (snapshot pickle/JSON, profiler trace)."""


class UnsafeTraceError(TraceFormatError):
    """A snapshot pickle references a class outside plain containers (unpickling it could run code)."""


class SimulatedOOM(MemoryToolError):
    """An allocator model (or the VMM pool) cannot serve a request within its capacity.

    Attributes: ``size`` (bytes requested), ``capacity`` (bytes, or None), ``reserved`` (bytes at failure).
    """

    def __init__(self, message: str, size: int = 0, capacity: int | None = None, reserved: int = 0):
        super().__init__(message)
        self.size, self.capacity, self.reserved = size, capacity, reserved


class DriverError(MemoryToolError):
    """A (fake or CUDA) virtual-memory driver call failed or was used against its contract."""


class DriverUnavailable(DriverError):
    """The CUDA driver cannot be used here: no cuda-python, no driver library, or no device."""
