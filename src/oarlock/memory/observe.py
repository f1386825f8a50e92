"""The memory observer: region tracing, summaries, and an offline HTML/PNG view (design brief section 3.1).

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
    """What :func:`trace_region` yields; ``trace`` is set when the region exits."""

    def __init__(self, name: str, backend: str):
        self.name, self.backend = name, backend
        self.trace: Trace | None = None


@contextlib.contextmanager
def trace_region(name: str, device: Any = None, path: str | Path | None = None,
                 max_entries: int = 1_000_000) -> Iterator[Region]:
    """Record every allocation and free inside the ``with`` block.

    Args:
        name: label of the region (an annotation on CUDA; the trace's ``source``).
        device: ``"cpu"``, ``"cuda"``/``"cuda:N"`` or None (CUDA when available, else CPU).
        path: also save the trace there (snapshot pickle, or JSON for ``.json``).
        max_entries: size of CUDA's history ring buffer.
    Yields:
        a :class:`Region` whose ``trace`` (:class:`~oarlock.memory.trace.Trace`) is filled on exit.
    """
    import torch

    dev = torch.device(device) if device is not None else \
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
    region = Region(name, dev.type)
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
    elif dev.type == "cpu":
        from torch.profiler import ProfilerActivity, profile

        from oarlock.memory.trace import trace_from_profiler

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                     with_stack=True) as prof:
            yield region
        region.trace = trace_from_profiler(prof)
        region.trace.source = name
    else:
        raise MemoryToolError(f"trace_region: device {dev} is neither cpu nor cuda")
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

def view_data(trace: Trace, top: int = 20, max_points: int = 4000) -> dict:
    """The data behind the HTML and PNG views (JSON-serialisable).

    ``timeline``: ``[op_index, live_bytes]`` pairs (down-sampled to about ``max_points``, keeping maxima);
    ``blocks``: the allocations live at the peak, ``{addr, size, category, frame}`` by address;
    ``largest``: the ``top`` largest allocations of the trace with their frames.
    """
    live = trace.live_bytes()
    stride = max(1, len(live) // max_points)
    timeline = []
    for i in range(0, len(live), stride):
        chunk = live[i:i + stride]
        timeline.append([i, max(chunk)])

    def frames(e: dict) -> list[str]:
        out = []
        for f in e.get("frames") or []:
            fn, line, name = parse_frame(f)
            out.append(f"{name} ({fn}:{line})" if fn else name)
        return out

    peak = trace.peak_blocks()
    blocks = [{"addr": int(e["addr"]), "size": int(e["size"]), "category": e.get("category") or "",
               "frame": (frames(e) or [""])[0]} for e in peak]
    allocs = [e for e in trace.events if e.get("action") == "alloc"]
    allocs.sort(key=lambda e: -int(e["size"]))
    largest = [{"size": int(e["size"]), "addr": int(e["addr"]), "category": e.get("category") or "",
                "frames": frames(e)[:8]} for e in allocs[:top]]
    return {"source": trace.source, "events": len(trace.events), "peak": max(live, default=0),
            "timeline": timeline, "blocks": blocks, "largest": largest}


_HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>oarlock memory view: %(title)s</title>
<style>
body{font:13px sans-serif;margin:16px;color:#222} h2{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse} td,th{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}
td.n{text-align:right} .frames{font:11px monospace;white-space:pre} svg{background:#fafafa;border:1px solid #ddd}
</style></head><body>
<h1 style="font-size:17px">Memory view</h1>
<p id="meta"></p>
<h2>Live bytes over time</h2><svg id="timeline" width="900" height="220"></svg>
<h2>Blocks live at the peak, by address</h2><svg id="blocks" width="900" height="140"></svg>
<p id="blockinfo"></p>
<h2>Largest allocations</h2><table id="largest"><thead><tr><th>#</th><th>size</th><th>category</th>
<th>address</th><th>Python frames</th></tr></thead><tbody></tbody></table>
<script id="data" type="application/json">%(data)s</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const NS = "http://www.w3.org/2000/svg";
function fmt(n){const u=["B","KiB","MiB","GiB","TiB"];let i=0;while(Math.abs(n)>=1024&&i<4){n/=1024;i++;}
  return (i?n.toFixed(2):n.toFixed(0))+" "+u[i];}
function el(tag, attrs, parent){const e=document.createElementNS(NS, tag);
  for(const k in attrs) e.setAttribute(k, attrs[k]); parent.appendChild(e); return e;}
document.getElementById("meta").textContent = D.source + ": " + D.events + " events, peak live " + fmt(D.peak);
(function timeline(){
  const s=document.getElementById("timeline"), W=900, H=220, P=40;
  const xs=D.timeline.map(p=>p[0]), ys=D.timeline.map(p=>p[1]);
  const xmax=Math.max(1,...xs), ymax=Math.max(1,...ys);
  const pts=D.timeline.map(p=>(P+(W-P-10)*p[0]/xmax).toFixed(1)+","+(H-20-(H-40)*p[1]/ymax).toFixed(1));
  el("polyline",{points:pts.join(" "),fill:"none",stroke:"#1f77b4","stroke-width":1.5,class:"live"},s);
  const t=el("text",{x:4,y:14,"font-size":11},s); t.textContent="peak "+fmt(ymax);
  const b=el("text",{x:W-120,y:H-4,"font-size":11},s); b.textContent="replay op index";
})();
(function blocks(){
  const s=document.getElementById("blocks"), W=900, H=140;
  if(!D.blocks.length) return;
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
(function largest(){
  const tb=document.querySelector("#largest tbody");
  D.largest.forEach((a,i)=>{const tr=document.createElement("tr");
    const cells=[String(i+1),fmt(a.size),a.category,"0x"+a.addr.toString(16),a.frames.join("\\n")];
    cells.forEach((c,j)=>{const td=document.createElement("td"); td.textContent=c;
      if(j<2) td.className="n"; if(j==4) td.className="frames"; tr.appendChild(td);});
    tb.appendChild(tr);});
})();
</script></body></html>
"""


def render_memory_html(trace: Trace, path: str | Path, top: int = 20) -> Path:
    """Write the self-contained HTML view of ``trace`` to ``path`` (no network access needed to view it).

    The page holds its data as inline JSON and draws, with inline JavaScript, one ``<rect class="block">``
    per allocation live at the peak."""
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
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), gridspec_kw={"height_ratios": [3, 1.2, 3]})
    ax = axes[0]
    ax.plot([p[0] for p in d["timeline"]], [p[1] / MiB for p in d["timeline"]], lw=1)
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
    ax = axes[2]
    ax.axis("off")
    rows = [[fmt_bytes(a["size"]), a["category"], (a["frames"] or [""])[0][:90]] for a in d["largest"]]
    if rows:
        t = ax.table(cellText=rows, colLabels=["size", "category", "innermost frame"], loc="upper center",
                     colWidths=[0.12, 0.12, 0.76], cellLoc="left")
        t.auto_set_font_size(False)
        t.set_fontsize(7)
    ax.set_title("largest allocations", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


render_html = render_memory_html  # the former name, kept for compatibility
