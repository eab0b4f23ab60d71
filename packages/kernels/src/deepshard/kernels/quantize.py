"""Blockwise symmetric int8 / int4 quantization for ZeRO++'s collectives: Triton kernels, launchers
and the PyTorch reference (the CPU path).

A flat tensor is cut into blocks of ``block_size`` elements; each block gets one fp32 scale
``absmax / qmax`` (qmax 127 for int8, 7 for int4) and its elements become
``clamp(floor(x * (qmax / absmax) + 0.5), -qmax, qmax)``, so the round trip errs by at most half a
step, ``scale / 2``, per element (a block of zeros has scale 0 and decodes to zeros).  int4 codes
are packed two per byte, offset by 8 (element ``2i`` in the low nibble, ``2i + 1`` in the high).

Block sizes follow DeepSpeed's ZeRO++: its weight quantizer (``CUDAQuantizer``) picks groups just
under 8000 elements and calls 4k the optimum, so weights use 4096; its gradient quantizer (qgZ,
int4) uses one group per row of the weight (``max(rows, cols)`` groups), a few thousand elements in
LLM layers; our gradient buffers are flat, so a fixed 4096 serves both (both are arguments).
"""

from __future__ import annotations

from typing import Any

import torch

from deepshard.kernels.backend import _check_name, check_triton_device, lazy_jit, resolve_backend

tl: Any = None  # bound to triton.language on first launch (see backend.LazyKernel)

DEFAULT_BLOCK = 4096
QMAX = {8: 127, 4: 7}
# the divisor's floor: a block whose absmax is under it (a zero block) gets no finite inverse beyond qmax/1e-30,
# so it decodes to ~0, within its absmax (qmax / fp32's tiny would overflow)
_TINY = 1e-30

__all__ = ["DEFAULT_BLOCK", "QMAX", "code_bytes", "dequantize_blockwise", "dequantize_blockwise_reference",
           "num_blocks", "quantize_blockwise", "quantize_blockwise_reference"]


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def code_bytes(numel: int, bits: int) -> int:
    """Bytes of the codes of ``numel`` elements (int4: two per byte)."""
    return numel if bits == 8 else -(-numel // 2)


def _check(block_size: int, bits: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"bits={bits}: valid values are 8 and 4")
    if block_size < 2 or block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size}: must be a power of two >= 2")


# ---- the PyTorch reference -------------------------------------------------------------------

def quantize_blockwise_reference(x: torch.Tensor, *, block_size: int = DEFAULT_BLOCK,
                                 bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``x`` flattened: int8 codes (``numel``) or packed uint8 int4 codes
    (``ceil(numel / 2)``), and one fp32 scale per block."""
    _check(block_size, bits)
    qmax = QMAX[bits]
    flat = x.reshape(-1).float()
    n = flat.numel()
    nb = num_blocks(n, block_size)
    padded = torch.zeros(nb * block_size, dtype=torch.float32, device=x.device)
    padded[:n] = flat
    blocks = padded.view(nb, block_size)
    absmax = blocks.abs().amax(dim=1)
    scales = absmax / qmax
    inv = torch.where(absmax > 0, qmax / absmax.clamp(min=_TINY), torch.zeros_like(absmax))
    q = torch.floor(blocks * inv[:, None] + 0.5).clamp_(-qmax, qmax).view(-1)[:n]
    if bits == 8:
        return q.to(torch.int8), scales
    q = q.to(torch.int16) + 8
    if n % 2:
        q = torch.cat([q, q.new_full((1,), 8)])
    pairs = q.view(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8), scales


def dequantize_blockwise_reference(codes: torch.Tensor, scales: torch.Tensor, numel: int, *,
                                   block_size: int = DEFAULT_BLOCK, bits: int = 8,
                                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``numel`` values ``codes`` and ``scales`` stand for, in ``dtype``."""
    _check(block_size, bits)
    if bits == 8:
        q = codes.to(torch.float32)
    else:
        c = codes.to(torch.int16)
        q = torch.stack([(c & 0xF) - 8, (c >> 4) - 8], dim=1).reshape(-1)[:numel].to(torch.float32)
    nb = num_blocks(numel, block_size)
    per = scales.repeat_interleave(block_size)[:numel] if nb else scales[:0]
    return (q * per).to(dtype)


# ---- Triton ------------------------------------------------------------------------------------

@lazy_jit
def _quant8_kernel(X, CODES, SCALES, n, QM: tl.constexpr, BLOCK: tl.constexpr):
    blk = tl.program_id(0).to(tl.int64)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    absmax = tl.max(tl.abs(x), axis=0)
    inv = tl.where(absmax > 0, QM / tl.maximum(absmax, 1e-30), 0.0)
    q = tl.floor(x * inv + 0.5)
    q = tl.minimum(tl.maximum(q, -QM), QM)
    tl.store(CODES + offs, q.to(tl.int8), mask=mask)
    tl.store(SCALES + blk, absmax / QM)


@lazy_jit
def _dequant8_kernel(CODES, SCALES, OUT, n, BLOCK: tl.constexpr):
    blk = tl.program_id(0).to(tl.int64)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    q = tl.load(CODES + offs, mask=mask, other=0).to(tl.float32)
    s = tl.load(SCALES + blk)
    tl.store(OUT + offs, (q * s).to(OUT.dtype.element_ty), mask=mask)


@lazy_jit
def _quant4_kernel(X, CODES, SCALES, n, HALF: tl.constexpr):
    blk = tl.program_id(0).to(tl.int64)
    pair = blk * HALF + tl.arange(0, HALF)  # byte index: elements 2 * pair and 2 * pair + 1
    lo_off, hi_off = 2 * pair, 2 * pair + 1
    lo = tl.load(X + lo_off, mask=lo_off < n, other=0.0).to(tl.float32)
    hi = tl.load(X + hi_off, mask=hi_off < n, other=0.0).to(tl.float32)
    absmax = tl.maximum(tl.max(tl.abs(lo), axis=0), tl.max(tl.abs(hi), axis=0))
    inv = tl.where(absmax > 0, 7.0 / tl.maximum(absmax, 1e-30), 0.0)
    qlo = tl.minimum(tl.maximum(tl.floor(lo * inv + 0.5), -7.0), 7.0).to(tl.int32) + 8
    qhi = tl.minimum(tl.maximum(tl.floor(hi * inv + 0.5), -7.0), 7.0).to(tl.int32) + 8
    tl.store(CODES + pair, (qlo | (qhi << 4)).to(tl.uint8), mask=lo_off < n)
    tl.store(SCALES + blk, absmax / 7.0)


@lazy_jit
def _dequant4_kernel(CODES, SCALES, OUT, n, HALF: tl.constexpr):
    blk = tl.program_id(0).to(tl.int64)
    pair = blk * HALF + tl.arange(0, HALF)
    lo_off, hi_off = 2 * pair, 2 * pair + 1
    c = tl.load(CODES + pair, mask=lo_off < n, other=0).to(tl.int32)
    s = tl.load(SCALES + blk)
    tl.store(OUT + lo_off, (((c & 15) - 8).to(tl.float32) * s).to(OUT.dtype.element_ty), mask=lo_off < n)
    tl.store(OUT + hi_off, (((c >> 4) - 8).to(tl.float32) * s).to(OUT.dtype.element_ty), mask=hi_off < n)


def quantize_blockwise_triton(x: torch.Tensor, *, block_size: int = DEFAULT_BLOCK,
                              bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    _check(block_size, bits)
    check_triton_device(x.device)
    flat = x.reshape(-1).contiguous()
    n = flat.numel()
    nb = num_blocks(n, block_size)
    scales = torch.empty(nb, dtype=torch.float32, device=x.device)
    if bits == 8:
        codes = torch.empty(n, dtype=torch.int8, device=x.device)
        if n:
            _quant8_kernel[(nb,)](flat, codes, scales, n, QM=127.0, BLOCK=block_size)
    else:
        codes = torch.empty(code_bytes(n, 4), dtype=torch.uint8, device=x.device)
        if n:
            _quant4_kernel[(nb,)](flat, codes, scales, n, HALF=block_size // 2)
    return codes, scales


def dequantize_blockwise_triton(codes: torch.Tensor, scales: torch.Tensor, numel: int, *,
                                block_size: int = DEFAULT_BLOCK, bits: int = 8,
                                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    _check(block_size, bits)
    check_triton_device(codes.device)
    out = torch.empty(numel, dtype=dtype, device=codes.device)
    if numel:
        grid = (num_blocks(numel, block_size),)
        if bits == 8:
            _dequant8_kernel[grid](codes, scales, out, numel, BLOCK=block_size)
        else:
            _dequant4_kernel[grid](codes, scales, out, numel, HALF=block_size // 2)
    return out


# ---- entry points ------------------------------------------------------------------------------

def quantize_blockwise(x: torch.Tensor, *, block_size: int = DEFAULT_BLOCK, bits: int = 8,
                       backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``x`` (any float dtype, flattened); Triton on CUDA, the reference elsewhere."""
    _check_name(backend)
    if resolve_backend(backend, x.device) == "triton":
        return quantize_blockwise_triton(x, block_size=block_size, bits=bits)
    return quantize_blockwise_reference(x, block_size=block_size, bits=bits)


def dequantize_blockwise(codes: torch.Tensor, scales: torch.Tensor, numel: int, *,
                         block_size: int = DEFAULT_BLOCK, bits: int = 8, dtype: torch.dtype = torch.float32,
                         backend: str = "auto") -> torch.Tensor:
    """The inverse of :func:`quantize_blockwise` (up to half a step per element), in ``dtype``."""
    _check_name(backend)
    if resolve_backend(backend, codes.device) == "triton":
        return dequantize_blockwise_triton(codes, scales, numel, block_size=block_size, bits=bits, dtype=dtype)
    return dequantize_blockwise_reference(codes, scales, numel, block_size=block_size, bits=bits, dtype=dtype)
