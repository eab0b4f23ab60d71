"""PEFT's adapters on a model built under deepshard's ``zero.Init`` (ZeRO-3 through the provider).

Our ``zero.Init`` keeps a model's parameters on the meta device until ``deepspeed.initialize``
(DeepSpeed's keeps a real, empty partition), and PEFT moves each new adapter to its base layer's
device: the meta device here, where the adapter's initial values (LoRA's A drawn, B zero) would be
lost.  Under the provider an adapter whose base layer was built under ``zero.Init`` stays where PEFT
made it; ``initialize`` then shards it from rank 0's values (``zero.keep_real_params``), as DeepSpeed
broadcasts a parameter made outside ``zero.Init``.  Applied when ``peft.tuners.tuners_utils`` is
imported (``hf_cpu``'s import hook); elsewhere PEFT is untouched.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any


def patch_adapter_device(module: ModuleType) -> None:
    """Wrap ``BaseTunerLayer._move_adapter_to_device_of_base_layer``: no move onto a ``zero.Init`` meta layer."""
    cls = module.BaseTunerLayer
    original = cls._move_adapter_to_device_of_base_layer
    if getattr(original, "_deepshard", False):
        return

    def move(self: Any, adapter_name: str, device: Any = None) -> None:
        if device is None:
            from deepshard.compat.deepspeed.zero import made_under_init

            base = self.get_base_layer()
            weight = getattr(base, "weight", None)
            if weight is not None and weight.is_meta and made_under_init(base):
                return
        original(self, adapter_name, device)

    move._deepshard = True  # type: ignore[attr-defined]
    cls._move_adapter_to_device_of_base_layer = move
