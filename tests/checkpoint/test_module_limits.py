"""Size limits of the checkpoint package (issue 42): a reader finds a module's role in a screenful of names, so no
module is over 700 lines and no function over 100; and no module is an alias of another (issue 48: one import path
per name, no module left at an old path)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

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


def test_no_module_is_an_alias():
    """No module makes itself another (``sys.modules[__name__] = ...``) or says it moved: oarlock 0.1.0 was never
    released, so the old paths of issue 42's moves are gone rather than kept as aliases."""
    aliases = []
    for p in _modules():
        text = p.read_text()
        tree = ast.parse(text)
        doc = ast.get_docstring(tree) or ""
        swaps = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assign) and any(
            isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and t.value.attr == "modules"
            and isinstance(t.value.value, ast.Name) and t.value.value.id == "sys" for t in n.targets)]
        if swaps or doc.startswith("Moved") or "Moved:" in text:
            aliases.append(f"{p.relative_to(PKG)} (sys.modules at lines {swaps})" if swaps else str(p.relative_to(PKG)))
    assert not aliases, f"alias modules: {aliases}"


def test_old_paths_are_gone():
    """Every old path of issue 42's moves fails to import."""
    old = ["async_save", "balance", "comm", "commands", "diff", "dist", "executor", "full", "grid", "hf", "live",
           "load", "manager", "mapping", "metadata", "objectstore", "optim", "paddle", "plan", "presets", "reader",
           "safetensors_io", "save", "sharded", "transfer", "traversal"]
    present = sorted(p.stem for p in PKG.glob("*.py") if p.stem in old)
    assert not present, f"modules at old paths: {present}"
    for name in old:
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"oarlock.checkpoint.{name}")
