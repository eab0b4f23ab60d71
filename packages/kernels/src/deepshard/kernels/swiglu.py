"""SwiGLU ``silu(gate) * up``: Triton forward/backward, autograd.Function, module and the reference.

The kernel computes in fp32 and rounds once; backward recomputes silu from ``gate`` instead of saving
it, so only the two inputs are kept for backward (what Llama's MLP keeps anyway).

DTensor: elementwise, so any placements work as long as ``gate`` and ``up`` are placed identically
(the usual case: both Shard(-1) from column-parallel projections). Partial is rejected because silu
is not linear.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepshard.kernels import _dtensor as dt
from deepshard.kernels.backend import _check_name, check_triton_device, lazy_jit, resolve_backend

tl: Any = None  # bound to triton.language on first launch (see backend.LazyKernel)

_BLOCK = 1024


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Llama's MLP activation as HF writes it: ``act_fn(gate_proj(x)) * up_proj(x)``."""
    return F.silu(gate) * up


@lazy_jit
def _swiglu_fwd_kernel(GATE, UP, OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(GATE + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offs, mask=mask, other=0.0).to(tl.float32)
    silu = g / (1.0 + tl.exp(-g))
    tl.store(OUT + offs, (silu * u).to(OUT.dtype.element_ty), mask=mask)


@lazy_jit
def _swiglu_bwd_kernel(DOUT, GATE, UP, DGATE, DUP, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dout = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GATE + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offs, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    silu = g * sig
    dgate = dout * u * (sig + silu * (1.0 - sig))  # d silu/dg = sig * (1 + g * (1 - sig))
    tl.store(DGATE + offs, dgate.to(DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + offs, (dout * silu).to(DUP.dtype.element_ty), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (max(1, -(-n // _BLOCK)),)


def swiglu_forward_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Launch the forward kernel on contiguous, same-shape inputs."""
    check_triton_device(gate.device)
    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    if gate.numel():
        _swiglu_fwd_kernel[_grid(gate.numel())](gate, up, out, gate.numel(), BLOCK=_BLOCK)
    return out


def swiglu_backward_triton(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel; returns (dgate, dup)."""
    dout = dout.contiguous()
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    if gate.numel():
        _swiglu_bwd_kernel[_grid(gate.numel())](dout, gate, up, dgate, dup, gate.numel(), BLOCK=_BLOCK)
    return dgate, dup


class SwiGLUFunction(torch.autograd.Function):
    """Triton SwiGLU; saves the inputs only and recomputes silu in backward."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return swiglu_forward_triton(gate, up)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        return swiglu_backward_triton(dout, gate, up)


def _swiglu_local(gate: torch.Tensor, up: torch.Tensor, backend: str) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"kernels.swiglu: gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    if resolve_backend(backend, gate.device) == "triton":
        return SwiGLUFunction.apply(gate, up)
    return swiglu_reference(gate, up)


def swiglu(gate: Any, up: Any, backend: str = "torch") -> Any:
    """``silu(gate) * up`` for tensors or identically placed DTensors."""
    _check_name(backend)
    if not (dt.is_dtensor(gate) or dt.is_dtensor(up)):
        return _swiglu_local(gate, up, backend)
    for name, x in (("gate", gate), ("up", up)):
        dt.check_placements("swiglu", name, x, why="silu is not linear")
    if not (dt.is_dtensor(gate) and dt.is_dtensor(up)):
        raise ValueError("kernels.swiglu: pass gate and up both as DTensors or both as tensors")
    dt.same_mesh("swiglu", gate, up)
    if tuple(gate.placements) != tuple(up.placements):
        raise ValueError(
            f"kernels.swiglu: gate placements {tuple(gate.placements)} differ from up placements "
            f"{tuple(up.placements)}; redistribute one of them first"
        )
    return dt.like(_swiglu_local(gate.to_local(), up.to_local(), backend), gate)


class SwiGLU(nn.Module):
    """Llama MLP block ``down(silu(gate(x)) * up(x))`` with the fused activation."""

    def __init__(self, hidden_size: int, intermediate_size: int, backend: str = "torch") -> None:
        super().__init__()
        _check_name(backend)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.backend))
