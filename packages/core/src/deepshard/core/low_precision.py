"""bf16 optimizer states and masters: the update runs in fp32, the result is stored back with
stochastic rounding.

Why stochastic rounding and not Kahan summation: a bf16 weight of 1.0 has an ulp of 2**-7, so an
AdamW step of lr=1e-3 is below half an ulp and round-to-nearest throws it away every step (the
weight never moves), and ``exp_avg_sq * beta2`` with beta2=0.999 rounds back to itself (the second
moment never decays).  Kahan summation fixes both exactly but needs a compensation buffer per tensor,
2 more bytes per element, which gives back half of what bf16 saves; stochastic rounding keeps the
expectation exact with no buffer (rounds up with probability equal to the discarded fraction).  The
random bits come from a generator seeded here, so a run is reproducible.
"""

from __future__ import annotations

import torch

__all__ = ["LOW_PRECISION_DTYPES", "StochasticRounder", "stochastic_round_"]

LOW_PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SEED = 0x5EED


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """``dst`` (bf16) <- ``src`` (fp32) rounded up or down at random, in proportion to the distance.

    Adds 16 random low bits to the fp32 bit pattern and truncates them: the bf16 value above is
    taken with probability equal to the dropped fraction of an ulp.  Non-finite values pass as is.
    """
    assert dst.dtype == torch.bfloat16 and src.dtype == torch.float32 and dst.shape == src.shape
    if src.numel() == 0:
        return
    bits = src.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, src.shape, dtype=torch.int32, device=src.device, generator=generator)
    rounded = ((bits + noise) & -65536).view(torch.float32)  # -65536 == 0xFFFF0000 as int32
    dst.copy_(torch.where(torch.isfinite(src), rounded, src))


class StochasticRounder:
    """Writes fp32 results into bf16 storage with :func:`stochastic_round_`; fp32 storage takes them as
    they are.  One seeded generator per device, so the same run rounds the same way."""

    def __init__(self, seed: int = SEED) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def store(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` <- ``src`` (fp32); nothing to do when ``src`` is ``dst`` itself."""
        if src is dst:
            return
        if dst.dtype == torch.bfloat16:
            stochastic_round_(dst, src, self.generator(src.device))
        else:
            dst.copy_(src)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32: itself when it already is (updates then land in place), else a copy."""
    return t if t.dtype == torch.float32 else t.float()
