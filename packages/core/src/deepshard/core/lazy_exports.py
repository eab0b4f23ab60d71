"""A package's public names imported on first use (PEP 562), so importing one small submodule
(``deepshard.core.checkpoint.owners`` for the launcher's heartbeat) does not import the whole package
(torch, DTensor, the engine: ~2 s of CPU in every launcher process)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package`` whose names live in submodules
    (``{"deepshard.core.engine": ("Engine", "initialize"), ...}``); each name is bound on first access."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        try:
            module = where[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__
