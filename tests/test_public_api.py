"""The public surface that is kept (issue 48 item 7): each package's ``__all__`` and the ``oarlock`` commands.

Every name of a package's ``__all__`` imports and is documented (a class or function has a docstring of its own, a
constant a ``#:`` comment, an attribute docstring or a mention in its package's docstring); the names users and
issues rely on stay in ``__all__``; ``oarlock --help`` lists every command. Where a name is defined is not part of
the surface: internals move without an edit here (there are no alias modules at old paths, see
``tests/checkpoint/test_module_limits.py``)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

PACKAGES = ("oarlock.checkpoint", "oarlock.attention", "oarlock.memory", "oarlock.debug", "oarlock.models",
            "oarlock.integrations.vllm")

#: Names that stay public whatever moves: oarlock.checkpoint's surface as of 0.1.0 (the names the README, the docs
#: and the issues use).
KEPT = {
    "oarlock": ["OarlockError", "__version__"],
    "oarlock.checkpoint": [
        "AsyncSaveHandle", "COMM_METHODS", "CheckpointDestinationError", "CheckpointError", "CheckpointFormatError",
        "CheckpointManager", "CheckpointMetadata", "CheckpointMismatchError", "CheckpointReader",
        "CheckpointTilingError", "ChecksumError", "ConversionLayout", "ConversionPlan", "FlatPartition",
        "IdentityProgram", "LoadPlan", "LoadReport", "MappingProgram", "ObjectPath", "ObjectStoreError",
        "OptimizerHyperparameterWarning", "OptimizerState", "OptimizerStateError", "ParallelLayout", "PeerGroup",
        "RNGState", "RankLocal", "ReadItem", "ReshardReport", "ShardDesc", "ShardMeta", "ShardedWeight",
        "SliceMapping", "TensorMeta", "TensorSpec", "UnsafePickleError", "UnsupportedLocationError", "WeightSync",
        "async_save", "convert_checkpoint", "detect_format", "export_hf", "export_hf_sharded", "full_state_dict",
        "iter_full_tensors", "join_group", "load_sharded_optimizer_state_dict", "load_state_dict", "location",
        "open_checkpoint", "plan_conversion", "plan_load", "read_metadata", "reshard_state_dict",
        "save_hf_checkpoint", "save_state_dict", "sharded_optimizer_state_dict", "sharded_state_dict"],
}

COMMANDS = ("inspect", "convert", "diff", "verify", "aoa", "memory", "debug", "demo")


def _own_doc(obj) -> str:
    """``obj``'s own docstring (a class's, not one inherited from its bases)."""
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    return doc if isinstance(doc, str) else ""


def _data_documented(pkg: types.ModuleType, name: str) -> bool:
    """A constant is documented by a comment on the line above an assignment of it (``#:``, the form Sphinx and
    mkdocstrings read, or a comment explaining the branch that sets it), an attribute docstring after it, or a
    mention in its package's docstring."""
    if name in (pkg.__doc__ or ""):
        return True
    files = sorted(Path(pkg.__file__).parent.rglob("*.py")) if pkg.__file__.endswith("__init__.py") \
        else [Path(pkg.__file__)]
    for f in files:
        text = f.read_text()
        if name not in text:
            continue
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            body = getattr(node, "body", None)
            if not isinstance(body, list):
                continue
            for i, stmt in enumerate(body):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else \
                    [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
                if not any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    continue
                above = lines[stmt.lineno - 2] if stmt.lineno > 1 else ""
                after = body[i + 1] if i + 1 < len(body) else None
                if "#" in above or (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                                    and isinstance(after.value.value, str)):
                    return True
    return False


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_imports_and_is_documented(package):
    pkg = importlib.import_module(package)
    assert pkg.__doc__ and pkg.__doc__.strip(), f"{package} has no docstring"
    names = list(pkg.__all__)
    assert len(names) == len(set(names)), f"{package}.__all__ lists a name twice"
    missing, undocumented = [], []
    for name in names:
        try:
            obj = getattr(pkg, name)
        except AttributeError:
            missing.append(name)
            continue
        if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType)) or callable(obj):
            if not _own_doc(obj).strip():
                undocumented.append(name)
        elif not _data_documented(pkg, name):
            undocumented.append(name)
    assert not missing, f"{package}.__all__ names what the package does not provide: {missing}"
    assert not undocumented, f"{package}: public names without documentation: {undocumented}"
    # `from package import *` gives exactly __all__
    ns: dict = {}
    exec(f"from {package} import *", ns)  # noqa: S102 - the statement users write
    assert set(names) <= set(ns), set(names) - set(ns)


@pytest.mark.parametrize("package", sorted(KEPT))
def test_names_users_rely_on_stay_public(package):
    pkg = importlib.import_module(package)
    public = set(getattr(pkg, "__all__", ())) | {"__version__"}
    gone = [n for n in KEPT[package] if n not in public or not hasattr(pkg, n)]
    assert not gone, f"{package} no longer exports {gone}"


def test_issue_names_are_the_documented_objects():
    """The names the issues and the README use, by what they are (a class, a function)."""
    import oarlock.checkpoint as c

    for name in ("ShardedWeight", "CheckpointManager", "OptimizerState", "RNGState", "WeightSync", "ReshardReport"):
        assert inspect.isclass(getattr(c, name)), name
    assert issubclass(c.CheckpointError, Exception)
    for name in ("save_state_dict", "load_state_dict", "export_hf", "sharded_state_dict", "join_group",
                 "async_save"):
        assert inspect.isfunction(getattr(c, name)), name


def test_cli_lists_every_command():
    r = subprocess.run([sys.executable, "-c", "from oarlock.cli import main; main(['--help'])"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    listed = re.findall(r"^    (\S+)\s", r.stdout, re.M)  # argparse's list of subcommands, one per line
    missing = [c for c in COMMANDS if c not in listed]
    assert not missing, f"oarlock --help does not list {missing}:\n{r.stdout}"
