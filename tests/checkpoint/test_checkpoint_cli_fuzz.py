"""Fuzz of the checkpoint subcommands of the CLI (issue 21): ``inspect``, ``convert`` and ``aoa explain`` given
random bytes or random JSON in every file they read answer with exit 2 and one line naming the file -- never a
traceback -- and write nothing (or, for an input that happens to be valid, succeed)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oarlock.checkpoint import save_state_dict
from oarlock.cli import main

_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                     max_leaves=12)
_contents = st.one_of(st.binary(max_size=256), _json.map(lambda v: json.dumps(v).encode()),
                      st.builds(lambda n: b"[" * n + b"]" * n, st.integers(1, 50_000)))  # deeply nested

# (where the random file goes, the command; {f} = that file, {ck} = a valid checkpoint, {out} = the output path)
_TARGETS = [
    ("x.safetensors", ["inspect", "{f}"]),
    ("x.safetensors", ["convert", "{f}", "{out}"]),
    ("d/metadata.json", ["inspect", "{d}"]),
    ("d/metadata.json", ["convert", "{d}", "{out}", "--to", "hf"]),
    ("d/model.safetensors", ["inspect", "{d}"]),
    ("d/model.safetensors.index.json", ["convert", "{d}", "{out}"]),
    ("d/0.metadata", ["inspect", "{d}"]),
    ("aoa.txt", ["aoa", "explain", "{f}", "--source", "{ck}"]),
    ("keys.json", ["aoa", "explain", "{cfg}", "--source", "{ck}", "--target", "{f}"]),
    ("aoa.json", ["convert", "{ck}", "{out}", "--aoa", "{f}"]),
    ("rules.json", ["convert", "{ck}", "{out}", "--to", "oarlock", "--tp", "2", "--tp-rules", "{f}"]),
]


@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory) -> Path:
    ck = tmp_path_factory.mktemp("fuzz") / "ck"
    save_state_dict({"w": torch.arange(6.0).reshape(2, 3)}, ck)
    return ck


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"" for p in sorted(root.rglob("*"))}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.sampled_from(_TARGETS), content=_contents)
def test_cli_on_random_files_exits_2_with_one_line(good_ckpt, capsys, target, content):
    where, argv = target
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        f = tmp / where
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(content)
        (tmp / "cfg.txt").write_text("w -> w\n")
        before = _tree(tmp)
        subst = {"{f}": str(f), "{d}": str(f.parent), "{ck}": str(good_ckpt), "{out}": str(tmp / "out"),
                 "{cfg}": str(tmp / "cfg.txt")}
        args = [subst.get(a, a) for a in argv]
        capsys.readouterr()
        rc = main(args)
        err = capsys.readouterr().err
        if rc == 0:  # the random file happened to be a valid input (e.g. an empty AOA config)
            return
        lines = err.strip().splitlines()
        assert rc == 2, (args, content[:80], err)
        assert lines and lines[0].startswith("oarlock: error: ") and "Traceback" not in err, (args, content[:80], err)
        if argv[:2] != ["aoa", "explain"]:  # explain prints an AOA error's statement and caret under it by design
            assert len(lines) == 1, (args, content[:80], err)
        # an error inside a valid config names the statement (aoa_statements[i], column) or the TP rule instead
        assert f.name in lines[0] or str(f.parent) in lines[0] or "aoa_statements[" in lines[0] \
            or "TP rule '" in lines[0], (args, err)
        assert _tree(tmp) == before, (args, content[:80])  # nothing written
        assert not any(n.startswith(".") for n in os.listdir(tmp)), os.listdir(tmp)
