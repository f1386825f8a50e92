"""DOT output parses with pydot and matches the real autograd graph; the HTML renders in headless Chromium."""

import re
import shutil
from pathlib import Path

import pydot
import pytest
import torch

import oarlock.debug as od
from oarlock.debug.graph import forward_graph
from debug_model import make_inputs

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:pydot.*")

REPO = Path(__file__).resolve().parents[2]


def _walk(g):
    """All nodes, edges and cluster names of a pydot graph, subgraphs included."""
    nodes, edges, clusters = [], list(g.get_edges()), []
    nodes += [n for n in g.get_nodes() if n.get_name() not in ("node", "edge", "graph")]
    for sg in g.get_subgraphs():
        clusters.append(sg.get_name().strip('"'))
        n, e, c = _walk(sg)
        nodes, edges, clusters = nodes + n, edges + e, clusters + c
    return nodes, edges, clusters


def _capture_step(tmp_path):
    model, x, y = make_inputs()
    with od.capture(tmp_path / "g.jsonl") as rec:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        # reference autograd graph, walked with plain torch before backward frees it
        seen, todo, ref_edges = set(), [loss.grad_fn], 0
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            nxt = [f for f, _ in n.next_functions if f is not None]
            ref_edges += len(nxt)
            todo.extend(nxt)
        loss.backward()
    return od.load_dump(rec.path), len(seen), ref_edges


def test_forward_and_backward_dot_parse_and_match(tmp_path):
    dump, ref_nodes, ref_edges = _capture_step(tmp_path)
    (g,) = pydot.graph_from_dot_data(od.forward_dot(dump))
    nodes, edges, clusters = _walk(g)
    fwd = dump.forward_ops()
    op_nodes = [n for n in nodes if re.fullmatch(r'"?o\d+"?', n.get_name())]
    assert len(op_nodes) == len(fwd)
    assert len(edges) == sum(len(r["in"]) for r in fwd)
    assert {"cluster_layers", "cluster_layers.1", "cluster_layers.1.fc", "cluster_head"} <= set(clusters)
    # shapes on edges: the edge into layers.1.fc's addmm from its weight's transpose carries [16, 16]
    addmm = next(r for r in fwd if r["mod"] == "layers.1.fc" and r["op"] == "aten.addmm.default")
    labels = {e.get_label().strip('"') for e in edges if e.get_destination().strip('"') == f"o{addmm['i']}"}
    assert labels == {"float32[16]", "float32[8, 16]", "float32[16, 16]"}

    (b,) = pydot.graph_from_dot_data(od.backward_dot(dump))
    nodes, edges, clusters = _walk(b)
    assert len(nodes) == ref_nodes == len(dump.nodes)
    assert len(edges) == ref_edges
    assert "cluster_layers.2.fc" in clusters
    acc = [n for n in nodes if "AccumulateGrad layers.1.fc.weight" in n.get_label()]
    assert len(acc) == 1
    # the gradient reaching layers.1.fc.weight's AccumulateGrad is [16, 16]
    into = [e for e in edges if e.get_destination() == acc[0].get_name()]
    assert [e.get_label().strip('"') for e in into] == ["float32[16, 16]"]


def test_html_is_self_contained_and_renders_in_chromium(tmp_path, headless_chromium):
    dump, _, _ = _capture_step(tmp_path)
    page = tmp_path / "g.html"
    text = od.render_graph_html(dump, page, layout="outline")
    assert "<script" not in text and "<link" not in text
    assert re.findall(r"https?://[^\"' ]+", text) == ["http://www.w3.org/2000/svg"] * 2  # only SVG's namespace
    r = headless_chromium("--dump-dom", page.as_uri())
    assert r.returncode == 0, r.stderr[-2000:]
    dom = r.stdout
    assert dom.count('<g class="op"') == len(dump.forward_ops())
    assert dom.count('<g class="node"') == sum(1 for n in dump.nodes.values()
                                               if not n.get("ext") and n["name"] != "AccumulateGrad")
    shot = tmp_path / "g.png"
    r = headless_chromium("--window-size=900,1200", f"--screenshot={shot}", page.as_uri())
    assert r.returncode == 0 and shot.is_file(), r.stderr[-2000:]
    import matplotlib.image

    img = (matplotlib.image.imread(str(shot))[..., :3] * 255).round()
    # the op boxes' fill colour (#dbe9f6) is on screen, i.e. the SVG was laid out and painted
    box = (abs(img - torch.tensor([219, 233, 246]).numpy()).sum(-1) <= 3).sum()
    assert box > 2000


def test_render_diff_highlights_first_divergent_op_and_its_producers(run, tmp_path):
    from oarlock.cli import main

    a, b = run("a"), run("b", perturb=True)
    rep = od.diff(a, b)
    first = rep.first.a
    page = tmp_path / "d.html"
    assert main(["debug", "render", str(a), "--diff", str(b), "-o", str(page), "--layout", "outline"]) == 0
    text = page.read_text()
    divergent = re.findall(r'<g class="(?:op|node|param|input)[^"]*divergent" id="([^"]+)"', text)
    assert divergent == [f"o{first['i']}"]
    producers = set(re.findall(r'<g class="[a-z]+ producer" id="([^"]+)"', text))
    expected = {s if s.startswith("p:") else s.split(".")[0] for s in first["src"] if s}
    assert producers == expected and "p:layers.1.fc.weight" in producers
    assert f'href="#o{first["i"]}"' in text and "First divergence against" in text
    # the same run against itself: no divergence, nothing highlighted
    od.render_graph_html(a, page, diff_with=a, layout="outline")
    text = page.read_text()
    assert "No divergence against" in text and "divergent\"" not in text


def test_edge_labels_have_one_row_each_at_30_layers(tmp_path):
    """At 30 layers the labels still never overlap: every edge label is written on its destination's own
    row (one text line per row), and every edge into an op appears in that row's text."""
    from debug_model import Net

    torch.manual_seed(0)
    model = Net(layers=30)
    path = tmp_path / "big.jsonl"
    with od.capture(path, checksum=None):
        model(torch.randn(4, 16)).sum().backward()
    dump = od.load_dump(path)
    text = od.render_graph_html(dump, layout="outline")
    forward_svg = text[text.index('<svg'):text.index('</svg>')]
    ys = [float(y) for y in re.findall(r'<text class="ins" x="[0-9.]+" y="([0-9.]+)"', forward_svg)]
    assert len(ys) == len(set(ys)) > 30 * 5
    items, edges = __import__("oarlock.debug.graph", fromlist=["forward_graph"]).forward_graph(dump)
    ins = {it["id"]: it.get("ins", "") for it in items}
    for src, dst, lab in edges:
        assert lab in ins[dst]


def test_graphviz_layout_when_dot_is_installed(run, tmp_path):
    import shutil

    a, b = run("a"), run("b", perturb=True)
    if shutil.which("dot") is None:
        with pytest.raises(od.DebugError, match="Graphviz dot is not installed"):
            od.render_graph_html(a, layout="dot")
        pytest.skip("Graphviz dot not installed (make test installs Debian's graphviz when run as root)")
    text = od.render_graph_html(a, diff_with=b, layout="dot")
    first = od.diff(a, b).first.a
    assert "Laid out by Graphviz dot" in text
    # dot keeps the node ids; the divergent node is drawn with the red outline
    node = text[text.index(f'id="o{first["i"]}"'):]
    assert "#c00000" in node[:node.index("</g>")]


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz dot is not installed (make test installs it)")
def test_dot_layout_draws_every_op_and_stays_self_contained(tmp_path):
    dump, _, _ = _capture_step(tmp_path)
    text = od.render_graph_html(dump, tmp_path / "d.html", layout="dot")
    assert "<script" not in text and "<link" not in text
    # only XML namespace names, never fetched: SVG's and XLink's (Graphviz writes both)
    assert set(re.findall(r"https?://[^\"' ]+", text)) <= {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}
    fwd_ids = [it["id"] for it in forward_graph(dump)[0] if it["kind"] == "op"]
    assert len(fwd_ids) == len(dump.forward_ops())
    for oid in fwd_ids:  # every op is a laid-out node of the SVG, under its own id
        assert f'id="{oid}"' in text, oid
