"""A package's public names imported on first use (PEP 562 ``__getattr__``), so a process
that needs one light module of the package does not import the heavy ones with it."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_getattr(package: str, where: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The package's ``__getattr__``: name -> getattr(import_module(where[name]), name), kept in
    namespace (the package's globals) after the first use."""
    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value
    return __getattr__
