"""The memory page on real CPU traces: phase markers from nested trace_region scopes at the right event,
a size x lifetime view instead of host addresses, repeated allocations of one block merged, short reprs,
and a look in headless Chromium."""

import torch

from oarlock.memory import render_memory_html, trace_from_ops, trace_region
from oarlock.memory.observe import LIFETIME_BUCKETS, SIZE_BUCKETS, view_data

BEFORE, INSIDE = 123_457 * 4, 98_761 * 4  # distinctive allocation sizes (bytes), found again in the trace


def _train_trace():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    keep = []
    with trace_region("train", device="cpu") as region:
        for _ in range(2):
            keep.append(torch.ones(BEFORE // 4))
            with trace_region("step"):
                keep.append(torch.ones(INSIDE // 4))
                model(torch.randn(32, 64)).sum().backward()
                region.mark("optimizer")
                opt.step()
                opt.zero_grad()
    return region


def test_nested_regions_mark_steps_at_the_right_events():
    region = _train_trace()
    tr = region.trace
    assert set(tr.marks) == {"step", "step#2", "optimizer", "optimizer#2"}
    allocs = [k for k, e in enumerate(tr.events) if e["action"] == "alloc"]
    before = [k for k in allocs if tr.events[k]["size"] == BEFORE]
    inside = [k for k in allocs if tr.events[k]["size"] == INSIDE]
    assert len(before) == len(inside) == 2
    for n, key in enumerate(("step", "step#2")):
        assert before[n] < tr.marks[key] <= inside[n]  # the step starts between the two allocations
    assert tr.marks["step"] < tr.marks["optimizer"] < tr.marks["step#2"] < tr.marks["optimizer#2"]
    assert len(repr(region)) < 300 and "events=" in repr(tr)


def test_cpu_view_has_size_lifetime_grid_and_no_address_panel(tmp_path):
    tr = _train_trace().trace
    d = view_data(tr)
    assert d["cpu"] and d["blocks"] == []
    cells = d["size_lifetime"]["cells"]
    assert len(cells) == len(SIZE_BUCKETS) and all(len(r) == len(LIFETIME_BUCKETS) for r in cells)
    allocs = [e for e in tr.events if e["action"] == "alloc"]
    assert sum(c[0] for r in cells for c in r) == len(allocs)
    assert sum(c[1] for r in cells for c in r) == sum(e["size"] for e in allocs)
    # the two INSIDE tensors stay alive (kept in a list) until the end: last lifetime column, 64 KiB-1 MiB row
    assert cells[1][-1][0] >= 2
    assert sorted(name for _, name in d["marks"]) == ["optimizer", "optimizer#2", "step", "step#2"]
    # saved and loaded, the trace is still a host trace with its marks
    p = tr.save(tmp_path / "cpu.json")
    from oarlock.memory import load_trace

    back = load_trace(p)
    assert back.device == -1 and back.marks == tr.marks
    from oarlock.memory import render_png

    png = render_png(back, tmp_path / "cpu.png")  # the size x lifetime panel instead of addresses
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_largest_blocks_merge_repeated_allocations_of_one_block():
    ops = []
    for step in range(5):  # the same 108 MiB block allocated and freed each step
        ops += [("a", f"big{step}", 108 << 20), ("a", f"s{step}", 1 << 20), ("f", f"big{step}"), ("f", f"s{step}")]
    tr = trace_from_ops(ops)
    addrs = {e["addr"] for e in tr.events if e["action"] == "alloc" and e["size"] == 108 << 20}
    assert len(addrs) == 1  # first fit reuses the block
    d = view_data(tr, top=5)
    assert [(b["size"], b["count"]) for b in d["largest"]] == [(108 << 20, 5), (1 << 20, 5)]


def test_cpu_page_in_chromium_shows_markers_grid_and_no_blocks(tmp_path, headless_chromium):
    tr = _train_trace().trace
    page = render_memory_html(tr, tmp_path / "m.html")
    r = headless_chromium("--dump-dom", page.as_uri())
    dom = r.stdout
    assert dom.count('class="mark"') == 4 and dom.count('class="marklabel"') == 4
    assert 'class="block"' not in dom and 'id="addr" style="display: none;"' in dom
    grid = dom[dom.index('id="grid"'):dom.index("</table>", dom.index('id="grid"'))]
    assert grid.count("<tr>") == 1 + len(SIZE_BUCKETS)
