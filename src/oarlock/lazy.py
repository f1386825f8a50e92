"""Lazy public names for a package ``__init__`` (PEP 562): submodules import on first attribute access, so
``import oarlock.memory`` stays cheap (no torch) while ``dir()``, ``help()`` and tab completion still list
the public names."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any, Callable


def lazy_exports(package: str, names: dict[str, str], eager: dict[str, Any]) -> tuple[
        Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``.

    Args:
        package: the package's ``__name__``.
        names: public name -> submodule (relative to ``package``) defining it, imported on first use.
        eager: the package's module globals (names already defined there, listed by ``__dir__`` as well).

    Raises (from ``__getattr__``): AttributeError naming the package for unknown names.
    """

    def __getattr__(name: str) -> Any:
        if name in names:
            value = getattr(importlib.import_module(f"{package}.{names[name]}"), name)
            eager[name] = value  # later lookups skip __getattr__
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(eager) | set(names))

    class _Package(types.ModuleType):
        # Importing submodule ``pkg.capture`` makes Python set ``pkg.capture`` to that module, hiding the
        # function of the same name; keep the function (what an eager ``from .capture import capture`` did).
        def __setattr__(self, attr: str, value: Any) -> None:
            if (attr in names and isinstance(value, types.ModuleType)
                    and sys.modules.get(f"{package}.{attr}") is value and hasattr(value, attr)):
                value = getattr(value, attr)
            super().__setattr__(attr, value)

    sys.modules[package].__class__ = _Package
    return __getattr__, __dir__
