"""PEFT's adapters on a model built under deepshard's ``zero.Init`` (ZeRO-3 through the provider).

Our ``zero.Init`` keeps a model's parameters on the meta device until ``deepspeed.initialize``
(DeepSpeed's keeps a real, empty partition), and PEFT moves each new adapter to its base layer's
device (``_move_adapter_to_device_of_base_layer`` when the adapter is made, each tuner's
``_replace_module`` when it takes the base layer's place): the meta device here, where the adapter's
initial values (LoRA's A drawn, B zero) would be lost.  Under the provider, while PEFT injects adapters
into a model built under ``zero.Init``, a module holding real parameters is not moved onto the meta
device (a dtype asked for still applies); ``initialize`` then shards each adapter from rank 0's values
(``zero.keep_real_params``), as DeepSpeed broadcasts a parameter made outside ``zero.Init``.  Applied
when ``peft.tuners.tuners_utils`` is imported (``hf_cpu``'s import hook); elsewhere PEFT is untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from torch import nn


@contextmanager
def _no_moves_to_meta() -> Iterator[None]:
    original = nn.Module.to

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and device.type == "meta" and any(not p.is_meta for p in self.parameters()):
            return original(self, dtype=dtype) if dtype is not None else self
        return original(self, *args, **kwargs)

    nn.Module.to = to  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.to = original  # type: ignore[method-assign]


def patch_adapter_device(module: ModuleType) -> None:
    """Wrap ``BaseTuner.inject_adapter``: on a model built under ``zero.Init``, new adapters stay real."""
    cls = module.BaseTuner
    original = cls.inject_adapter
    if getattr(original, "_deepshard", False):
        return

    def inject_adapter(self: Any, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        from deepshard.compat.deepspeed.zero import made_under_init

        if not any(made_under_init(m) and any(p.is_meta for p in m.parameters(recurse=False))
                   for m in model.modules()):
            return original(self, model, *args, **kwargs)
        with _no_moves_to_meta():
            return original(self, model, *args, **kwargs)

    inject_adapter._deepshard = True  # type: ignore[attr-defined]
    cls.inject_adapter = inject_adapter
