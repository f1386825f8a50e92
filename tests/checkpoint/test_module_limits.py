"""Size limits of the checkpoint package (issue 42): a reader finds a module's role in a screenful of names, so no
module is over 700 lines and no function over 100; an alias left at an old path holds no code."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "src" / "oarlock" / "checkpoint"
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 100


def _modules() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def test_no_module_over_700_lines():
    over = {str(p.relative_to(PKG)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_no_function_over_100_lines():
    over = []
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    over.append(f"{p.relative_to(PKG)}:{node.lineno} {node.name} ({n} lines)")
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(over)


def test_old_paths_are_aliases_without_code():
    """A module left at an old path either re-exports (objectstore) or makes itself the moved module: it defines no
    function or class of its own, so there is one copy of every piece of code."""
    aliases = [p for p in PKG.glob("*.py") if "sys.modules[__name__] = _moved" in p.read_text()]
    assert len(aliases) >= 20  # the moves of issue 42 (dist, save, load, sharded, ...)
    for p in aliases + [PKG / "objectstore.py"]:
        defs = [n.name for n in ast.parse(p.read_text()).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        assert defs in ([], ["__getattr__"]), f"{p.name} defines {defs}"
