"""The set-up split (issue 42 §4, issue 41 §4): tests never install anything; the Paddle interop tests use
``.paddle-venv`` when ``scripts/paddle_env.sh`` completed it and otherwise skip, naming how to build it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import paddle_venv

TESTS = Path(__file__).resolve().parent
# a side-environment script as a quoted path argument, or `pip install` as a command list
INSTALLS = re.compile(r"""["'](?:scripts/)?\w+_env\.sh["']|["']pip["'],\s*["']install["']""")


def test_no_test_runs_an_installer():
    mine = Path(__file__).resolve()  # this file quotes the pattern's examples
    offenders = [f"{p.relative_to(TESTS)}:{n}" for p in sorted(TESTS.rglob("*.py")) if p != mine
                 for n, line in enumerate(p.read_text().splitlines(), 1) if INSTALLS.search(line)]
    assert offenders == []
    # the pattern catches what the Paddle tests did before (run the script through bash)
    assert INSTALLS.search('subprocess.run(["bash", str(REPO / "scripts" / "paddle_env.sh")])')
    assert not INSTALLS.search('pytest.skip("no .foreign-venv (run scripts/foreign_env.sh)")')


def test_paddle_python_skips_until_the_stamp_exists(tmp_path, monkeypatch):
    venv = tmp_path / ".paddle-venv"
    monkeypatch.setattr(paddle_venv, "VENV", venv)
    (venv / "bin").mkdir(parents=True)  # a venv whose install did not finish: no stamp
    with pytest.raises(pytest.skip.Exception, match=r"make test.*scripts/paddle_env\.sh"):
        paddle_venv.paddle_python()
    (venv / ".oarlock-paddle").write_text("0123456789abcdef\n")
    assert paddle_venv.paddle_python() == str(tmp_path / ".paddle-venv" / "bin" / "python")


def test_the_stamp_name_is_the_scripts():
    script = (TESTS.parent / "scripts" / "paddle_env.sh").read_text()
    assert f'stamp="$V/{paddle_venv.STAMP}"' in script and 'echo "$want" > "$stamp"' in script
