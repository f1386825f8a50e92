"""Trace loaders and writer, the MoE synthesiser, region tracing, summaries, views (headless Chromium), CLI."""

import json
from collections import Counter
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oarlock.cli import main
from oarlock.memory import (MoEConfig, TraceFormatError, UnsafeTraceError, load_trace, memory_summary,
                            render_memory_html, render_png, synthesize_moe, trace_from_ops, trace_region)
from oarlock.memory.trace import trace_from_chrome

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20
SMALL = dict(layers=2, hidden=256, ffn=128, experts=8, local_experts=2, topk=2, tokens=256, steps=2, vocab=512)


def test_snapshot_roundtrip_pickle_and_json(tmp_path):
    tr = synthesize_moe(**SMALL)
    for name in ("t.pickle", "t.json"):
        back = load_trace(tr.save(tmp_path / name))
        assert back.events == tr.events and back.ops() == tr.ops() and back.marks == tr.marks
    # step 1 starts with a micro-batch's embedding output, after step 0's two lm-head passes
    k = tr.marks["step1"]
    assert tr.events[k]["action"] == "alloc" and tr.events[k]["frames"][0]["name"] == "embed.output"
    assert sum(e["action"] == "alloc" and e["frames"][0]["name"] == "lm_head.logits" for e in tr.events[:k]) == 2
    # torch's own snapshot tooling reads what we write
    from torch.cuda import _memory_viz

    assert "alloc" in _memory_viz.trace(tr.to_snapshot()) or _memory_viz.trace(tr.to_snapshot())


def test_loader_rejects_unsafe_and_malformed(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / "evil.pickle").write_bytes(pickle.dumps({"device_traces": [[Evil()]]}))
    with pytest.raises(UnsafeTraceError, match=r"evil.pickle: refuses to unpickle builtins.print"):
        load_trace(tmp_path / "evil.pickle")
    (tmp_path / "x.json").write_text(json.dumps({"segments": []}))
    with pytest.raises(TraceFormatError, match="x.json: not a memory snapshot"):
        load_trace(tmp_path / "x.json")
    (tmp_path / "y.json").write_text(json.dumps({"device_traces": [[{"action": "alloc", "addr": 1}]]}))
    with pytest.raises(TraceFormatError, match=r"y.json device 0: event 0 \(alloc\) has bad 'size'"):
        load_trace(tmp_path / "y.json")
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.pickle")
    with pytest.raises(TraceFormatError, match="MoEConfig.layers"):
        MoEConfig(layers=0)


def test_ops_pair_frees_and_peak_matches_independent_count():
    ops = [("a", 0, 1000), ("a", 1, 5000), ("f", 0), ("a", 2, 300), ("f", 1), ("f", 2)]
    tr = trace_from_ops(ops)
    assert [(o.kind, o.id, o.size) for o in tr.ops()] == [(t[0], t[1], 1000 if t[1] == 0 else 5000 if t[1] == 1
                                                          else 300) for t in ops]
    assert tr.peak_allocated == 6000 and len(tr.peak_blocks()) == 2


def test_synthetic_moe_is_seeded_and_sized_by_hand():
    a, b = synthesize_moe(**SMALL, seed=1), synthesize_moe(**SMALL, seed=1)
    assert a.events == b.events and a.events != synthesize_moe(**SMALL, seed=2).events
    H, F, E, le = 256, 128, 8, 2
    params = [e["size"] for e in a.events if e.get("category") == "parameter"]
    assert sorted(params) == sorted([2 * H * 512] + [2 * (4 * H * H + 2 * H)] * 2 + [2 * (le * 3 * H * F + H * E)] * 2)
    # dense activations have fixed sizes; expert buffers vary with routing (more with more imbalance)
    assert {e["size"] for e in a.events if e["action"] == "alloc" and e["frames"][0]["name"] == "layer0.qkv"} == \
        {2 * 256 * 3 * H}

    def spread(imb):
        t = synthesize_moe(**{**SMALL, "steps": 4}, imbalance=imb)
        s = [e["size"] for e in t.events if e["action"] == "alloc" and e["frames"][0]["name"] == "layer1.experts.fc1"]
        return max(s) / min(s)

    assert spread(0.0) < 1.01 < spread(1.0)
    # everything but parameters, grads and optimizer state is freed by the end of the trace
    live_end = synthesize_moe(**SMALL, recompute=True, pipeline_stages=2).live_bytes()[-1]
    tr = synthesize_moe(**SMALL, recompute=True, pipeline_stages=2)
    keep = sum(e["size"] for e in tr.events if e.get("category") in ("parameter", "gradient", "optimizer"))
    assert live_end == keep


def _mlp_step():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    x = torch.randn(32, 64)
    return m, x


def test_trace_region_cpu_profiler_matches_chrome_export(tmp_path):
    m, x = _mlp_step()
    with trace_region("mlp step", device="cpu", path=tmp_path / "r.pickle") as region:
        torch.zeros(3)  # torch 2.13's profile-to-snapshot conversion drops the region's first allocation
        keep = torch.ones(12345, dtype=torch.float32)
        m(x).sum().backward()
    tr = region.trace
    assert tr is not None and tr.source == "mlp step" and load_trace(tmp_path / "r.pickle").events == tr.events
    ours = [e for e in tr.events if e["action"] == "alloc"]
    hit = [e for e in ours if e["size"] == 12345 * 4]
    assert hit and any("test_trace_observe.py" in f["name"] for f in hit[0]["frames"])
    # the profiler's own chrome trace (an independent path) records the same allocation sizes
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        torch.zeros(3)
        keep2 = torch.ones(12345, dtype=torch.float32)
        m(x).sum().backward()
    prof.export_chrome_trace(str(tmp_path / "c.json"))
    chrome = load_trace(tmp_path / "c.json")
    theirs = Counter(e["size"] for e in chrome.events if e["action"] == "alloc")
    mine = Counter(e["size"] for e in ours)
    assert not mine - theirs and sum((theirs - mine).values()) <= 1  # all but the dropped first one
    assert trace_from_chrome(json.loads((tmp_path / "c.json").read_text())).ops() == chrome.ops()
    del keep, keep2


def test_memory_summary_tables():
    tr = trace_from_ops([("a", 0, 12 * MiB), ("a", 1, 12 * MiB), ("f", 0), ("a", 2, 100)])
    text = memory_summary(tr, "caching")
    assert "Max Reserved" in text and "24.00 MiB" in text  # two 12 MiB segments
    line = next(l for l in text.splitlines() if l.startswith("large"))
    assert line.split()[1:4] == ["2", "1", "1"]  # blocks, used, free
    dist = text.split("== Block Size Distribution ==")[1]
    assert re.search(r"\[8 MiB, 16 MiB\)\s+1\s+1", dist)  # the freed 12 MiB segment and the live one
    # 100 B -> one 512 B used block in a 2 MiB small segment whose 2 MiB - 512 B rest is free
    assert re.search(r"\[0 B, 1 MiB\)\s+0\s+1", dist) and re.search(r"\[1 MiB, 2 MiB\)\s+1\s+0", dist)


def test_memory_summary_of_torch_snapshot_segments():
    from oarlock.memory.observe import SegmentState

    segs = [{"address": 1 << 30, "total_size": 2 * MiB, "stream": 0, "segment_type": "small",
             "blocks": [{"size": 512, "state": "active_allocated"}, {"size": 2 * MiB - 512, "state": "inactive"}]},
            {"address": 1 << 31, "total_size": 20 * MiB, "stream": 0, "segment_type": "large",
             "blocks": [{"size": 4 * MiB, "state": "active_allocated"}, {"size": 6 * MiB, "state": "inactive"},
                        {"size": 10 * MiB, "state": "active_pending_free"}]}]
    text = memory_summary(SegmentState(segs))
    assert re.search(r"^Reserved\s+22\.00 MiB$", text, re.M)
    allocated = 512 + 4 * MiB + 10 * MiB
    assert f"Cur waste rate (reserved - allocated) / reserved  {100 * (1 - allocated / (22 * MiB)):.2f}%" in text
    line = next(l for l in text.splitlines() if l.startswith("large/s0"))
    assert line.split()[1:4] == ["3", "2", "1"]
    if not torch.cuda.is_available():
        with pytest.raises(Exception, match="no CUDA device"):
            memory_summary()


def test_html_view_renders_in_headless_chromium(tmp_path, headless_chromium):
    tr = synthesize_moe(**SMALL)
    page = render_memory_html(tr, tmp_path / "v.html")
    text = page.read_text()
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text
    expected = len(tr.peak_blocks())  # live allocations at the first peak, counted from the events
    r = headless_chromium("--dump-dom", page.as_uri())
    dom = r.stdout
    assert dom.count('class="block"') == expected > 10
    assert dom.count('class="live"') == 1
    assert f"{expected} blocks spanning" in dom
    largest = dom[dom.index('id="largest"'):]
    assert largest.count("<tr>") == 1 + 20  # header + the 20 largest blocks
    png = render_png(tr, tmp_path / "v.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_simulate_view_synth(tmp_path, capsys):
    p = tmp_path / "moe.pickle"
    assert main(["memory", "synth", str(p), "--layers", "2", "--hidden", "256", "--ffn", "128", "--experts", "8",
                 "--local-experts", "2", "--topk", "2", "--tokens", "256", "--steps", "2"]) == 0
    capsys.readouterr()
    assert main(["memory", "simulate", str(p), "--allocators", "caching,remap,oracle", "--json"]) == 0
    rows = {r["allocator"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["oracle"]["peak_reserved"] >= rows["oracle"]["peak_allocated"] == load_trace(p).peak_allocated
    assert rows["caching"]["min_capacity"] <= rows["caching"]["peak_reserved"]
    assert main(["memory", "simulate", str(p), "--allocators", "caching,expandable", "--no-min-capacity"]) == 0
    out = capsys.readouterr().out
    assert "frag %" in out and "expandable" in out
    assert main(["memory", "view", str(p), "-o", str(tmp_path / "v.html")]) == 0
    assert (tmp_path / "v.html").is_file() and (tmp_path / "v.png").is_file()
    r = subprocess.run([sys.executable, "-m", "oarlock.cli", "memory", "simulate", str(p), "--allocators", "x"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().startswith("oarlock: error: unknown allocator 'x'")
    capsys.readouterr()
    assert main(["memory", "simulate", str(p), "--capacity", "lots"]) == 2
    assert "--capacity: cannot parse 'lots'" in capsys.readouterr().err
