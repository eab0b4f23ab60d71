"""``deepspeed.compression.helper``: the attribute helpers DeepSpeed's example scripts import."""

from __future__ import annotations

from typing import Any

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: Any, module_name: str) -> Any:
    """``model.a.b.c`` for ``"a.b.c"`` (AttributeError naming the missing part)."""
    out = model
    for part in module_name.split("."):
        out = getattr(out, part)
    return out


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Set ``model.a.b.c = module`` for ``"a.b.c"``."""
    parent, _, last = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, last, module)
