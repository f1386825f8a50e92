"""``oarlock debug diff/render/show`` and ``log_scope``."""

import io
import json
import logging
import subprocess
import sys
import threading

import pytest

import oarlock.debug as od
from oarlock.cli import main

def test_debug_subcommands_have_help(capsys):
    for sub in ("diff", "render", "show"):
        with pytest.raises(SystemExit) as e:
            main(["debug", sub, "--help"])
        assert e.value.code == 0
        assert f"usage: oarlock debug {sub}" in capsys.readouterr().out


def test_diff_render_show(run, tmp_path, capsys):
    a, b = run("a", save_tensors=64), run("b", save_tensors=64)
    c = run("c", perturb=True, save_tensors=64)
    assert main(["debug", "diff", str(a), str(b)]) == 0
    assert "no divergence" in capsys.readouterr().out
    assert main(["debug", "diff", str(a), str(c)]) == 1
    out = capsys.readouterr().out
    assert "first divergence" in out and "module layers.1.fc" in out and "parameter layers.1.fc.weight" in out
    assert main(["debug", "diff", "--json", str(a), str(c)]) == 1
    rep = json.loads(capsys.readouterr().out)
    api = od.diff(a, c)
    assert rep["first"]["a"]["i"] == api.first.a["i"] and rep["mismatched"] == api.mismatched

    html = tmp_path / "out" / "g.html"
    assert main(["debug", "render", str(c), "-o", str(html), "--dot"]) == 0
    written = capsys.readouterr().out.split()
    assert written[0] == str(html) and html.read_text().startswith("<!DOCTYPE html>")
    assert [p.rsplit(".", 2)[-2:] for p in written[1:]] == [["forward", "dot"], ["backward", "dot"]]
    assert all(open(p).read().startswith("digraph") for p in written[1:])  # parsed in test_graph.py
    assert main(["debug", "show", str(a), "--limit", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and "aten.native_layer_norm.default" in lines[1]


def test_bad_inputs_are_one_line_exit_2(run, tmp_path, capsys):
    a = run("a")
    none = run("n", checksum=None)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"k": "header", "format": "something-else"}\n')
    cases = [([str(a), str(tmp_path / "missing.jsonl")], "missing.jsonl"),
             ([str(a), str(bad)], "bad.jsonl:1: not an oarlock debug capture"),
             ([str(a), str(none)], "checksum=None")]
    for k, (args, msg) in enumerate(cases):
        if k == 0:  # one real process: the console entry point prints one line, no traceback
            r = subprocess.run([sys.executable, "-m", "oarlock.cli", "debug", "diff", *args], capture_output=True,
                               text=True)
            rc, err = r.returncode, r.stderr
        else:
            rc = main(["debug", "diff", *args])
            err = capsys.readouterr().err
        assert rc == 2, err
        assert err.count("\n") == 1 and msg in err and "Traceback" not in err


def test_log_scope_only_inside_the_block_and_thread(tmp_path):
    log = logging.getLogger("oarlock.debug")
    before = log.level
    buf = io.StringIO()
    log.debug("before the scope")
    other_done = threading.Event()
    with od.log_scope("DEBUG", modules=["debug"], stream=buf):
        log.debug("inside %d", 1)
        logging.getLogger("oarlock.checkpoint").warning("other package")  # not enabled
        t = threading.Thread(target=lambda: (log.debug("from another thread"), other_done.set()))
        t.start()
        t.join()
        with od.capture(tmp_path / "x.jsonl", checksum=None):
            pass  # the capture logs at INFO when it starts and ends
    log.debug("after the scope")
    text = buf.getvalue()
    assert "inside 1" in text and "capture started" in text and "capture written" in text
    assert "before" not in text and "after" not in text and "other package" not in text
    assert other_done.is_set() and "another thread" not in text
    assert log.level == before
    with pytest.raises(od.DebugError, match="level="):
        with od.log_scope("LOUD"):
            pass


def test_diff_of_missing_dumps_names_the_file(tmp_path, capsys):
    from oarlock.cli import main

    missing = tmp_path / "nope.jsonl"
    assert main(["debug", "diff", str(missing), str(missing)]) == 2
    err = capsys.readouterr().err
    assert err == f"oarlock: error: {missing}: no such file (expected a capture dump written by oarlock.debug.capture)\n"
