"""README snippets (issue 29, section 6): every ``python`` block of README.md marked ``<!-- runnable: ... -->``
on the line before its fence runs as written, each in a fresh interpreter in an empty directory (what a new
user pasting it into a file gets). The blocks that need a running job, a trained model or a downloaded checkpoint
(their fills are names the text explains) are not marked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
MARK = "<!-- runnable"


def runnable_blocks(text: str) -> list[tuple[int, str]]:
    """``(line number of the fence, code)`` of every python block whose previous line starts with :data:`MARK`."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.strip() == "```python" and i and lines[i - 1].startswith(MARK):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            out.append((i + 1, "\n".join(lines[i + 1:end]) + "\n"))
    return out


BLOCKS = runnable_blocks(README.read_text())


def test_the_marked_blocks_are_found():
    """The marker survives edits: the four self-contained blocks (FlexCheckpoint save/load, the checkpoint
    manager with RankLocal, optimizer resume, FlashMask) are marked."""
    assert len(BLOCKS) >= 4, [n for n, _ in BLOCKS]
    assert any("RankLocal(loader_pos)" in code and "def state_dict" in code for _, code in BLOCKS)
    assert runnable_blocks("<!-- runnable -->\n```python\nx = 1\n```\n```python\ny\n```\n") == [(2, "x = 1\n")]


@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"README.md:{n}" for n, _ in BLOCKS])
def test_readme_block_runs(tmp_path, line, code):
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"README.md line {line}:\n{code}\n--- stderr:\n{r.stderr[-3000:]}"
