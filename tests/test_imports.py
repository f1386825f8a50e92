"""Module hygiene of the whole package, read from the source with ``ast`` (function-level imports included,
``if TYPE_CHECKING:`` blocks excluded): no import cycle between oarlock modules, and no ``_private`` name
imported from another oarlock module."""

import ast
import importlib
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted((SRC / "oarlock").rglob("*.py")):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path) -> list[tuple[str, str | None, int]]:
    """``(module, imported name or None, line)`` for every oarlock import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.extend((a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "oarlock")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] == "oarlock":
                out.extend((mod, a.name, node.lineno) for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _graph() -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in MODULES}
    for m, p in MODULES.items():
        for mod, name, _ in _imports(m, p):
            target = f"{mod}.{name}" if name and f"{mod}.{name}" in MODULES else mod
            if target in MODULES and target != m:
                g[m].add(target)
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            strong(v)
    return out


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (function-level imports count):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_private_names_imported_across_modules():
    bad = []
    for m, p in MODULES.items():
        for mod, name, line in _imports(m, p):
            if name and name.startswith("_") and not name.startswith("__") and mod != m \
                    and f"{mod}.{name}" not in MODULES:
                bad.append(f"{p.relative_to(SRC)}:{line}: from {mod} import {name}")
    assert not bad, "private names imported from another module:\n" + "\n".join(bad)


def test_the_checker_sees_a_cycle_and_function_level_imports():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(g) == [["a", "b", "c"]]
    here = _imports("oarlock.checkpoint.runtime.load", MODULES["oarlock.checkpoint.runtime.load"])
    assert any(mod == "oarlock.checkpoint.aoa" for mod, _, _ in here)  # imported inside a function


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports(name):
    importlib.import_module(name)
