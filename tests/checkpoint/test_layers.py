"""The checkpoint package laid out by role (issue 42): what each pure layer may import, read from the source with
``ast`` (function-level imports count). ``model/`` is data only: it imports nothing of the checkpoint package
outside itself but the errors; ``planning/`` adds the data model, nothing with I/O or communication. (That no module
is left at an old path is tested in test_module_limits.py.)"""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "src" / "oarlock" / "checkpoint"

#: layer -> checkpoint modules (dotted, relative to oarlock.checkpoint) its modules may import
ALLOWED = {
    "model": ("model", "errors"),
    "planning": ("planning", "model", "errors"),
}


def _checkpoint_imports(path: Path) -> list[tuple[str, int]]:
    """``(module relative to oarlock.checkpoint, line)`` of every import of the checkpoint package in ``path``."""
    package = "oarlock.checkpoint." + ".".join(path.relative_to(PKG).parent.parts)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            names = [f"{mod}.{a.name}" for a in node.names] if mod == "oarlock.checkpoint" else [mod]
        out += [(n[len("oarlock.checkpoint."):], node.lineno) for n in names if n.startswith("oarlock.checkpoint.")]
    return out


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_pure_layers_import_only_what_is_below_them(layer):
    bad = [f"{p.relative_to(PKG)}:{line}: imports oarlock.checkpoint.{mod}"
           for p in sorted((PKG / layer).rglob("*.py")) for mod, line in _checkpoint_imports(p)
           if mod.split(".")[0] not in ALLOWED[layer]]
    assert not bad, f"{layer}/ may import only {ALLOWED[layer]}:\n" + "\n".join(bad)
