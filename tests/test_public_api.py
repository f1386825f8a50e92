"""Every public import path of today keeps working: each ``(module, name)`` in ``fixtures/public_api.json`` (the
module-level public names of every oarlock module and each package's ``__all__``, recorded on 2026-12-05 before
the checkpoint package is laid out by role) imports. A module moved later keeps a shim at its old path for one
release; a name removed on purpose is taken out of the fixture in the same change, saying why."""

import importlib
import json
from pathlib import Path

import pytest

API = json.loads((Path(__file__).resolve().parent / "fixtures" / "public_api.json").read_text())


@pytest.mark.parametrize("module", sorted(API))
def test_public_names_import(module):
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and not e.name.startswith("oarlock"):  # an optional dependency of this module (vllm, triton)
            pytest.skip(f"{module} needs {e.name}")
        raise
    missing = [n for n in API[module] if not hasattr(mod, n)]
    assert not missing, f"{module} no longer provides {missing}"
