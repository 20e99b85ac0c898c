"""Module attributes imported on first access (PEP 562), torch-free.

A package whose public names need torch exposes them through :func:`attributes`, so
importing the package (or a torch-free submodule of it, as the parameter server does)
does not import torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def attributes(package: str, where: dict[str, str], namespace: dict[str, Any]
               ) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: attribute ``name`` is
    ``package.<where[name]>.name``, imported on first access and then stored in
    ``namespace`` (the package's ``globals()``), so later accesses are plain lookups."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    return __getattr__
