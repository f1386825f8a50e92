"""Memory traces in PyTorch's snapshot format: loaders, writer, replay ops and a synthetic MoE generator.

One event is a dict shaped like an entry of ``torch.cuda.memory._snapshot()["device_traces"][device]``:
``{"action", "addr", "size", "stream", "frames", ...}`` with ``action`` one of ``alloc``,
``free_requested``, ``free_completed`` (others such as ``segment_alloc`` or ``oom`` are kept but not
replayed), ``size`` in bytes, ``addr`` an integer address, ``frames`` a list of
``{"filename", "line", "name"}``. Synthetic and profiler traces add ``category`` (parameter, gradient,
optimizer, activation, temporary, ...). Sources (format: ``docs/memory-debug.md`` section 1):

* ``torch.cuda.memory._dump_snapshot(path)`` pickles (read with a restricted unpickler: plain data only);
* the same snapshot as JSON;
* CPU traces from ``torch.profiler.profile(profile_memory=True)``: live via :func:`trace_from_profiler`, or
  its ``export_chrome_trace`` JSON (``[memory]`` instant events);
* :func:`synthesize_moe`, a seeded MoE training-step generator.
"""

from __future__ import annotations

import json
import math
import pickle
import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, NamedTuple

from oarlock.memory.errors import TraceFormatError, UnsafeTraceError
from oarlock.utils import AllowlistUnpickler, load_allowlisted

MiB = 1 << 20
GiB = 1 << 30
REPLAYED = ("alloc", "free_requested", "free_completed")
_FRAME_RE = re.compile(r"^(?P<file>.*)\((?P<line>\d+)\): (?P<name>.*)$")


class Op(NamedTuple):
    """One replay step: ``kind`` is ``"a"`` (malloc) or ``"f"`` (free); ``id`` pairs a free with its
    malloc; ``size`` in bytes (the trace's size); ``event`` is the index of the source event."""

    kind: str
    id: int
    size: int
    stream: int
    category: str | None
    event: int


@dataclass
class Trace:
    """The allocation events of one device, in snapshot format (see the module docstring).

    Attributes:
        events: the ``device_traces`` entries, in time order.
        device: the device index they came from (-1 for CPU traces).
        source: where the trace came from (file name, ``"profiler"``, ``"synthetic moe"``...).
        segments: the snapshot's ``segments`` list, when the source had one (real CUDA snapshots).
        marks: named event indices (``"step1"``: where the second training step starts), used for
            steady-state metrics; stored in the snapshot under ``"oarlock_marks"`` (a host trace, device -1,
            is flagged by ``"oarlock_host": true``).
    """

    events: list[dict]
    device: int = 0
    source: str = ""
    segments: list[dict] = field(default_factory=list)
    marks: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.events)

    def __repr__(self) -> str:  # the events can number millions: summarise instead of listing them
        n_alloc = sum(1 for e in self.events if e.get("action") == "alloc")
        return (f"Trace(source={self.source[:60]!r}, device={self.device}, events={len(self.events)}, "
                f"allocs={n_alloc}, peak_allocated={self.peak_allocated}, marks={len(self.marks)})")

    def to_snapshot(self) -> dict:
        """A ``{"segments", "device_traces"}`` dict that ``torch.cuda._memory_viz`` can read."""
        n = max(self.device, 0) + 1
        traces: list[list[dict]] = [[] for _ in range(n)]
        traces[max(self.device, 0)] = self.events
        snap = {"segments": self.segments, "device_traces": traces}
        if self.marks:
            snap["oarlock_marks"] = dict(self.marks)
        if self.device < 0:  # a host (CPU profiler) trace: its addresses are not a device layout
            snap["oarlock_host"] = True
        return snap

    def save(self, path: str | Path) -> Path:
        """Write the trace as a snapshot pickle (``.pickle``/``.pkl``) or JSON (``.json``)."""
        path = Path(path)
        snap = self.to_snapshot()
        if path.suffix == ".json":
            path.write_text(json.dumps(snap))
        else:
            with open(path, "wb") as f:
                pickle.dump(snap, f, protocol=4)
        return path

    def ops(self) -> list[Op]:
        """The malloc/free sequence to replay.

        Frees use ``free_completed`` when the trace has any (the moment the caching allocator may reuse the
        block), else ``free_requested``. A free of an address with no live allocation (allocated before
        recording started) is dropped, as are allocations still live at the end (they just stay live).
        """
        free_action = "free_completed" if any(e.get("action") == "free_completed" for e in self.events) \
            else "free_requested"
        live: dict[int, tuple[int, int]] = {}
        out: list[Op] = []
        next_id = 0
        for i, e in enumerate(self.events):
            act = e.get("action")
            if act == "alloc":
                addr = int(e["addr"])
                if addr in live:  # a second alloc at a live address: the free was not recorded
                    old, size = live.pop(addr)
                    out.append(Op("f", old, size, int(e.get("stream", 0)), None, i))
                size = int(e["size"])
                live[addr] = (next_id, size)
                out.append(Op("a", next_id, size, int(e.get("stream", 0)), e.get("category"), i))
                next_id += 1
            elif act == free_action:
                got = live.pop(int(e["addr"]), None)
                if got is not None:
                    out.append(Op("f", got[0], got[1], int(e.get("stream", 0)), None, i))
        return out

    def live_bytes(self) -> list[int]:
        """Live (allocated) bytes after each replay op of :meth:`ops`."""
        cur, out = 0, []
        for op in self.ops():
            cur += op.size if op.kind == "a" else -op.size
            out.append(cur)
        return out

    @property
    def peak_allocated(self) -> int:
        """Largest number of live bytes at any moment (the theoretical floor of any allocator)."""
        return max(self.live_bytes(), default=0)

    def peak_blocks(self) -> list[dict]:
        """The allocations live at the first moment of peak live bytes: ``alloc`` events (dicts with
        addr, size, frames, category), sorted by address."""
        ops = self.ops()
        cur = best = 0
        best_at = -1
        for k, op in enumerate(ops):
            cur += op.size if op.kind == "a" else -op.size
            if cur > best:
                best, best_at = cur, k
        live: dict[int, int] = {}
        for op in ops[:best_at + 1]:
            if op.kind == "a":
                live[op.id] = op.event
            else:
                live.pop(op.id, None)
        return sorted((self.events[i] for i in live.values()), key=lambda e: int(e["addr"]))


def parse_frame(frame: dict) -> tuple[str, int, str]:
    """``(filename, line, name)`` of a snapshot frame. Profiler-made frames carry ``filename="none"`` and
    the location inside ``name`` (``"path.py(12): forward"``); those are split out."""
    fn, line, name = str(frame.get("filename", "")), int(frame.get("line", 0) or 0), str(frame.get("name", ""))
    if fn in ("none", "") and (m := _FRAME_RE.match(name)):
        return m.group("file"), int(m.group("line")), m.group("name")
    return fn, line, name


# ---------------------------------------------------------------------------------------------- loaders

def _refuse(msg: str) -> Exception:
    return UnsafeTraceError(msg)


def _admit_plain(module: str, name: str) -> Any:
    import collections

    if module == "collections" and name == "OrderedDict":
        return collections.OrderedDict
    return None


def _check_events(events: Any, where: str) -> list[dict]:
    if not isinstance(events, list):
        raise TraceFormatError(f"{where}: device trace is {type(events).__name__}, expected a list of events")
    for i, e in enumerate(events):
        if not isinstance(e, dict) or "action" not in e:
            raise TraceFormatError(f"{where}: event {i} is not a dict with an 'action' key")
        if e["action"] in REPLAYED:
            for k in ("addr", "size"):
                if not isinstance(e.get(k), int) or e[k] < 0:
                    raise TraceFormatError(f"{where}: event {i} ({e['action']}) has bad {k!r}: {e.get(k)!r}")
    return events


def trace_from_snapshot(snap: Any, device: int | None = None, source: str = "<snapshot>") -> Trace:
    """A :class:`Trace` from a snapshot dict (``torch.cuda.memory._snapshot()`` shape).

    Args:
        device: which ``device_traces`` entry; None takes the first non-empty one.
    Raises:
        TraceFormatError: naming ``source`` when the dict lacks ``device_traces`` or an event is malformed.
    """
    if not isinstance(snap, dict) or "device_traces" not in snap:
        keys = list(snap)[:5] if isinstance(snap, dict) else type(snap).__name__
        raise TraceFormatError(f"{source}: not a memory snapshot (no 'device_traces'; found {keys})")
    traces = snap["device_traces"]
    if not isinstance(traces, list):
        raise TraceFormatError(f"{source}: 'device_traces' is {type(traces).__name__}, expected a list")
    if device is None:
        device = next((i for i, t in enumerate(traces) if t), 0)
    if not 0 <= device < max(len(traces), 1):
        raise TraceFormatError(f"{source}: device {device} not in the snapshot ({len(traces)} devices)")
    events = _check_events(traces[device] if traces else [], f"{source} device {device}")
    segs = snap.get("segments", [])
    if not isinstance(segs, list):
        raise TraceFormatError(f"{source}: 'segments' is {type(segs).__name__}, expected a list")
    segs = [s for s in segs if isinstance(s, dict) and s.get("device", device) == device]
    if not events and not segs:
        raise TraceFormatError(f"{source}: an empty memory snapshot (no allocation events and no segments for "
                               f"device {device}): record with torch.cuda.memory._record_memory_history() first")
    marks = snap.get("oarlock_marks", {})
    if not isinstance(marks, dict) or not all(isinstance(v, int) for v in marks.values()):
        raise TraceFormatError(f"{source}: 'oarlock_marks' must map names to event indices")
    return Trace(list(events), -1 if snap.get("oarlock_host") is True else device, source, segs, dict(marks))


def trace_from_chrome(data: dict, source: str = "<chrome trace>", device_type: int | None = None) -> Trace:
    """A :class:`Trace` from a ``torch.profiler`` ``export_chrome_trace`` dict.

    Uses the ``[memory]`` instant events (``Addr``, ``Bytes`` > 0 for an allocation, < 0 for a free).
    They carry no stacks, so ``frames`` is empty. ``device_type`` (0 = CPU, 1 = CUDA) filters; None keeps
    the type of the first memory event.
    """
    events_in = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events_in, list):
        raise TraceFormatError(f"{source}: chrome trace's 'traceEvents' is not a list")
    mem = [e for e in events_in if isinstance(e, dict) and e.get("name") == "[memory]"
           and isinstance(e.get("args", {}), dict)]
    if not mem:
        raise TraceFormatError(f"{source}: chrome trace has no '[memory]' events (profile with "
                               "profile_memory=True)")
    if device_type is None:
        device_type = mem[0].get("args", {}).get("Device Type", 0)
    events = []
    dev = -1
    try:
        ordered = sorted(mem, key=lambda e: float(e.get("ts", 0)))
    except (TypeError, ValueError):
        raise TraceFormatError(f"{source}: a '[memory]' event has a non-numeric 'ts'") from None
    for e in ordered:
        a = e.get("args", {})
        if a.get("Device Type", 0) != device_type:
            continue
        try:
            dev = int(a.get("Device Id", -1))
            nbytes, addr = int(a.get("Bytes", 0)), int(a.get("Addr", 0))
        except (TypeError, ValueError, OverflowError):
            raise TraceFormatError(f"{source}: a '[memory]' event has non-integer 'Device Id', 'Bytes' or "
                                   "'Addr'") from None
        if nbytes == 0:
            continue
        action = "alloc" if nbytes > 0 else "free_completed"
        events.append({"action": action, "addr": addr, "size": abs(nbytes), "stream": 0, "frames": [],
                       "time_us": e.get("ts")})
    return Trace(events, dev, source)


def trace_from_profiler(prof: Any) -> Trace:
    """A :class:`Trace` from a finished ``torch.profiler.profile(profile_memory=True, with_stack=True)``.

    Uses ``torch.cuda._memory_viz._profile_to_snapshot``, which rebuilds snapshot events (with categories
    and Python frames) from the profiler's memory timeline; works on CPU-only builds.
    """
    from torch.cuda._memory_viz import _profile_to_snapshot

    try:
        memory_profile = prof._memory_profile()
        snap = _profile_to_snapshot(_ProfileView(memory_profile))
    except Exception as e:  # no memory events, or a profile without profile_memory
        raise TraceFormatError(f"profiler: cannot build a memory trace ({type(e).__name__}: {e}); profile "
                               "with profile_memory=True") from None
    tr = trace_from_snapshot(snap, source="profiler")
    _add_profiler_times(tr, memory_profile, len(snap["device_traces"]) - 1)
    tr.device = -1
    return tr


class _ProfileView:
    """Hands an already computed memory profile to ``_profile_to_snapshot`` (computing it costs seconds)."""

    def __init__(self, memory_profile: Any):
        self._mp = memory_profile

    def _memory_profile(self) -> Any:
        return self._mp


def _add_profiler_times(tr: Trace, memory_profile: Any, cpu_index: int) -> None:
    """Set ``time_us`` (Unix time, microseconds) on the events built from a profiler memory timeline.

    ``_profile_to_snapshot`` turns each timeline entry of a tensor into events in order: create -> one
    ``alloc``; destroy -> ``free_requested`` + ``free_completed``; version bump -> those two frees and an
    ``alloc``; pre-existing -> none. Replaying that rule gives each event its entry's time (ns)."""
    from torch.profiler._memory_profiler import Action, TensorKey

    per_event = {Action.CREATE: 1, Action.DESTROY: 2, Action.INCREMENT_VERSION: 3}
    times: list[int] = []
    for t, action, (key, _version), _size in memory_profile.timeline:
        if not isinstance(key, TensorKey) or action not in per_event:
            continue
        dev = key.device
        index = cpu_index if dev.type != "cuda" else dev.index
        if index == (tr.device if tr.device >= 0 else cpu_index):
            times.extend([t] * per_event[action])
    if len(times) == len(tr.events):  # otherwise torch changed its rule: leave the events untimed
        for e, t in zip(tr.events, times):
            e["time_us"] = t / 1000.0


def load_trace(path: str | Path, device: int | None = None) -> Trace:
    """Read a trace file: a ``_dump_snapshot`` pickle, a snapshot as JSON, or a profiler chrome trace JSON.

    Pickles go through a restricted unpickler that admits only plain data (dict, list, str, numbers), so a
    hostile file cannot run code.

    Raises:
        FileNotFoundError: the file is missing.
        TraceFormatError: naming the file when it is none of the above or malformed;
            :class:`UnsafeTraceError` when a pickle names a class.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file or directory")
    raw = path.read_bytes()
    if raw.lstrip()[:1] in (b"{", b"["):
        try:
            data = json.loads(raw)
        except ValueError as e:  # UnicodeDecodeError included
            raise TraceFormatError(f"{path}: invalid JSON ({e})") from None
        except RecursionError:
            raise TraceFormatError(f"{path}: JSON nested too deeply, not a memory trace") from None
        if isinstance(data, dict) and "traceEvents" in data:
            return trace_from_chrome(data, str(path))
        return trace_from_snapshot(data, device, str(path))
    snap = load_allowlisted(path, lambda f, source: AllowlistUnpickler(f, _admit_plain, _refuse, source),
                            UnsafeTraceError, TraceFormatError, data=raw, what="snapshot pickle or JSON trace")
    return trace_from_snapshot(snap, device, str(path))


def trace_from_ops(ops: Iterable[tuple], source: str = "hand-made") -> Trace:
    """A trace from ``("a", id, size[, category])`` / ``("f", id)`` tuples (tests and examples).

    Addresses are assigned by a first-fit bump heap so that no two live allocations overlap.
    """
    events, live, heap = [], {}, _FirstFitHeap()
    for t in ops:
        if t[0] == "a":
            _, i, size, *rest = t
            addr = heap.malloc(size)
            live[i] = (addr, size)
            ev = {"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": []}
            if rest:
                ev["category"] = rest[0]
            events.append(ev)
        elif t[0] == "f":
            addr, size = live.pop(t[1])
            heap.free(addr, size)
            for act in ("free_requested", "free_completed"):
                events.append({"action": act, "addr": addr, "size": size, "stream": 0, "frames": []})
        else:
            raise TraceFormatError(f"{source}: op {t!r} is neither ('a', id, size) nor ('f', id)")
    return Trace(events, 0, source)


class _FirstFitHeap:
    """Addresses for synthetic traces: first fit over one coalescing heap, 512 B granules."""

    BASE = 0x7F0000000000

    def __init__(self) -> None:
        self.free_list: list[list[int]] = []  # [addr, size], address order
        self.top = self.BASE

    def malloc(self, size: int) -> int:
        size = max(512, -(-size // 512) * 512)
        for k, (a, s) in enumerate(self.free_list):
            if s >= size:
                if s == size:
                    del self.free_list[k]
                else:
                    self.free_list[k] = [a + size, s - size]
                return a
        a, self.top = self.top, self.top + size
        return a

    def free(self, addr: int, size: int) -> None:
        size = max(512, -(-size // 512) * 512)
        import bisect

        k = bisect.bisect(self.free_list, [addr, size])
        self.free_list.insert(k, [addr, size])
        if k + 1 < len(self.free_list) and addr + size == self.free_list[k + 1][0]:
            self.free_list[k][1] += self.free_list.pop(k + 1)[1]
        if k > 0 and self.free_list[k - 1][0] + self.free_list[k - 1][1] == addr:
            self.free_list[k - 1][1] += self.free_list.pop(k)[1]
            k -= 1
        a, s = self.free_list[k]
        if a + s == self.top:  # give the tail back so the heap stays compact
            self.top = a
            del self.free_list[k]


# ---------------------------------------------------------------------------------------------- MoE synthesis

@dataclass
class MoEConfig:
    """Shape of a synthetic MoE training run on one rank (expert-parallel).

    Sizes are in elements unless named ``*_bytes``. ``imbalance`` is the standard deviation of the
    log-popularity of experts (0 = perfectly balanced routing); each layer has a persistent skew plus fresh
    noise of the same scale per step and micro-batch. ``pipeline_stages`` > 1 runs a 1F1B schedule as the
    first stage (which keeps ``min(stages, micro_batches)`` micro-batches of activations live).
    ``capacity_factor`` None is dropless routing. ``zero_shards`` divides the fp32 optimizer state.
    """

    layers: int = 8
    hidden: int = 2048
    ffn: int = 1408
    heads: int = 16
    experts: int = 64
    local_experts: int = 8
    topk: int = 8
    tokens: int = 4096
    micro_batches: int = 2
    steps: int = 3
    pipeline_stages: int = 1
    recompute: bool = False
    imbalance: float = 0.35
    capacity_factor: float | None = None
    vocab: int = 16384
    act_bytes: int = 2
    zero_shards: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        for k in ("layers", "hidden", "ffn", "heads", "experts", "local_experts", "topk", "tokens",
                  "micro_batches", "steps", "pipeline_stages", "act_bytes", "zero_shards"):
            if not isinstance(getattr(self, k), int) or getattr(self, k) < 1:
                raise TraceFormatError(f"MoEConfig.{k} must be a positive int, got {getattr(self, k)!r}")
        if self.experts % self.local_experts or self.topk > self.experts:
            raise TraceFormatError(f"MoEConfig: experts={self.experts} must be a multiple of local_experts="
                                   f"{self.local_experts} and >= topk={self.topk}")
        if self.imbalance < 0:
            raise TraceFormatError(f"MoEConfig.imbalance must be >= 0, got {self.imbalance}")


class _Emitter:
    def __init__(self) -> None:
        self.events: list[dict] = []
        self.heap = _FirstFitHeap()
        self.live: dict[int, tuple[int, int, list]] = {}
        self.next = 0

    def alloc(self, size: int, category: str, where: str) -> int:
        size = max(int(size), 1)
        addr = self.heap.malloc(size)
        frames = [{"filename": f"oarlock/synthetic/{where.split('.')[0]}.py", "line": 0, "name": where}]
        self.events.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": frames,
                            "category": category})
        h = self.next
        self.next += 1
        self.live[h] = (addr, size, frames)
        return h

    def free(self, h: int) -> None:
        addr, size, frames = self.live.pop(h)
        self.heap.free(addr, size)
        for act in ("free_requested", "free_completed"):
            self.events.append({"action": act, "addr": addr, "size": size, "stream": 0, "frames": frames})


def _schedule(cfg: MoEConfig) -> list[tuple[str, int]]:
    """(phase, micro-batch) order of one step on the first pipeline stage: 1F1B (warm-up of
    ``stages - 1`` forwards), which is plain gradient accumulation when ``stages == 1``."""
    m = cfg.micro_batches
    warm = min(cfg.pipeline_stages - 1, m)
    order = [("F", i) for i in range(warm)]
    f = warm
    for b in range(m):
        if f < m:
            order.append(("F", f))
            f += 1
        order.append(("B", b))
    return order


def synthesize_moe(cfg: MoEConfig | None = None, **overrides: Any) -> Trace:
    """A seeded synthetic MoE training trace (parameters, grads, optimizer state, per-layer dense and
    expert activations with routing-dependent sizes, recompute, 1F1B, optimizer temporaries).

    Sizes of the expert buffers follow ``N = tokens * topk * (share of this rank's experts)`` per layer,
    micro-batch and step, where expert popularity is ``exp(imbalance * z)`` normalised (z ~ N(0, 1):
    persistent per layer plus fresh noise). Events carry ``category`` and a synthetic frame
    ``layer{l}.{tensor}`` so the observer can show them. Same config and seed give the same trace.

    Returns:
        a :class:`Trace` with device 0 and ``source="synthetic moe ..."``.
    """
    cfg = MoEConfig(**{**(asdict(cfg) if cfg else {}), **overrides})
    rng = random.Random(cfg.seed)
    em = _Emitter()
    H, F, T, E, L, b = cfg.hidden, cfg.ffn, cfg.tokens, cfg.experts, cfg.layers, cfg.act_bytes
    ep = E // cfg.local_experts
    skew = [[rng.gauss(0, 1) for _ in range(E)] for _ in range(L)]

    def routed_tokens() -> list[int]:
        # Tokens this rank's experts receive from all ep ranks, for every (layer) of one micro-batch.
        out = []
        for l in range(L):
            w = [math.exp(cfg.imbalance * (skew[l][e] + rng.gauss(0, 1))) for e in range(E)]
            share = sum(w[:cfg.local_experts]) / sum(w)
            n = T * cfg.topk * ep * share
            if cfg.capacity_factor is not None:
                n = min(n, cfg.capacity_factor * T * cfg.topk)
            out.append(max(1, int(n)))
        return out

    attn_params = 4 * H * H + 2 * H
    expert_params = cfg.local_experts * 3 * H * F + H * E
    layer_params = attn_params + expert_params
    params = [em.alloc(b * H * cfg.vocab, "parameter", "embed.weight")]
    params += [em.alloc(b * attn_params, "parameter", f"layer{l}.attn.weight") for l in range(L)]
    params += [em.alloc(b * expert_params, "parameter", f"layer{l}.experts.weight") for l in range(L)]
    grads: list[int] = []
    opt_state: list[int] = []

    def layer_forward(l: int, n: int, saved: dict, keep: bool) -> None:
        """Allocate layer l's activations into ``saved`` (temporaries are freed at once). With
        ``keep=False`` (recompute's first pass) nothing but the output survives."""
        s: dict[str, int] = {}
        s["ln1"] = em.alloc(b * T * H, "activation", f"layer{l}.ln1")
        s["qkv"] = em.alloc(b * T * 3 * H, "activation", f"layer{l}.qkv")
        s["lse"] = em.alloc(4 * cfg.heads * T, "activation", f"layer{l}.attn.lse")
        s["attn"] = em.alloc(b * T * H, "activation", f"layer{l}.attn")
        tmp = em.alloc(b * T * H, "temporary", f"layer{l}.o_proj")
        s["h1"] = em.alloc(b * T * H, "activation", f"layer{l}.residual")
        em.free(tmp)
        s["ln2"] = em.alloc(b * T * H, "activation", f"layer{l}.ln2")
        logits = em.alloc(4 * T * E, "temporary", f"layer{l}.router.logits")
        s["probs"] = em.alloc(4 * T * cfg.topk, "activation", f"layer{l}.router.probs")
        s["idx"] = em.alloc(8 * T * cfg.topk, "activation", f"layer{l}.router.indices")
        em.free(logits)
        recv = em.alloc(b * n * H, "temporary", f"layer{l}.dispatch.recv")
        s["perm"] = em.alloc(b * n * H, "activation", f"layer{l}.experts.permuted")
        em.free(recv)
        s["fc1"] = em.alloc(b * n * 2 * F, "activation", f"layer{l}.experts.fc1")
        s["act"] = em.alloc(b * n * F, "activation", f"layer{l}.experts.swiglu")
        fc2 = em.alloc(b * n * H, "temporary", f"layer{l}.experts.fc2")
        back = em.alloc(b * n * H, "temporary", f"layer{l}.combine.recv")
        em.free(fc2)
        out = em.alloc(b * T * H, "activation", f"layer{l}.output")
        em.free(back)
        if keep:
            saved.update(s)
        else:
            for h in s.values():
                em.free(h)
        saved["out"] = out

    def layer_backward(l: int, n: int, saved: dict, grad_out: int) -> int:
        g_comb = em.alloc(b * n * H, "temporary", f"layer{l}.combine.grad")
        g_act = em.alloc(b * n * F, "temporary", f"layer{l}.experts.swiglu.grad")
        em.free(g_comb)
        g_fc1 = em.alloc(b * n * 2 * F, "temporary", f"layer{l}.experts.fc1.grad")
        em.free(g_act)
        for k in ("act", "fc1"):
            em.free(saved.pop(k))
        g_perm = em.alloc(b * n * H, "temporary", f"layer{l}.experts.permuted.grad")
        em.free(g_fc1)
        em.free(saved.pop("perm"))
        g_send = em.alloc(b * n * H, "temporary", f"layer{l}.dispatch.grad")
        em.free(g_perm)
        g_ln2 = em.alloc(b * T * H, "temporary", f"layer{l}.ln2.grad")
        em.free(g_send)
        for k in ("ln2", "probs", "idx"):
            em.free(saved.pop(k))
        g_h1 = em.alloc(b * T * H, "temporary", f"layer{l}.residual.grad")
        em.free(g_ln2)
        em.free(saved.pop("h1"))
        g_qkv = em.alloc(b * T * 3 * H, "temporary", f"layer{l}.qkv.grad")
        for k in ("attn", "lse", "qkv"):
            em.free(saved.pop(k))
        g_in = em.alloc(b * T * H, "activation", f"layer{l}.input.grad")
        em.free(g_qkv)
        em.free(g_h1)
        em.free(saved.pop("ln1"))
        em.free(grad_out)
        return g_in

    marks: dict[str, int] = {}
    for step in range(cfg.steps):
        if step:
            marks[f"step{step}"] = len(em.events)
        routing = {mb: routed_tokens() for mb in range(cfg.micro_batches)}
        acts: dict[int, list[dict]] = {}
        inputs: dict[int, int] = {}
        for phase, mb in _schedule(cfg):
            ns = routing[mb]
            if phase == "F":
                inputs[mb] = em.alloc(b * T * H, "activation", "embed.output")
                x, per_layer = inputs[mb], []
                for l in range(L):
                    saved: dict[str, int] = {"in": x}
                    layer_forward(l, ns[l], saved, keep=not cfg.recompute)
                    per_layer.append(saved)
                    x = saved["out"]
                acts[mb] = per_layer
                continue
            per_layer = acts.pop(mb)
            if not grads:
                grads[:] = [em.alloc(b * layer_params, "gradient", f"layer{l}.grad") for l in range(L)]
            logits = em.alloc(4 * T * cfg.vocab, "temporary", "lm_head.logits")
            grad = em.alloc(b * T * H, "activation", "lm_head.grad")
            em.free(logits)
            em.free(per_layer[-1]["out"])
            for l in reversed(range(L)):
                saved = per_layer[l]
                if cfg.recompute:
                    redo: dict[str, int] = {}
                    layer_forward(l, ns[l], redo, keep=True)
                    em.free(redo.pop("out"))
                    saved.update(redo)
                grad = layer_backward(l, ns[l], saved, grad)
                if l > 0:  # this layer's input (the previous layer's output) is dead after its backward
                    em.free(per_layer[l - 1].pop("out"))
            em.free(grad)
            em.free(inputs.pop(mb))
        # optimizer: fp32 master + two Adam moments (ZeRO-sharded), a per-layer fp32 temporary
        for l in range(L):
            shard = 4 * -(-layer_params // cfg.zero_shards)
            if len(opt_state) < 3 * L:
                opt_state += [em.alloc(shard, "optimizer", f"layer{l}.adam.{k}") for k in ("master", "m", "v")]
            tmp = em.alloc(shard, "temporary", f"layer{l}.adam.update")
            em.free(tmp)
    del params
    return Trace(em.events, 0, f"synthetic moe {json.dumps(asdict(cfg), sort_keys=True)}", marks=marks)
