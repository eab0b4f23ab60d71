"""Blockwise int8/int4 quantization (ZeRO++'s qwZ/qgZ): the round trip against per-block error
bounds computed here from first principles (each block's absmax, written out with a Python loop
over blocks), odd sizes, zero blocks, bf16 input; the Triton kernels against the reference."""

from __future__ import annotations

import pytest
import torch

from deepshard.kernels.quantize import (
    dequantize_blockwise,
    dequantize_blockwise_reference,
    quantize_blockwise,
    quantize_blockwise_reference,
)
from deepshard.kernels.quantize import (
    dequantize_blockwise_triton as dq_triton,
)
from deepshard.kernels.quantize import (
    quantize_blockwise_triton as q_triton,
)

SIZES = [1, 7, 4096, 4097, 10_001]
QMAX = {8: 127, 4: 7}


def _data(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 1, n)  # blocks of very different magnitudes
    if n > 4096:
        x[4096:min(n, 8192)] = 0.0  # a block of zeros
    return x.to(dtype)


def _bounds(x: torch.Tensor, block: int, bits: int) -> list[tuple[slice, float]]:
    """Each block's slice and its worst allowed error, half a quantization step: absmax / qmax / 2."""
    out = []
    flat = x.float()
    for start in range(0, flat.numel(), block):
        part = flat[start:start + block]
        step = max(abs(float(v)) for v in part.tolist()) / QMAX[bits]
        out.append((slice(start, start + block), step / 2))
    return out


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [4096, 64])
@pytest.mark.parametrize("n", SIZES)
def test_round_trip_within_half_a_step_per_block(n, block, bits):
    x = _data(n)
    codes, scales = quantize_blockwise_reference(x, block_size=block, bits=bits)
    assert codes.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert codes.numel() == (n if bits == 8 else (n + 1) // 2)  # int4: two codes per byte
    assert scales.dtype == torch.float32 and scales.numel() == -(-n // block)
    back = dequantize_blockwise_reference(codes, scales, n, block_size=block, bits=bits)
    worst_used = 0.0
    for i, (sl, bound) in enumerate(_bounds(x, block, bits)):
        err = (back[sl] - x[sl]).abs().max().item()
        assert err <= bound * (1 + 1e-6) + 1e-30, f"block {i}: error {err:.3g} > half a step {bound:.3g}"
        assert scales[i].item() == pytest.approx(2 * bound, rel=1e-6)
        if bound:
            worst_used = max(worst_used, err / bound)
    if n > 7:
        assert worst_used > 0.5  # the bound is tight: rounding really happened


def test_zero_block_decodes_to_zeros_and_extremes_are_exact():
    x = _data(10_001)
    for bits in (8, 4):
        codes, scales = quantize_blockwise_reference(x, bits=bits)
        assert scales[1] == 0
        back = dequantize_blockwise_reference(codes, scales, x.numel(), bits=bits)
        assert torch.all(back[4096:8192] == 0)
        top = x[:4096].abs().argmax()
        assert back[top] == pytest.approx(x[top].item(), rel=1e-6)  # absmax maps to +-qmax exactly


def test_bf16_input_and_dtype_out():
    x = _data(5000, torch.bfloat16)
    codes, scales = quantize_blockwise(x, backend="torch")
    back = dequantize_blockwise(codes, scales, x.numel(), dtype=torch.bfloat16, backend="torch")
    assert back.dtype == torch.bfloat16
    ref = dequantize_blockwise_reference(*quantize_blockwise_reference(x.float()), x.numel())
    torch.testing.assert_close(back.float(), ref, rtol=2**-7, atol=0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="bits=3"):
        quantize_blockwise_reference(torch.ones(4), bits=3)
    with pytest.raises(ValueError, match="block_size=100"):
        quantize_blockwise_reference(torch.ones(4), block_size=100)


@pytest.mark.triton
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [7, 4097, 10_001])
def test_triton_matches_reference(n, bits):
    x = _data(n)
    codes, scales = q_triton(x, bits=bits)
    ref_codes, ref_scales = quantize_blockwise_reference(x, bits=bits)
    torch.testing.assert_close(scales, ref_scales, rtol=0, atol=0)
    if bits == 8:  # a tie at exactly .5 may round either way where the GPU fuses x * inv + 0.5
        diff = (codes.int() - ref_codes.int()).abs()
    else:
        lo = lambda c: (c.int() & 15, c.int() >> 4)  # noqa: E731
        diff = torch.cat([(a - b).abs() for a, b in zip(lo(codes), lo(ref_codes))])
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3
    back = dq_triton(ref_codes, ref_scales, n, bits=bits)
    torch.testing.assert_close(back, dequantize_blockwise_reference(ref_codes, ref_scales, n, bits=bits),
                               rtol=0, atol=0)
