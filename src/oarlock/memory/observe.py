"""The memory observer: region tracing, summaries, and an offline HTML/PNG view (``docs/memory-debug.md``
section 2).

* :func:`trace_region` records the allocations and frees of a code region: on CUDA through
  ``torch.cuda.memory._record_memory_history`` (Python stacks), on CPU through
  ``torch.profiler.profile(profile_memory=True, with_stack=True)``.
* :func:`memory_summary` prints Paddle-style tables (its ``memory_summary``: global snapshot, per-pool block
  statistics with the composite Frag Ratio, 12-bucket block-size distribution) for a trace replayed through
  an allocator model, or for a model directly.
* :func:`render_memory_html` writes one self-contained page (inline SVG drawn by inline JavaScript, no CDN): live
  bytes over time, the blocks live at the peak by address, and the largest allocations with their Python
  frames. :func:`render_png` draws the same three panels with matplotlib.
"""

from __future__ import annotations

import contextlib
import html
import json
import time
from pathlib import Path
from typing import Any, Iterator

from oarlock.memory.errors import MemoryToolError
from oarlock.memory.simulate import external_fragmentation, fmt_bytes, replay
from oarlock.memory.trace import Trace, parse_frame

MiB = 1 << 20
GiB = 1 << 30
BUCKETS = [(0, MiB), (MiB, 2 * MiB), (2 * MiB, 4 * MiB), (4 * MiB, 8 * MiB), (8 * MiB, 16 * MiB),
           (16 * MiB, 32 * MiB), (32 * MiB, 64 * MiB), (64 * MiB, 128 * MiB), (128 * MiB, 256 * MiB),
           (256 * MiB, GiB), (GiB, 2 * GiB), (2 * GiB, None)]


class Region:
    """What :func:`trace_region` yields; ``trace`` is set when the region exits.

    ``phases``: ``(name, start_ns, end_ns)`` of the nested :func:`trace_region` scopes and :meth:`mark`
    calls (Unix time in ns; ``end_ns`` is None for a mark). They become the trace's ``marks`` (step/phase
    markers on the memory page)."""

    def __init__(self, name: str, backend: str):
        self.name, self.backend = name, backend
        self.trace: Trace | None = None
        self.phases: list[tuple[str, int, int | None]] = []

    def mark(self, name: str) -> None:
        """Put a named marker at this moment of the recording (e.g. ``"optimizer"``)."""
        self.phases.append((str(name), time.time_ns(), None))

    def __repr__(self) -> str:
        return f"Region({self.name!r}, backend={self.backend!r}, phases={len(self.phases)}, trace={self.trace!r})"


_RECORDING: list[Region] = []  # the outermost trace_region recording now (nested ones add phases to it)


def _apply_phases(trace: Trace, phases: list[tuple[str, int, int | None]]) -> None:
    """Turn phase start times into ``trace.marks`` (name -> index of the first event at or after the start;
    repeated names get ``#2``, ``#3``...). Needs events with ``time_us``; without them nothing is marked."""
    times = [e.get("time_us") for e in trace.events]
    if not phases or not times or any(not isinstance(t, (int, float)) for t in times):
        return
    import bisect

    us = [float(t) for t in times]
    if any(b < a for a, b in zip(us, us[1:])):
        return
    seen: dict[str, int] = {}
    for name, start, _end in phases:
        seen[name] = seen.get(name, 0) + 1
        key = name if seen[name] == 1 else f"{name}#{seen[name]}"
        trace.marks[key] = bisect.bisect_left(us, start / 1000.0)


@contextlib.contextmanager
def trace_region(name: str, device: Any = None, path: str | Path | None = None,
                 max_entries: int = 1_000_000) -> Iterator[Region]:
    """Record every allocation and free inside the ``with`` block.

    A ``trace_region`` nested inside another one records no trace of its own: it marks a phase (its name
    and start) of the outer trace, shown as a step/phase marker on the memory page (``trace.marks``). Use
    ``with trace_region("step"):`` around each training step, or ``region.mark("optimizer")``.

    Args:
        name: label of the region (an annotation on CUDA; the trace's ``source``).
        device: ``"cpu"``, ``"cuda"``/``"cuda:N"`` or None (CUDA when available, else CPU).
        path: also save the trace there (snapshot pickle, or JSON for ``.json``).
        max_entries: size of CUDA's history ring buffer.
    Yields:
        a :class:`Region` whose ``trace`` (:class:`~oarlock.memory.trace.Trace`) is filled on exit (None for
        a nested region).
    Raises:
        MemoryToolError: a device other than CPU or CUDA.
    """
    import torch

    if _RECORDING:
        outer = _RECORDING[0]
        inner = Region(name, outer.backend)
        start = time.time_ns()
        try:
            with torch.profiler.record_function(name):
                yield inner
        finally:
            outer.phases.append((str(name), start, time.time_ns()))
            outer.phases.extend(inner.phases)
        return
    dev = torch.device(device) if device is not None else \
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
    region = Region(name, dev.type)
    if dev.type not in ("cpu", "cuda"):
        raise MemoryToolError(f"trace_region: device {dev} is neither cpu nor cuda")
    _RECORDING.append(region)
    try:
        if dev.type == "cuda":
            from oarlock.memory.trace import trace_from_snapshot

            idx = dev.index if dev.index is not None else torch.cuda.current_device()
            torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                                     max_entries=max_entries, device=idx)
            try:
                with torch.profiler.record_function(name):
                    yield region
            finally:
                snap = torch.cuda.memory._snapshot(idx)
                torch.cuda.memory._record_memory_history(enabled=None, device=idx)
            region.trace = trace_from_snapshot(snap, idx, source=name)
        else:
            from torch.profiler import ProfilerActivity, profile

            from oarlock.memory.trace import trace_from_profiler

            with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                         with_stack=True) as prof:
                yield region
            region.trace = trace_from_profiler(prof)
            region.trace.source = name
    finally:
        _RECORDING.remove(region)
    _apply_phases(region.trace, region.phases)
    if path is not None:
        region.trace.save(path)


def block_size_distribution(blocks: list[tuple]) -> list[tuple[str, int, int]]:
    """``(bucket, free_blocks, used_blocks)`` over Paddle's 12 size buckets ([0,1M) ... [2G,inf))."""
    out = []
    for lo, hi in BUCKETS:
        label = f"[{fmt_bytes(lo)}, {fmt_bytes(hi) if hi else 'inf'})".replace(".00", "")
        inb = [b for b in blocks if b[1] >= lo and (hi is None or b[1] < hi)]
        out.append((label, sum(1 for b in inb if b[2] == "free"), sum(1 for b in inb if b[2] == "active")))
    return out


class SegmentState:
    """The allocator-model interface (``blocks()``, ``free_block_sizes()``, ``reserved``) over the
    ``segments`` of a PyTorch memory snapshot (``torch.cuda.memory_snapshot()``), so real allocator state
    can be summarised like a model's. Block states ``active_*`` count as used, ``inactive`` as free."""

    name = "torch (snapshot)"

    def __init__(self, segments: list[dict]):
        self.segments = segments
        self.reserved = sum(int(s.get("total_size", 0)) for s in segments)

    def blocks(self) -> list[tuple[int, int, str, str]]:
        out = []
        for seg in self.segments:
            addr = int(seg.get("address", 0))
            pool = f"{seg.get('segment_type', 'segment')}/s{seg.get('stream', 0)}"
            for b in seg.get("blocks", []):
                size = int(b["size"])
                out.append((addr, size, "active" if str(b.get("state", "")).startswith("active") else "free", pool))
                addr += size
        return out

    def free_block_sizes(self) -> list[int]:
        return [b[1] for b in self.blocks() if b[2] == "free"]


def memory_summary(source: Trace | Any = None, allocator: str = "caching", capacity: int | None = None) -> str:
    """Paddle-style summary tables as text.

    Args:
        source: a :class:`Trace` (replayed through ``allocator`` and summarised at its end, with the peaks
            of the whole replay), an allocator model instance or a :class:`SegmentState` (current state),
            or None: the current CUDA caching allocator's state (``torch.cuda.memory_snapshot()``).
    Raises:
        MemoryToolError: ``source`` is None and CUDA is not available.
    Returns:
        three tables: global (allocated, max allocated, reserved, max reserved, fragmentation), per pool
        (blocks, used/free counts and bytes, max used, max free, Frag Ratio) and the block-size
        distribution.
    """
    if source is None:
        import torch

        if not torch.cuda.is_available():
            raise MemoryToolError("memory_summary(): no CUDA device; pass a Trace or an allocator model")
        source = SegmentState(torch.cuda.memory_snapshot())
    if isinstance(source, Trace):
        holder: dict[str, Any] = {}

        def keep(k: int, op: Any, model: Any, live: dict) -> None:
            holder["model"] = model

        res = replay(source, allocator, capacity, on_step=keep)
        model = holder.get("model")
        if model is None:
            raise MemoryToolError(f"memory_summary: trace {source.source!r} has no allocations to replay")
        allocated = sum(e[1] for e in model.blocks() if e[2] == "active") if model.blocks() else \
            model.reserved
        head = [("Allocator", res.allocator), ("Allocated (end)", fmt_bytes(allocated)),
                ("Max Allocated", fmt_bytes(res.peak_allocated)), ("Reserved (end)", fmt_bytes(res.final_reserved)),
                ("Max Reserved", fmt_bytes(res.peak_reserved)),
                ("Fragmentation (1 - max alloc / max reserved)", f"{100 * res.fragmentation:.2f}%"),
                ("External frag at peak (1 - max free / free)", f"{100 * res.external_frag_at_peak:.2f}%"),
                ("Driver calls", str(res.driver_calls))]
    else:
        model = source
        allocated = sum(e[1] for e in model.blocks() if e[2] == "active")
        head = [("Allocator", getattr(model, "name", type(model).__name__)), ("Allocated", fmt_bytes(allocated)),
                ("Reserved", fmt_bytes(model.reserved)),
                ("Cur waste rate (reserved - allocated) / reserved",
                 f"{100 * (1 - allocated / model.reserved):.2f}%" if model.reserved else "0%")]
    blocks = model.blocks()
    lines = ["== Global Memory Snapshot =="]
    w = max(len(k) for k, _ in head)
    lines += [f"{k:<{w}}  {v}" for k, v in head]
    lines += ["", "== Pool Summary ==",
              f"{'pool':<12} {'blocks':>7} {'used':>6} {'free':>6} {'used bytes':>12} {'free bytes':>12} "
              f"{'max used':>11} {'max free':>11} {'frag ratio':>10}"]
    for pool in sorted({b[3] for b in blocks}):
        bs = [b for b in blocks if b[3] == pool]
        used = [b[1] for b in bs if b[2] == "active"]
        free = [b[1] for b in bs if b[2] == "free"]
        ratio = 1 - (max(free) / sum(free)) * (len(used) / len(bs)) if free else 0.0
        lines.append(f"{pool:<12} {len(bs):>7} {len(used):>6} {len(free):>6} {fmt_bytes(sum(used)):>12} "
                     f"{fmt_bytes(sum(free)):>12} {fmt_bytes(max(used, default=0)):>11} "
                     f"{fmt_bytes(max(free, default=0)):>11} {ratio:>10.3f}")
    ext, ratio = external_fragmentation(model)
    lines.append(f"{'all':<12} external fragmentation {100 * ext:.2f}%, Frag Ratio {ratio:.3f}")
    lines += ["", "== Block Size Distribution ==", f"{'size':<22} {'free':>6} {'used':>6}"]
    lines += [f"{label:<22} {f:>6} {u:>6}" for label, f, u in block_size_distribution(blocks)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- views

SIZE_BUCKETS = [(0, 64 << 10, "< 64 KiB"), (64 << 10, MiB, "64 KiB - 1 MiB"), (MiB, 16 * MiB, "1 - 16 MiB"),
                (16 * MiB, 128 * MiB, "16 - 128 MiB"), (128 * MiB, GiB, "128 MiB - 1 GiB"), (GiB, None, ">= 1 GiB")]
LIFETIME_BUCKETS = ["< 10 ops", "10 - 100 ops", "100 - 1k ops", "1k - 10k ops", ">= 10k ops", "live at the end"]


def _lifetime_bucket(ops_alive: int | None) -> int:
    if ops_alive is None:
        return len(LIFETIME_BUCKETS) - 1
    for k, hi in enumerate((10, 100, 1000, 10000)):
        if ops_alive < hi:
            return k
    return 4


def _size_bucket(size: int) -> int:
    return next(k for k, (lo, hi, _) in enumerate(SIZE_BUCKETS) if hi is None or size < hi)


def view_data(trace: Trace, top: int = 20, max_points: int = 4000) -> dict:
    """The data behind the HTML and PNG views (JSON-serialisable).

    ``timeline``: ``[op_index, live_bytes]`` pairs (down-sampled to about ``max_points``, keeping maxima);
    ``marks``: ``[op_index, name]`` step/phase markers (from ``trace.marks``); ``cpu``: whether the trace
    comes from the CPU profiler (addresses there are host heap addresses, meaningless as a layout);
    ``blocks``: the allocations live at the peak, ``{addr, size, category, frame}`` by address (device
    traces only); ``size_lifetime``: allocation count and bytes per size bucket (rows, ``SIZE_BUCKETS``) and
    lifetime bucket (columns, ``LIFETIME_BUCKETS``; lifetime = replay ops between alloc and free);
    ``largest``: the ``top`` largest blocks, allocations of the same block (address and size) merged, with
    ``count`` and the frames of the first.
    """
    ops = trace.ops()
    live = []
    cur = 0
    alloc_at: dict[int, int] = {}
    lifetimes: dict[int, int] = {}
    for k, op in enumerate(ops):
        if op.kind == "a":
            cur += op.size
            alloc_at[op.id] = k
        else:
            cur -= op.size
            lifetimes[op.id] = k - alloc_at.get(op.id, k)
        live.append(cur)
    stride = max(1, len(live) // max_points)
    timeline = []
    for i in range(0, len(live), stride):
        chunk = live[i:i + stride]
        timeline.append([i, max(chunk)])
    op_events = [op.event for op in ops]
    import bisect

    marks = sorted([[bisect.bisect_left(op_events, ev), name] for name, ev in trace.marks.items()])

    def frames(e: dict) -> list[str]:
        out = []
        for f in e.get("frames") or []:
            fn, line, name = parse_frame(f)
            out.append(f"{name} ({fn}:{line})" if fn else name)
        return out

    cpu = trace.device < 0
    blocks = []
    if not cpu:
        blocks = [{"addr": int(e["addr"]), "size": int(e["size"]), "category": e.get("category") or "",
                   "frame": (frames(e) or [""])[0]} for e in trace.peak_blocks()]
    grid = [[[0, 0] for _ in LIFETIME_BUCKETS] for _ in SIZE_BUCKETS]
    for op in ops:
        if op.kind == "a":
            cell = grid[_size_bucket(op.size)][_lifetime_bucket(lifetimes.get(op.id))]
            cell[0] += 1
            cell[1] += op.size
    by_block: dict[tuple[int, int], dict] = {}
    for e in trace.events:
        if e.get("action") != "alloc":
            continue
        key = (int(e["addr"]), int(e["size"]))
        b = by_block.get(key)
        if b is None:
            by_block[key] = {"size": key[1], "addr": key[0], "count": 1, "category": e.get("category") or "",
                             "frames": frames(e)[:8]}
        else:
            b["count"] += 1
    largest = sorted(by_block.values(), key=lambda b: (-b["size"], -b["count"], b["addr"]))[:top]
    return {"source": trace.source, "events": len(trace.events), "peak": max(live, default=0), "cpu": cpu,
            "timeline": timeline, "marks": marks, "blocks": blocks,
            "size_lifetime": {"sizes": [b[2] for b in SIZE_BUCKETS], "lifetimes": LIFETIME_BUCKETS, "cells": grid},
            "largest": largest}


_HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>oarlock memory view: %(title)s</title>
<style>
body{font:13px sans-serif;margin:16px;color:#222} h2{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse} td,th{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}
td.n{text-align:right} .frames{font:11px monospace;white-space:pre} svg{background:#fafafa;border:1px solid #ddd}
#grid td{text-align:right;min-width:90px} #grid td.z{color:#bbb}
</style></head><body>
<h1 style="font-size:17px">Memory view</h1>
<p id="meta"></p>
<h2>Live bytes over time</h2><svg id="timeline" width="900" height="240"></svg>
<div id="addr"><h2>Blocks live at the peak, by address</h2><svg id="blocks" width="900" height="140"></svg>
<p id="blockinfo"></p></div>
<h2>Allocations by size and lifetime</h2>
<p>Each cell: number of allocations and their total bytes; lifetime counts replay ops (allocations and frees)
between an allocation and its free. Shading follows the bytes.</p>
<table id="grid"><thead></thead><tbody></tbody></table>
<h2>Largest blocks</h2><p>Allocations of the same block (same address and size) are merged; "times" counts
them.</p><table id="largest"><thead><tr><th>#</th><th>size</th><th>times</th><th>category</th>
<th>address</th><th>Python frames (first allocation)</th></tr></thead><tbody></tbody></table>
<script id="data" type="application/json">%(data)s</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const NS = "http://www.w3.org/2000/svg";
function fmt(n){const u=["B","KiB","MiB","GiB","TiB"];let i=0;while(Math.abs(n)>=1024&&i<4){n/=1024;i++;}
  return (i?n.toFixed(2):n.toFixed(0))+" "+u[i];}
function el(tag, attrs, parent){const e=document.createElementNS(NS, tag);
  for(const k in attrs) e.setAttribute(k, attrs[k]); parent.appendChild(e); return e;}
document.getElementById("meta").textContent = D.source + ": " + D.events + " events, peak live " + fmt(D.peak) +
  (D.cpu ? " (CPU profiler trace: host addresses are not a device layout, so no address panel)" : "");
(function timeline(){
  const s=document.getElementById("timeline"), W=900, H=240, P=78, T=40;
  const xs=D.timeline.map(p=>p[0]), ys=D.timeline.map(p=>p[1]);
  const xmax=Math.max(1,...xs, ...D.marks.map(m=>m[0])), ymax=Math.max(1,...ys);
  const X=x=>P+(W-P-10)*x/xmax, Y=y=>H-20-(H-20-T)*y/ymax;
  for(let k=0;k<=4;k++){const y=Y(ymax*k/4);
    el("line",{x1:P,x2:W-10,y1:y,y2:y,stroke:"#ddd"},s);
    const t=el("text",{x:P-4,y:y+4,"font-size":10,"text-anchor":"end"},s); t.textContent=fmt(ymax*k/4);}
  let lastX=-1e9, row=0;
  D.marks.forEach(m=>{const x=X(m[0]);
    el("line",{x1:x,x2:x,y1:T-4,y2:H-20,stroke:"#d62728","stroke-dasharray":"4 3",class:"mark"},s);
    row = (x-lastX<70) ? (row+1)%%3 : 0; lastX=x;
    const t=el("text",{x:x+2,y:10+row*11,"font-size":10,fill:"#d62728",class:"marklabel"},s);
    t.textContent=m[1];});
  const pts=D.timeline.map(p=>X(p[0]).toFixed(1)+","+Y(p[1]).toFixed(1));
  el("polyline",{points:pts.join(" "),fill:"none",stroke:"#1f77b4","stroke-width":1.5,class:"live"},s);
  const b=el("text",{x:W-120,y:H-4,"font-size":11},s); b.textContent="replay op index";
})();
(function blocks(){
  const s=document.getElementById("blocks"), W=900, H=140;
  if(D.cpu || !D.blocks.length){document.getElementById("addr").style.display="none"; return;}
  const lo=Math.min(...D.blocks.map(b=>b.addr)), hi=Math.max(...D.blocks.map(b=>b.addr+b.size));
  const cats={}; const pal=["#1f77b4","#ff7f0e","#2ca02c","#d62728","#9467bd","#8c564b","#e377c2","#7f7f7f"];
  D.blocks.forEach((b,i)=>{
    if(!(b.category in cats)) cats[b.category]=pal[Object.keys(cats).length%%pal.length];
    const x=10+(W-20)*(b.addr-lo)/Math.max(1,hi-lo), w=Math.max(1,(W-20)*b.size/Math.max(1,hi-lo));
    const r=el("rect",{x:x.toFixed(2),y:20,width:w.toFixed(2),height:H-50,fill:cats[b.category],
      stroke:"#fff","stroke-width":0.3,class:"block","data-addr":b.addr,"data-size":b.size},s);
    const tt=el("title",{},r); tt.textContent=fmt(b.size)+" @ 0x"+b.addr.toString(16)+" "+b.category+" "+b.frame;
  });
  const info=document.getElementById("blockinfo");
  info.textContent=D.blocks.length+" blocks spanning "+fmt(hi-lo)+" of address space; categories: "+
    Object.keys(cats).map(c=>(c||"(none)")).join(", ");
})();
(function grid(){
  const G=D.size_lifetime, t=document.getElementById("grid");
  const hr=document.createElement("tr"); ["size \\\\ lifetime"].concat(G.lifetimes).forEach(h=>{
    const th=document.createElement("th"); th.textContent=h; hr.appendChild(th);}); t.tHead.appendChild(hr);
  const maxb=Math.max(1,...G.cells.flat().map(c=>c[1]));
  G.cells.forEach((row,i)=>{const tr=document.createElement("tr");
    const th=document.createElement("th"); th.textContent=G.sizes[i]; tr.appendChild(th);
    row.forEach(c=>{const td=document.createElement("td");
      if(c[0]){td.textContent=c[0]+" \\u00d7, "+fmt(c[1]);
        td.style.background="rgba(31,119,180,"+(0.08+0.6*c[1]/maxb).toFixed(3)+")";}
      else {td.textContent="-"; td.className="z";}
      tr.appendChild(td);});
    t.tBodies[0].appendChild(tr);});
})();
(function largest(){
  const tb=document.querySelector("#largest tbody");
  D.largest.forEach((a,i)=>{const tr=document.createElement("tr");
    const cells=[String(i+1),fmt(a.size),String(a.count),a.category,"0x"+a.addr.toString(16),a.frames.join("\\n")];
    cells.forEach((c,j)=>{const td=document.createElement("td"); td.textContent=c;
      if(j<3) td.className="n"; if(j==5) td.className="frames"; tr.appendChild(td);});
    tb.appendChild(tr);});
})();
</script></body></html>
"""


def render_memory_html(trace: Trace, path: str | Path, top: int = 20) -> Path:
    """Write the self-contained HTML view of ``trace`` to ``path`` (no network access needed to view it).

    The page holds its data as inline JSON (:func:`view_data`) and draws with inline JavaScript: live bytes
    over time with step/phase markers (``trace.marks``), for device traces one ``<rect class="block">`` per
    allocation live at the peak by address, a size x lifetime table of all allocations, and the largest
    blocks (repeated allocations of one block merged)."""
    data = json.dumps(view_data(trace, top)).replace("</", "<\\/")
    path = Path(path)
    path.write_text(_HTML % {"title": html.escape(trace.source[:80]), "data": data})
    return path


def render_png(trace: Trace, path: str | Path, top: int = 10) -> Path:
    """Write a PNG (matplotlib, Agg) with live bytes over time, peak blocks by address, and the largest
    allocations with their innermost frame."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    d = view_data(trace, top)
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), gridspec_kw={"height_ratios": [3, 1.6, 3]})
    ax = axes[0]
    ax.plot([p[0] for p in d["timeline"]], [p[1] / MiB for p in d["timeline"]], lw=1)
    for k, (x, name) in enumerate(d["marks"][:60]):
        ax.axvline(x, color="#d62728", ls="--", lw=0.8)
        ax.annotate(name, (x, 1.0), xycoords=("data", "axes fraction"), fontsize=6, color="#d62728",
                    xytext=(2, -8 - 7 * (k % 3)), textcoords="offset points")
    ax.set_xlabel("replay op index")
    ax.set_ylabel("live MiB")
    ax.set_title(f"{d['source'][:90]}: peak {fmt_bytes(d['peak'])}", fontsize=9)
    ax = axes[1]
    if d["blocks"]:
        lo = min(b["addr"] for b in d["blocks"])
        cats = sorted({b["category"] for b in d["blocks"]})
        cmap = plt.get_cmap("tab10")
        for b in d["blocks"]:
            ax.barh(0, b["size"] / MiB, left=(b["addr"] - lo) / MiB, color=cmap(cats.index(b["category"]) % 10),
                    edgecolor="white", linewidth=0.3)
        from matplotlib.patches import Patch

        ax.legend(handles=[Patch(color=cmap(i % 10), label=c or "(none)") for i, c in enumerate(cats)],
                  fontsize=7, ncol=min(len(cats), 6), loc="upper center", bbox_to_anchor=(0.5, 1.35))
        ax.set_xlabel(f"MiB from {lo:#x} ({len(d['blocks'])} blocks live at the peak)")
        ax.set_yticks([])
    else:  # CPU trace: host addresses say nothing; show allocations by size and lifetime instead
        g = d["size_lifetime"]
        mbytes = [[c[1] / MiB for c in row] for row in g["cells"]]
        ax.imshow(mbytes, aspect="auto", cmap="Blues")
        for i, row in enumerate(g["cells"]):
            for j, (n, b) in enumerate(row):
                if n:
                    ax.text(j, i, f"{n}x {fmt_bytes(b)}", ha="center", va="center", fontsize=6)
        ax.set_xticks(range(len(g["lifetimes"])), g["lifetimes"], fontsize=7)
        ax.set_yticks(range(len(g["sizes"])), g["sizes"], fontsize=7)
        ax.set_title("allocations by size (rows) and lifetime in replay ops (columns)", fontsize=8)
    ax = axes[2]
    ax.axis("off")
    rows = [[fmt_bytes(a["size"]), str(a["count"]), a["category"], (a["frames"] or [""])[0][:90]]
            for a in d["largest"]]
    if rows:
        t = ax.table(cellText=rows, colLabels=["size", "times", "category", "innermost frame"], loc="upper center",
                     colWidths=[0.1, 0.06, 0.12, 0.72], cellLoc="left")
        t.auto_set_font_size(False)
        t.set_fontsize(7)
    ax.set_title("largest blocks (repeated allocations of one block merged)", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


render_html = render_memory_html  # the former name, kept for compatibility
