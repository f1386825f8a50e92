"""Hostile or broken input files to the debug and memory subcommands: random bytes, random JSON, empty
files, deeply nested JSON. Each must end with exit code 2 and one error line naming the file, no
traceback, and nothing written."""

import contextlib
import io
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from oarlock.cli import main

COMMANDS = [
    lambda f, out: ["debug", "diff", f, f],
    lambda f, out: ["debug", "show", f],
    lambda f, out: ["debug", "render", f, "-o", out],
    lambda f, out: ["memory", "simulate", f, "--no-min-capacity"],
    lambda f, out: ["memory", "summary", f],
    lambda f, out: ["memory", "view", f, "-o", out],
]
NAMES = ["debug diff", "debug show", "debug render", "memory simulate", "memory summary", "memory view"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["k", "format", "version", "header", "op", "i", "ph", "device_traces", "segments",
                         "traceEvents", "action", "addr", "size", "frames", "name", "args", "stack", "id"])
        | st.text(max_size=5), inner, max_size=5),
    max_leaves=20)


def check_refused(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "input.bin"
        f.write_bytes(data)
        for name, cmd in zip(NAMES, COMMANDS):
            err = io.StringIO()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                try:
                    rc = main(cmd(str(f), str(Path(d) / "out.html")))
                except SystemExit as e:
                    rc = e.code
            msg = err.getvalue()
            assert rc == 2, f"{name} on {data[:60]!r}: exit {rc}, stderr {msg!r}"
            assert msg.count("\n") == 1 and msg.startswith("oarlock: error: ") and str(f) in msg, (name, msg)
            assert sorted(p.name for p in Path(d).iterdir()) == ["input.bin"], name


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
@example(b"\x96\x00\x00\x00\x00\x00\x00\x00\x01")  # BYTEARRAY8 of 2**56 bytes: CPython printed a second line
def test_random_bytes_are_refused_cleanly(data):
    check_refused(data)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_values, st.booleans())
def test_random_json_is_refused_cleanly(value, as_lines):
    text = json.dumps(value)
    if as_lines:  # a header line followed by the random record, as a dump would be
        text = json.dumps({"k": "header", "format": "oarlock-debug-capture", "version": 1}) + "\n" + text
    check_refused(text.encode())


@pytest.mark.parametrize("data", [b"", b"\n\n", b'{"device_traces": []}', b'{"device_traces": [[]], "segments": []}', b"\xff\xfe\x00garbage", b"[" * 100_000 + b"]" * 100_000,
                                  b'{"a":' * 50_000 + b"1" + b"}" * 50_000, b"\x80\x04K\x01.",
                                  json.dumps({"k": "header", "format": "oarlock-debug-capture", "version": 1}).encode()
                                  + b"\n" + b"[" * 100_000])
def test_empty_binary_and_deeply_nested_inputs(data):
    check_refused(data)


_HEADER = json.dumps({"k": "header", "format": "oarlock-debug-capture", "version": 1, "checksum": "fast"})
_END = json.dumps({"k": "end", "ops": 1, "nodes": 0})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["op", "node", "stack"]), st.dictionaries(
    st.sampled_from(["i", "op", "ph", "mod", "in", "out", "src", "h", "st", "fst", "node", "nname", "sv", "id",
                     "name", "next", "grads", "frames", "u"]), json_values, max_size=8))
def test_dump_records_with_wrong_field_types_are_refused_or_read(kind, fields):
    """A record of a known kind with random field values: either refused with one line (exit 2) or read
    (then show and render work: exit 0, output written only by render)."""
    rec = {"k": kind, **fields}
    text = "\n".join([_HEADER, json.dumps(rec), _END]) + "\n"
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "dump.jsonl"
        f.write_text(text)
        for cmd in (["debug", "show", str(f)], ["debug", "render", str(f), "-o", str(Path(d) / "g.html")],
                    ["debug", "diff", str(f), str(f)]):
            err = io.StringIO()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                rc = main(cmd)
            assert rc in (0, 2), (cmd, rc, err.getvalue())
            if rc == 2:
                assert err.getvalue().count("\n") == 1 and str(f) in err.getvalue()
