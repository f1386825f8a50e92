"""Replaying traces through allocator models, and the fragmentation metrics (``docs/memory-debug.md`` section 3).

* ``fragmentation = 1 - peak_allocated / peak_reserved`` (GMLake's definition; Paddle's guide uses
  ``max_reserved - max_allocated``), where allocated counts the trace's bytes and reserved the model's
  physical bytes (live segments or mapped pages).
* steady-state fragmentation: the same ratio with both peaks taken from the second training step on
  (trace mark ``"step1"``), so warm-up growth does not count.
* minimum feasible capacity: the smallest capacity (a multiple of 2 MiB) at which the trace replays without
  OOM, by binary search between the peak allocated bytes and the unconstrained peak reserved bytes.
* external fragmentation at the peak of allocated bytes: ``1 - largest_free / total_free`` over the free
  (mapped) blocks, and Paddle's composite "Frag Ratio" ``1 - (max_free/free_bytes)*(used_blocks/blocks)``.
* driver calls: cudaMalloc/cudaFree, or reserve/create/map/set_access/unmap/release/free_va.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from oarlock.memory.allocators import DEFAULT_ALLOCATORS, driver_calls, make_allocator
from oarlock.memory.errors import MemoryToolError, SimulatedOOM
from oarlock.memory.trace import Op, Trace

MiB = 1 << 20


@dataclass
class ReplayResult:
    """Outcome of one replay. Bytes are bytes; ``failed_at`` is the index of the op that hit OOM."""

    allocator: str
    capacity: int | None
    ok: bool
    failed_at: int | None
    peak_allocated: int
    peak_reserved: int
    final_reserved: int
    fragmentation: float
    external_frag_at_peak: float
    frag_ratio_at_peak: float
    driver_calls: int
    steady_fragmentation: float | None = None
    calls: dict = field(default_factory=dict)
    counters: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def _steady_start(trace: Trace | list[Op], ops: list[Op]) -> int | None:
    """Index of the first op at or after the trace's ``"step1"`` mark (None without one)."""
    ev = trace.marks.get("step1") if isinstance(trace, Trace) else None
    if ev is None:
        return None
    return next((k for k, op in enumerate(ops) if op.event >= ev), None)


def _ops(trace: Trace | list[Op]) -> list[Op]:
    return trace.ops() if isinstance(trace, Trace) else list(trace)


def _peak_index(ops: list[Op]) -> int:
    cur = best = 0
    at = -1
    for k, op in enumerate(ops):
        cur += op.size if op.kind == "a" else -op.size
        if cur > best:
            best, at = cur, k
    return at


def external_fragmentation(model: Any) -> tuple[float, float]:
    """``(1 - max_free/total_free, Paddle Frag Ratio)`` of a model's current state (0 when nothing is
    free)."""
    free = model.free_block_sizes()
    total = sum(free)
    if not total:
        return 0.0, 0.0
    ext = 1 - max(free) / total
    blocks = model.blocks()
    used = sum(1 for b in blocks if b[2] == "active")
    ratio = 1 - (max(free) / total) * (used / len(blocks)) if blocks else ext
    return ext, ratio


def replay(trace: Trace | list[Op], allocator: str | Any = "caching", capacity: int | None = None,
           check: bool = False, on_step: Any = None, steady_from: int | None = None,
           **knobs: Any) -> ReplayResult:
    """Replay ``trace`` through an allocator model (a name from
    :data:`oarlock.memory.allocators.ALLOCATORS` or an instance).

    Args:
        capacity: physical byte limit when ``allocator`` is a name.
        check: run the model's invariant checks after every op (slow; tests).
        on_step: ``fn(op_index, op, model, live)`` called after every op (``live`` maps op ids to blocks).
        steady_from: first op of the steady-state window (default: the trace's ``"step1"`` mark).
    Returns:
        a :class:`ReplayResult`; a replay that hits OOM stops there with ``ok=False``.
    """
    ops = _ops(trace)
    model = make_allocator(allocator, capacity, **knobs) if isinstance(allocator, str) else allocator
    peak_at = _peak_index(ops)
    steady_at = steady_from if steady_from is not None else _steady_start(trace, ops)
    steady_alloc = steady_res = 0
    live: dict[int, Any] = {}
    alloc = peak_alloc = peak_res = 0
    ext = ratio = 0.0
    failed = None
    for k, op in enumerate(ops):
        if op.kind == "a":
            try:
                live[op.id] = model.malloc(op.size, op.stream, op.category)
            except SimulatedOOM:
                failed = k
                ext, ratio = external_fragmentation(model)
                break
            alloc += op.size
        else:
            model.free(live.pop(op.id))
            alloc -= op.size
        res = model.reserved
        if res > peak_res:
            peak_res = res
        if alloc > peak_alloc:
            peak_alloc = alloc
        if steady_at is not None and k >= steady_at:
            steady_alloc, steady_res = max(steady_alloc, alloc), max(steady_res, res)
        if k == peak_at:
            ext, ratio = external_fragmentation(model)
        if check:
            model.check()
        if on_step is not None:
            on_step(k, op, model, live)
    frag = 1 - peak_alloc / peak_res if peak_res else 0.0
    steady = 1 - steady_alloc / steady_res if steady_res and failed is None else None
    return ReplayResult(getattr(model, "name", type(model).__name__), getattr(model, "capacity", capacity),
                        failed is None, failed, peak_alloc, peak_res, model.reserved, frag, ext, ratio,
                        driver_calls(model.calls), steady, dict(model.calls), dict(model.counters))


def min_feasible_capacity(trace: Trace | list[Op], allocator: str, step: int = 2 * MiB,
                          hi: int | None = None, **knobs: Any) -> int:
    """Smallest capacity (a multiple of ``step`` bytes) at which ``allocator`` replays ``trace`` without OOM.

    Binary search between the peak allocated bytes (infeasible below) and ``hi`` (default: the
    unconstrained peak reserved bytes, feasible by definition). Assumes feasibility is monotonic in the
    capacity, which holds for these policies up to rare ties.
    """
    ops = _ops(trace)
    free_run = replay(ops, allocator, None, **knobs)
    hi = hi if hi is not None else -(-free_run.peak_reserved // step) * step
    lo = max(0, free_run.peak_allocated // step * step - step)  # infeasible (below the live bytes)
    if hi <= lo:
        return hi
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            mid = lo + step
        if replay(ops, allocator, mid, **knobs).ok:
            hi = mid
        else:
            lo = mid
    return hi


def compare_allocators(trace: Trace | list[Op], allocators: Iterable[str] = DEFAULT_ALLOCATORS,
             capacity: int | None = None, min_capacity: bool = True, progress: bool = False) -> list[dict]:
    """One row per allocator: the :class:`ReplayResult` fields at ``capacity`` plus, with
    ``min_capacity``, ``min_capacity`` (bytes) and ``capacity_overhead`` (``min_capacity /
    peak_allocated - 1``)."""
    from oarlock.utils import progress as bar

    ops = _ops(trace)
    steady = _steady_start(trace, ops)
    names = list(allocators)
    for n in names:
        make_allocator(n)  # fail early on an unknown name
    rows = []
    for name in bar(names, desc="allocators", disable=None if progress else True):
        r = replay(ops, name, capacity, steady_from=steady).to_json()
        if min_capacity:
            mc = min_feasible_capacity(ops, name)
            r["min_capacity"] = mc
            r["capacity_overhead"] = mc / r["peak_allocated"] - 1 if r["peak_allocated"] else 0.0
        rows.append(r)
    return rows


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def format_table(rows: list[dict]) -> str:
    """The metrics table printed by ``oarlock memory simulate``."""
    if not rows:
        raise MemoryToolError("no allocator rows to format")
    has_mc = "min_capacity" in rows[0]
    has_steady = any(r.get("steady_fragmentation") is not None for r in rows)
    head = ["allocator", "ok", "peak alloc", "peak reserved", "frag %"] + (["steady %"] if has_steady else []) + \
        ["ext frag %", "driver calls"]
    if has_mc:
        head += ["min capacity", "overhead %"]
    lines = [head]
    for r in rows:
        line = [r["allocator"], "yes" if r["ok"] else f"OOM@{r['failed_at']}", fmt_bytes(r["peak_allocated"]),
                fmt_bytes(r["peak_reserved"]), f"{100 * r['fragmentation']:.2f}"]
        if has_steady:
            st = r.get("steady_fragmentation")
            line.append("-" if st is None else f"{100 * st:.2f}")
        line += [f"{100 * r['external_frag_at_peak']:.1f}", str(r["driver_calls"])]
        if has_mc:
            line += [fmt_bytes(r["min_capacity"]), f"{100 * r['capacity_overhead']:.2f}"]
        lines.append(line)
    w = [max(len(l[i]) for l in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(l))
                     for l in lines)
