"""LoCo's error feedback (``zero.loco``, DeepSpeed's ``zeropp_loco_param``) against a plain torch
reference written here from DeepSpeed's kernels (``loco_swizzle_quant`` / ``loco_dequant_reduce``):
per quantized tensor ``x`` with error buffer ``e``: ``c = x + e``; send ``Q(c)``;
``e = err_beta * e + (1 - err_beta) * (c - deQ(Q(c)))``; the buffer cleared after ``reset_T`` uses.
The reference quantizer (symmetric, one scale ``absmax / qmax`` per block of 4096) is written here too.
Single process, no launch."""

from __future__ import annotations

import pytest
import torch

from deepshard.core.zero.loco import ErrorFeedback
from deepshard.kernels.quantize import dequantize_blockwise

BLOCK = 4096


def _round_trip(x: torch.Tensor, bits: int) -> torch.Tensor:
    """What a receiver decodes of ``x``: each block rounded to ``absmax / qmax`` steps."""
    qmax = {8: 127, 4: 7}[bits]
    flat = x.reshape(-1)
    out = torch.empty_like(flat)
    for start in range(0, flat.numel(), BLOCK):
        block = flat[start:start + BLOCK]
        absmax = block.abs().max()
        if absmax == 0:
            out[start:start + BLOCK] = 0
            continue
        q = torch.clamp(torch.floor(block * (qmax / absmax) + 0.5), -qmax, qmax)
        out[start:start + BLOCK] = q * (absmax / qmax)
    return out.view(x.shape)


@pytest.mark.parametrize("bits,beta,reset", [(4, 0.8, 1024), (8, 0.8, 1024), (4, 0.0, 3), (4, 0.5, 2)])
def test_compensation_matches_deepspeeds_formula(bits, beta, reset):
    g = torch.Generator().manual_seed(5)
    fb = ErrorFeedback(err_beta=beta, reset_t=reset)
    err = torch.zeros(2, 5000)
    for step in range(7):
        x = torch.randn(2, 5000, generator=g) * (1 + step)
        if step and step % reset == 0:
            err.zero_()
        comp = x + err
        sent = _round_trip(comp, bits)
        err = beta * err + (1 - beta) * (comp - sent)
        codes, scales = fb.quantize("unit0", x, block_size=BLOCK, bits=bits)
        got = dequantize_blockwise(codes, scales, x.numel(), block_size=BLOCK, bits=bits).view(x.shape)
        assert torch.allclose(got, sent, rtol=1e-5, atol=1e-6), (step, (got - sent).abs().max())
        assert torch.allclose(fb.errors["unit0"], err, rtol=1e-5, atol=1e-6), step
    assert fb.nbytes() == 2 * 5000 * 4  # one fp32 buffer per site, counted by the census


def test_feedback_cancels_the_bias_over_steps():
    """The point of it: a constant gradient sent in int4 for 50 steps arrives, on average, as itself."""
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    plain = _round_trip(x, 4)
    fb = ErrorFeedback(err_beta=0.0, reset_t=1024)
    total = torch.zeros_like(x)
    for _ in range(50):
        codes, scales = fb.quantize("k", x, block_size=BLOCK, bits=4)
        total += dequantize_blockwise(codes, scales, x.numel(), block_size=BLOCK, bits=4)
    assert (total / 50 - x).norm() < 0.1 * (plain - x).norm()


def test_bad_loco_values_refused():
    from deepshard.core import ZeroConfig

    with pytest.raises(ValueError, match=r"^loco=True: .*quantized_gradients=true"):
        ZeroConfig(stage=3, loco=True)
    with pytest.raises(ValueError, match=r"^loco_err_beta=1.5: must be in \[0, 1\]"):
        ZeroConfig(stage=3, quantized_gradients=True, loco=True, loco_err_beta=1.5)
    with pytest.raises(ValueError, match=r"^loco_reset_t=0: must be >= 1"):
        ZeroConfig(stage=3, quantized_gradients=True, loco=True, loco_reset_t=0)
