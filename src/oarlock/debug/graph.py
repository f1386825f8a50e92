"""Forward and backward (autograd) graphs of a capture dump, as Graphviz DOT and a self-contained HTML page.

- Forward graph: one node per forward aten op, plus parameter and user-input nodes; an edge per op input
  (from the op that produced it), labelled with the tensor's dtype and shape; clusters follow module paths.
- Backward graph: one node per autograd node the capture tagged (like Paddle's ``_backward_graph.dot``);
  an edge per ``next_functions`` entry, labelled with the gradient's dtype and shape; ``AccumulateGrad``
  nodes name their parameter, nodes created before the capture are boundary nodes.

The HTML page needs no network. When Graphviz ``dot`` is installed it lays the graphs out; otherwise the SVG
is laid out here as an indented outline (rows in execution order, each module a nested box with a header
row, data-flow edges as arcs in the left margin, each row listing its inputs' dtype, shape and source so
edge labels never overlap; hover shows call stacks, user frame first). With another run's dump, the first
divergent op and the producers of its inputs are highlighted.
"""

from __future__ import annotations

import html
import os
import shutil
import subprocess
from pathlib import Path

from oarlock.debug.dump import Dump, load_dump
from oarlock.debug.errors import DebugError

_COLORS = {"op": "#dbe9f6", "param": "#fff2cc", "input": "#eeeeee", "acc": "#d9f2d9", "ext": "#ffd8b0",
           "node": "#dbe9f6"}


def _q(s: str) -> str:
    """A DOT double-quoted ID or label (backslash and quote escaped; ``\\n`` kept as DOT's line break)."""
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _meta_str(m) -> str:
    return "?" if m is None else f"{m[1]}{list(m[0])}"


def _short_op(op: str) -> str:
    return op.removeprefix("aten.").removesuffix(".default")


def _as_dump(d: Dump | str | os.PathLike) -> Dump:
    return d if isinstance(d, Dump) else load_dump(d)


# ---------------------------------------------------------------------------------------------- graph model
def forward_graph(dump: Dump) -> tuple[list[dict], list[tuple[str, str, str]]]:
    """(items, edges) of the forward graph. Items (in execution order, parameters and inputs placed just
    before their first consumer): ``id``, ``label``, ``mod``, ``kind`` (op/param/input), ``tip``. Edges:
    ``(src id, dst id, "dtype[shape]")``."""
    items: list[dict] = []
    edges: list[tuple[str, str, str]] = []
    seen_params: set[str] = set()
    ops = {r["i"] for r in dump.forward_ops()}
    for r in dump.forward_ops():
        oid = f"o{r['i']}"
        ins = []
        for k, (m, s) in enumerate(zip(r.get("in") or [], r.get("src") or [])):
            if s is None or (s.startswith("o") and int(s[1:].split(".")[0]) not in ops):
                src = f"in{r['i']}.{k}"
                items.append({"id": src, "label": f"input {_meta_str(m)}", "mod": r.get("mod"), "kind": "input",
                              "tip": "a tensor from outside the captured forward ops"})
            elif s.startswith("p:"):
                src = s
                if s not in seen_params:
                    seen_params.add(s)
                    name = s[2:]
                    items.append({"id": s, "label": f"{name} {_meta_str(m)}", "kind": "param",
                                  "mod": name.rpartition(".")[0], "tip": f"parameter {name}"})
            else:
                src = s.split(".")[0]
            edges.append((src, oid, _meta_str(m)))
            ins.append(f"{_meta_str(m)} " + ("input" if src.startswith("in") else
                                             s[2:] if src.startswith("p:") else f"#{src[1:]}"))
        tip = "\n".join(dump.format_stack(r.get("st"), max_frames=8)) or "(no stack recorded)"
        outs = ", ".join(_meta_str(m) for m in r.get("out") or [] if m is not None)
        items.append({"id": oid, "label": f"#{r['i']} {_short_op(r['op'])} -> {outs}", "mod": r.get("mod"),
                      "kind": "op", "tip": f"{r['op']}\nmodule: {r.get('mod')}\n{tip}",
                      "ins": "from " + ", ".join(ins) if ins else ""})
    return items, edges


def backward_graph(dump: Dump) -> tuple[list[dict], list[tuple[str, str, str]]]:
    """(items, edges) of the autograd graph: items are autograd nodes ordered by first execution (nodes
    never run come last), edges ``(node, next node, "dtype[shape]" of the gradient passed)``."""
    first: dict[int, int] = {}
    count: dict[int, int] = {}
    for r in dump.backward_ops():
        n = r.get("node")
        if n is not None:
            first.setdefault(n, r["i"])
            count[n] = count.get(n, 0) + 1
    order = sorted(dump.nodes, key=lambda n: (n not in first, first.get(n, 0), n))
    items, edges = [], []
    for nid in order:
        rec = dump.nodes[nid]
        if rec.get("ext"):
            kind, label = "ext", f"{rec['name']} (created before the capture)"
        elif rec["name"] == "AccumulateGrad":
            kind, label = "acc", f"AccumulateGrad {rec.get('param') or '?'}"
        else:
            kind, label = "node", f"{rec['name']} ({count.get(nid, 0)} ops)"
        tip = "\n".join(dump.format_stack(rec.get("st"), max_frames=8)) or "(no forward stack)"
        items.append({"id": f"n{nid}", "label": f"#{nid} {label}", "mod": rec.get("mod"), "kind": kind,
                      "tip": f"{rec['name']}\nforward module: {rec.get('mod')}\nforward stack:\n{tip}"})
        for nxt in rec.get("next") or []:
            if nxt is None or nxt[0] not in dump.nodes:
                continue
            grads = dump.nodes[nxt[0]].get("grads") or []
            g = grads[nxt[1]] if nxt[1] < len(grads) else None
            edges.append((f"n{nid}", f"n{nxt[0]}", _meta_str(g)))
    into: dict[str, list[str]] = {}
    for src, dst, lab in edges:
        into.setdefault(dst, []).append(f"{lab} #{src[1:]}")
    for it in items:
        it["ins"] = "grad from " + ", ".join(into[it["id"]]) if it["id"] in into else ""
    return items, edges


# ---------------------------------------------------------------------------------------------- DOT
_HL_FILL = {"divergent": "#f4a6a6", "producer": "#ffd59a"}


def _dot(name: str, items: list[dict], edges: list[tuple[str, str, str]],
         highlight: dict[str, str] | None = None) -> str:
    highlight = highlight or {}
    tree: dict = {"items": [], "sub": {}}
    for it in items:
        node = tree
        mod = it.get("mod")
        if mod is not None:
            path = ""
            for part in (mod.split(".") if mod else [""]):
                path = f"{path}.{part}" if path else part
                node = node["sub"].setdefault(path, {"items": [], "sub": {}})
        node["items"].append(it)
    lines = [f"digraph {_q(name)} {{", "  rankdir=TB;", '  node [shape=box, fontname="monospace", fontsize=10];',
             '  edge [fontname="monospace", fontsize=8];']

    def emit(node: dict, indent: str) -> None:
        for it in node["items"]:
            shape = "ellipse" if it["kind"] in ("param", "input") else "box"
            hl = highlight.get(it["id"])
            fill = _HL_FILL[hl] if hl else _COLORS[it["kind"]]
            extra = ', color="#c00000", penwidth=3' if hl == "divergent" else ""
            lines.append(f"{indent}{_q(it['id'])} [id={_q(it['id'])}, label={_q(it['label'])}, shape={shape}, "
                         f"style=filled, fillcolor={_q(fill)}, tooltip={_q(it['tip'])}{extra}];")
        for path, sub in node["sub"].items():
            lines.append(f"{indent}subgraph {_q('cluster_' + (path or '(root)'))} {{")
            lines.append(f"{indent}  label={_q(path or '(root)')}; style=rounded; color=\"#888888\";")
            emit(sub, indent + "  ")
            lines.append(f"{indent}}}")

    emit(tree, "  ")
    for s, d, lab in edges:
        extra = ', color="#c00000", penwidth=2' if highlight.get(d) == "divergent" else ""
        lines.append(f"  {_q(s)} -> {_q(d)} [label={_q(lab)}{extra}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def forward_dot(dump: Dump | str | os.PathLike) -> str:
    """Graphviz DOT text of the forward graph of a dump (path or :class:`Dump`), clustered by module, with
    dtype and shape on every edge."""
    return _dot("forward", *forward_graph(_as_dump(dump)))


def backward_dot(dump: Dump | str | os.PathLike) -> str:
    """Graphviz DOT text of the backward (autograd) graph of a dump, clustered by forward module, with the
    gradient's dtype and shape on every edge."""
    return _dot("backward", *backward_graph(_as_dump(dump)))


def _graphviz_svg(dot_text: str, timeout: float) -> str | None:
    """SVG from Graphviz ``dot`` (None when it is not installed, fails or runs past ``timeout`` seconds)."""
    exe = shutil.which("dot")
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, "-Tsvg"], input=dot_text, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0 or "<svg" not in r.stdout:
        return None
    return r.stdout[r.stdout.index("<svg"):]  # drop the XML prolog and DOCTYPE: the SVG is inlined in HTML


# ---------------------------------------------------------------------------------------------- SVG / HTML
_ROW, _INDENT, _MARGIN, _CHAR_W, _INS_MAX = 22, 16, 160, 6.6, 150


def _svg(title: str, items: list[dict], edges: list[tuple[str, str, str]],
         highlight: dict[str, str] | None = None) -> str:
    """An SVG outline of (items, edges): rows in order, module header rows and nested boxes, edge arcs in
    the left margin. Edge labels (dtype[shape] and source) are written on the destination's row, right of
    its box, so they never overlap whatever the graph's size; hovering an arc shows its label too."""
    highlight = highlight or {}
    rows: list[tuple[str, int, dict]] = []  # (kind, depth, payload)
    open_spans: list[list] = []  # innermost last; each [path, depth, first row, last row]
    spans: list[list] = []
    for it in items:
        mod = it.get("mod")
        parts = [] if mod is None else (mod.split(".") if mod else [""])
        want = [".".join(parts[:k + 1]) for k in range(len(parts))]
        while open_spans and (len(open_spans) > len(want) or open_spans[-1][0] != want[len(open_spans) - 1]):
            open_spans.pop()
        while len(open_spans) < len(want):
            sp = [want[len(open_spans)], len(open_spans), len(rows), len(rows)]
            spans.append(sp)
            open_spans.append(sp)
            rows.append(("header", sp[1], {"label": sp[0] or "(root)"}))
        rows.append(("item", len(want), it))
        for sp in open_spans:
            sp[3] = len(rows) - 1

    def box_w(p: dict) -> int:
        return max(120, int(len(p["label"]) * _CHAR_W) + 12)

    def ins_text(p: dict) -> str:
        t = p.get("ins") or ""
        return t if len(t) <= _INS_MAX else t[:_INS_MAX - 1] + "\u2026"

    max_depth = max([d for _, d, _ in rows] + [0])
    right_text = max([_MARGIN + d * _INDENT + 4 + box_w(p) + 10 + len(ins_text(p)) * 6.0
                      for kind, d, p in rows if kind == "item"] + [_MARGIN + 520])
    width = int(max(right_text, _MARGIN + 520 + (max_depth + 1) * _INDENT) + 20)
    height = (len(rows) + 1) * _ROW + 10
    row_of = {p["id"]: k for k, (kind, _, p) in enumerate(rows) if kind == "item"}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="graph" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="11">',
           f"<title>{html.escape(title)}</title>"]
    right = width - 10
    for path, depth, r0, r1 in spans:
        x = _MARGIN + depth * _INDENT
        out.append(f'<rect class="cluster" x="{x}" y="{r0 * _ROW + 4}" width="{right - x}" '
                   f'height="{(r1 - r0 + 1) * _ROW}" rx="6" fill="#000" fill-opacity="0.035" stroke="#999">'
                   f"<title>{html.escape(path or '(root)')}</title></rect>")
    for s, d, lab in edges:  # arcs first, so boxes and text paint over them
        if s not in row_of or d not in row_of:
            continue
        rs, rd = row_of[s], row_of[d]
        xs = _MARGIN + rows[rs][1] * _INDENT + 4
        xd = _MARGIN + rows[rd][1] * _INDENT + 4
        ys, yd = rs * _ROW + 6 + _ROW // 2, rd * _ROW + 6 + _ROW // 2
        bend = max(12.0, min(_MARGIN - 10.0, 8.0 + abs(rd - rs) * 6.0))
        cx = min(xs, xd) - bend
        hot = highlight.get(d) == "divergent"
        style = 'stroke="#c00000" stroke-width="2.5"' if hot else 'stroke="#36c" stroke-opacity="0.45"'
        out.append(f'<g class="edge{" hot" if hot else ""}"><title>{html.escape(s)} -> {html.escape(d)}: '
                   f'{html.escape(lab)}</title><path d="M{xs},{ys} C{cx},{ys} {cx},{yd} {xd},{yd}" fill="none" '
                   f'{style} marker-end="url(#{"hot" if hot else "arrow"})"/></g>')
    for k, (kind, depth, p) in enumerate(rows):
        y = k * _ROW + 6
        x = _MARGIN + depth * _INDENT + 4
        if kind == "header":
            out.append(f'<text class="module" x="{x}" y="{y + 14}" font-weight="bold" fill="#555">'
                       f"{html.escape(p['label'])}</text>")
            continue
        w = box_w(p)
        rx = 9 if p["kind"] in ("param", "input") else 3
        hl = highlight.get(p["id"])
        fill = _HL_FILL[hl] if hl else _COLORS[p["kind"]]
        stroke = 'stroke="#c00000" stroke-width="2.5"' if hl == "divergent" else 'stroke="#445"'
        cls = p["kind"] + (f" {hl}" if hl else "")
        out.append(f'<g class="{cls}" id="{html.escape(p["id"])}"><title>{html.escape(p["tip"])}</title>'
                   f'<rect x="{x}" y="{y + 1}" width="{w}" height="{_ROW - 4}" rx="{rx}" '
                   f'fill="{fill}" {stroke}/>'
                   f'<text x="{x + 6}" y="{y + 14}">{html.escape(p["label"])}</text></g>')
        ins = ins_text(p)
        if ins:
            out.append(f'<text class="ins" x="{x + w + 10}" y="{y + 14}" font-size="10" '
                       f'fill="{"#c00000" if hl == "divergent" else "#36c"}">{html.escape(ins)}'
                       f"<title>{html.escape(p.get('ins') or '')}</title></text>")
    out.insert(2, '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" '
                  'markerHeight="6" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#36c"/>'
                  '</marker><marker id="hot" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="5" '
                  'markerHeight="5" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#c00000"/>'
                  "</marker></defs>")
    out.append("</svg>")
    return "\n".join(out)


def _diff_highlight(a: Dump, b: Dump | str | os.PathLike) -> tuple[dict[str, str], dict[str, str], str]:
    """(forward highlight, backward highlight, banner HTML) for run ``a`` against run ``b``: the first
    divergent op and the producers of its inputs (ops, parameters, inputs)."""
    from oarlock.debug.diff import diff

    rep = diff(a, b)
    b_name = html.escape(str(rep.b.path))
    if rep.first is None:
        return {}, {}, (f'<p class="banner ok">No divergence against {b_name}: every aligned op has identical '
                        f"output checksums ({rep.compared} compared).</p>")
    r = rep.first.a
    by_i = {op["i"]: op for op in a.ops}
    fwd: dict[str, str] = {}
    bwd: dict[str, str] = {}

    def mark(i: int, cls: str) -> None:
        op = by_i.get(i)
        if op is None:
            return
        if op["ph"] == "f":
            fwd.setdefault(f"o{i}", cls)
        elif op.get("node") is not None:
            key = f"n{op['node']}"
            if bwd.get(key) != "divergent":
                bwd[key] = cls

    mark(r["i"], "divergent")
    for k, src in enumerate(r.get("src") or []):
        if src is None and r["ph"] == "f":
            fwd.setdefault(f"in{r['i']}.{k}", "producer")
        elif src and src.startswith("p:"):
            fwd.setdefault(src, "producer")
        elif src:
            mark(int(src[1:].split(".")[0]), "producer")
    uf = rep.first.user_frames()
    where = uf["fwd_a"] or uf["a"]
    loc = f"; user frame {html.escape(f'{where[0]}:{where[1]} in {where[2]}')}" if where else ""
    anchor = f"o{r['i']}" if r["ph"] == "f" else (f"n{r['node']}" if r.get("node") is not None else "")
    phase = "forward" if r["ph"] == "f" else f"backward, autograd node {html.escape(str(r.get('nname')))}"
    banner = (f'<p class="banner">First divergence against {b_name}: <a href="#{anchor}">op #{r["i"]} '
              f'{html.escape(r["op"])}</a> ({phase}) in module {html.escape(str(r.get("mod")))}{loc}. '
              f'<span class="hl divergent">red</span>: the divergent op; <span class="hl producer">orange</span>: '
              f"the producers of its inputs.</p>")
    return fwd, bwd, banner


def render_graph_html(dump: Dump | str | os.PathLike, out: str | os.PathLike | None = None, *,
                      diff_with: Dump | str | os.PathLike | None = None, layout: str = "auto",
                      dot_timeout: float = 120.0) -> str:
    """A self-contained HTML page (inline SVG, no scripts, no network) with the forward and the backward
    graph of a dump. Writes it to ``out`` when given; returns the HTML text.

    Args:
        diff_with: another run's dump: the first op where this run diverges from it (:func:`oarlock.debug.
            diff`) is drawn in red, the producers of its inputs in orange, with a banner linking to it.
        layout: ``"outline"`` (rows in execution order, nested module boxes, arcs in the margin; edge labels
            on the destination's row), ``"dot"`` (Graphviz ``dot``, if installed) or ``"auto"`` (``dot`` when
            installed, the outline otherwise or when ``dot`` fails or runs past ``dot_timeout`` seconds).

    Raises:
        DebugError: an unknown ``layout``; DumpFormatError: an unreadable dump.
    """
    if layout not in ("auto", "dot", "outline"):
        raise DebugError(f"layout={layout!r}: expected 'auto', 'dot' or 'outline'")
    d = _as_dump(dump)
    fwd = forward_graph(d)
    bwd = backward_graph(d)
    hf, hb, banner = _diff_highlight(d, diff_with) if diff_with is not None else ({}, {}, "")
    svgs, used = [], "outline"
    for name, (items, edges), hl in (("forward graph", fwd, hf), ("backward graph", bwd, hb)):
        svg = None
        if layout != "outline":
            svg = _graphviz_svg(_dot(name.split()[0], items, edges, hl), dot_timeout)
            if svg is None and layout == "dot":
                raise DebugError("layout='dot': Graphviz dot is not installed or failed (install the graphviz "
                                 "package, or use layout='outline')")
        if svg is not None:
            used = "dot"
        svgs.append(svg if svg is not None else _svg(name, items, edges, hl))
    nf, nb = len(d.forward_ops()), len(d.backward_ops())
    hint = ("Hover a box for its call stack (user frame first). Each row lists its inputs: dtype[shape] and "
            "the op (#n), parameter or input they come from." if used == "outline" else
            "Laid out by Graphviz dot; hover a node for its call stack.")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>oarlock debug: {html.escape(d.path.name)}</title>
<style>body{{font-family:sans-serif;margin:1em}} h2{{margin-top:1.5em}} .legend span,.hl{{padding:1px 6px;
border:1px solid #445;margin-right:6px;font-family:monospace;font-size:12px}} .banner{{background:#fff0f0;
border:2px solid #c00000;padding:6px 10px;font-size:14px}} .banner.ok{{background:#f0fff0;border-color:#2a2}}
.hl.divergent{{background:{_HL_FILL['divergent']}}} .hl.producer{{background:{_HL_FILL['producer']}}}</style>
</head><body>
<h1>{html.escape(d.path.name)}</h1>
{banner}
<p>{nf} forward ops, {nb} backward ops, {len(d.nodes)} autograd nodes; checksum {html.escape(str(d.checksum))};
torch {html.escape(str(d.header.get('torch')))}. {hint}</p>
<p class="legend"><span style="background:{_COLORS['op']}">op / autograd node</span><span
style="background:{_COLORS['param']}">parameter</span><span style="background:{_COLORS['input']}">input</span><span
style="background:{_COLORS['acc']}">AccumulateGrad</span><span style="background:{_COLORS['ext']}">boundary
(created before capture)</span></p>
<h2 id="forward">Forward graph</h2>
{svgs[0]}
<h2 id="backward">Backward (autograd) graph</h2>
{svgs[1]}
</body></html>
"""
    if out is not None:
        Path(out).write_text(page, encoding="utf-8")
    return page


render_html = render_graph_html  # the former name, kept for compatibility
