"""LoCo's error feedback for qgZ (``zero.loco``; DeepSpeed's ``zeropp_loco_param``, arXiv 2407.04480).

Every quantization on the gradient path remembers what it rounded away and adds it back next time,
so low-bit errors do not accumulate into a bias.  DeepSpeed's kernels (``loco_swizzle_quant`` and
``loco_dequant_reduce`` in ``csrc/quantization``, called by ``all_to_all_loco_quant_reduce``; the
feature was removed again before DeepSpeed 0.19.8, whose config now rejects the key) do, per
quantized tensor ``x`` and its error buffer ``e``::

    c = x + e                                    # compensate
    q = Q(c)                                     # what is sent
    e = err_beta * e + (1 - err_beta) * (c - deQ(q))

and clear the buffers after ``reset_T`` uses.  DeepSpeed keeps one buffer per parameter for the
intra-node hop and one for the inter-node hop (stored int8 between steps); here every quantization
site of a unit's gradient (qgZ's hops, HSDP's cross-replica all-reduce) has its own fp32 buffer on
the compute device, counted by the memory census (``buffers.loco_error_feedback``).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from deepshard.kernels.quantize import dequantize_blockwise, quantize_blockwise

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """The per-rank error buffers of one engine, one per quantization site ``key``."""

    def __init__(self, *, err_beta: float, reset_t: int) -> None:
        self.err_beta, self.reset_t = err_beta, reset_t
        self.errors: dict[Hashable, torch.Tensor] = {}
        self.uses: dict[Hashable, int] = {}

    def quantize(self, key: Hashable, x: torch.Tensor, *, block_size: int,
                 bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``quantize_blockwise(x + e)``, updating ``e`` (DeepSpeed's formula above)."""
        err = self.errors.get(key)
        if err is None or err.shape != x.shape or err.device != x.device:
            err = self.errors[key] = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            self.uses[key] = 0
        elif self.uses[key] >= self.reset_t:  # LoCo's reset_T: start over from a clean buffer
            err.zero_()
            self.uses[key] = 0
        comp = x.float() + err
        codes, scales = quantize_blockwise(comp, block_size=block_size, bits=bits)
        sent = dequantize_blockwise(codes, scales, comp.numel(), block_size=block_size, bits=bits).view(comp.shape)
        err.mul_(self.err_beta).add_(comp - sent, alpha=1.0 - self.err_beta)
        self.uses[key] += 1
        return codes, scales

    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.errors.values())
