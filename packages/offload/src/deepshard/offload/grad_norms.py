"""The norms of the gradients the parameter swap wrote to NVMe, one per param, in store order.

The swap's hooks (:mod:`.param_swap`) and a tiled unit's rows (:mod:`.tiled_shard`) each write
some params' gradients and record their norms here; the optimizer's global norm and clipping
read them instead of gradients that are no longer in memory.
"""

from __future__ import annotations

import torch


class GradNorms:
    """One 1-element fp32 tensor per param: the 2-norm of its local gradient shard, taken when
    written (zero until then)."""

    def __init__(self) -> None:
        self._norms: list[torch.Tensor] = []

    def reset(self, num_params: int) -> None:
        """A fresh sum starts (open, or the step consumed the gradients)."""
        self._norms = [torch.zeros(1) for _ in range(num_params)]

    def record(self, index: int, norm: torch.Tensor) -> None:
        self._norms[index] = norm.reshape(1)

    def values(self) -> list[torch.Tensor]:
        return list(self._norms)
