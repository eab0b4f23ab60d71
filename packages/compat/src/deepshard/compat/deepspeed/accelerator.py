"""``deepspeed.accelerator.get_accelerator()``: the device calls scripts make, on torch.

One object for this host: CUDA where a GPU exists, else the CPU (as DeepSpeed's cuda and cpu
accelerators answer; the communication backend is the one deepshard uses: nccl or gloo).
"""

from __future__ import annotations

from typing import Any

import torch


class Accelerator:
    """The subset of DeepSpeed's ``DeepSpeedAccelerator`` that training scripts call."""

    def __init__(self) -> None:
        self._name = "cuda" if torch.cuda.is_available() else "cpu"

    # --- devices
    def device_name(self, device_index: int | None = None) -> str:
        if self._name == "cpu" or device_index is None:
            return self._name
        return f"{self._name}:{device_index}"

    def current_device_name(self) -> str:
        return self.device_name(self.current_device() if self._name == "cuda" else None)

    def device(self, device_index: int | None = None) -> Any:
        return torch.cuda.device(device_index) if self._name == "cuda" else None

    def set_device(self, device_index: int) -> None:
        if self._name == "cuda":
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._name == "cuda" else 0

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._name == "cuda" else 1

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return "nccl" if self._name == "cuda" else "gloo"

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._name == "cuda" else tensor  # pinning needs an accelerator

    # --- dtypes
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._name == "cuda" else True

    def is_fp16_supported(self) -> bool:
        return self._name == "cuda"  # on CPU, deepshard trains an fp16 ds_config in fp32 (one-line notice)

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32, torch.bfloat16]
        return dtypes + [torch.float16] if self.is_fp16_supported() else dtypes

    # --- random numbers
    def manual_seed(self, seed: int) -> None:
        if self._name == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._name == "cuda":
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._name == "cuda" else torch.initial_seed()

    def random(self) -> Any:
        return torch.random

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state(device_index or "cuda") if self._name == "cuda" else torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.set_rng_state(new_state, device_index or "cuda")
        else:
            torch.set_rng_state(new_state)

    # --- memory (CPU answers 0: scripts print these)
    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._name == "cuda" else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._name == "cuda" else 0

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._name == "cuda" else 0

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._name == "cuda" else 0

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.reset_peak_memory_stats(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        if self._name == "cuda":
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    # --- streams and markers: no-ops on CPU
    def range_push(self, msg: str) -> None:
        return None

    def range_pop(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"get_accelerator().{name}: not provided by deepshard.compat.deepspeed (it offers the "
                             f"device, dtype, seed and memory calls; use torch.{self._name} directly)")


_ACCELERATOR = Accelerator()


def get_accelerator() -> Accelerator:
    return _ACCELERATOR
