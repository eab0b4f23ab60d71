"""Package namespaces that import a name's module on first use (PEP 562).

A package ``__init__`` that imports every submodule makes each process pay for all of them: the app's
launcher starts the workers' server before it imports torch (``deepshard.launch.worker_server``), which
an eager ``deepshard.launch`` or ``deepshard.core`` would defeat.  The packages export the same names.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, homes: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``homes`` maps each exported name to its submodule."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{home}"), name)
        namespace[name] = value  # once: later lookups find it without this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(homes))

    return __getattr__, __dir__
