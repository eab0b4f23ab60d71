"""RMSNorm: Triton forward/backward kernels, autograd.Function, nn.Module and the PyTorch reference.

Numerics follow HuggingFace's LlamaRMSNorm exactly: statistics in fp32, the normalized activations
cast back to the input dtype, then multiplied by the weight (result dtype promoted as torch would).

DTensor: ``x`` may be Replicate or Shard(d) on any dim except the last (normalized) one, e.g.
sequence-parallel Shard(1); ``weight`` must then be an all-Replicate DTensor on the same mesh (its
gradient becomes Partial over the mesh dims where ``x`` is sharded). Shard(-1) or Partial inputs raise
``ValueError``: the mean over a sharded hidden dim cannot be computed locally.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepshard.kernels import _dtensor as dt
from deepshard.kernels.backend import (
    _check_name,
    check_triton_device,
    lazy_jit,
    next_power_of_2,
    num_programs_hint,
    num_warps_for,
    resolve_backend,
)

tl: Any = None  # bound to triton.language on first launch (see backend.LazyKernel)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """HuggingFace LlamaRMSNorm, the oracle for the kernels."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


@lazy_jit
def _rms_norm_fwd_kernel(X, W, Y, RSTD, stride_x, stride_y, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    xhat = (x * rstd).to(X.dtype.element_ty).to(tl.float32)  # the cast HF does before the weight
    tl.store(Y + row * stride_y + cols, (xhat * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@lazy_jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PART, stride_dy, stride_x, stride_dx, n_rows, n_cols, rows_per_program,
    BLOCK: tl.constexpr,
):
    # Persistent programs: each walks a contiguous run of rows and keeps its own fp32 dW partial,
    # so dW needs no atomics; the partials are summed on the host side.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for i in range(0, row_end - row_start):
        r = row_start + i
        x = tl.load(X + r * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + r * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + r)
        xhat = x * rstd
        dw += dy * xhat.to(X.dtype.element_ty).to(tl.float32)
        dxhat = dy * w
        dx = rstd * (dxhat - xhat * (tl.sum(dxhat * xhat, axis=0) / n_cols))
        tl.store(DX + r * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PART + pid * n_cols + cols, dw, mask=mask)


def rms_norm_forward_triton(
    x2d: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on a contiguous [rows, hidden] tensor; returns (y, rstd)."""
    check_triton_device(x2d.device)
    n_rows, n_cols = x2d.shape
    y = torch.empty(n_rows, n_cols, dtype=torch.promote_types(x2d.dtype, weight.dtype), device=x2d.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x2d.device)
    if n_rows:
        _rms_norm_fwd_kernel[(n_rows,)](
            x2d, weight, y, rstd, x2d.stride(0), y.stride(0), n_cols, eps,
            BLOCK=next_power_of_2(n_cols), num_warps=num_warps_for(next_power_of_2(n_cols)),
        )
    return y, rstd


def rms_norm_backward_triton(
    dy: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel; returns (dx, dweight)."""
    n_rows, n_cols = x2d.shape
    dy = dy.contiguous()
    dx = torch.empty_like(x2d)
    num_programs = max(1, min(n_rows, num_programs_hint(x2d.device)))
    rows_per_program = -(-n_rows // num_programs)
    dw_part = torch.zeros(num_programs, n_cols, dtype=torch.float32, device=x2d.device)
    if n_rows:
        _rms_norm_bwd_kernel[(num_programs,)](
            dy, x2d, weight, rstd, dx, dw_part, dy.stride(0), x2d.stride(0), dx.stride(0),
            n_rows, n_cols, rows_per_program,
            BLOCK=next_power_of_2(n_cols), num_warps=num_warps_for(next_power_of_2(n_cols)),
        )
    return dx, dw_part.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """Triton RMSNorm; saves x and the per-row 1/rms (not the output) for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        x2d = x.reshape(-1, shape[-1]).contiguous()
        y, rstd = rms_norm_forward_triton(x2d, weight.contiguous(), eps)
        ctx.save_for_backward(x2d, weight, rstd)
        return y.view(*shape[:-1], shape[-1])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2d, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward_triton(dy.reshape(-1, x2d.shape[1]), x2d, weight.contiguous(), rstd)
        return dx.view(dy.shape), dw, None


def _rms_norm_local(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str) -> torch.Tensor:
    if resolve_backend(backend, x.device) == "triton":
        return RMSNormFunction.apply(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rms_norm(x: Any, weight: Any, eps: float = 1e-6, backend: str = "torch") -> Any:
    """RMSNorm over the last dim of ``x`` (plain tensors or DTensors, see module docstring)."""
    _check_name(backend)
    if not (dt.is_dtensor(x) or dt.is_dtensor(weight)):
        return _rms_norm_local(x, weight, eps, backend)
    why = "RMSNorm reduces over the last (hidden) dim"
    dt.check_placements("rms_norm", "x", x, forbidden_dims=(-1,), why=why)
    dt.check_placements("rms_norm", "weight", weight, allow_shard=False, why=why)
    if not dt.is_dtensor(x):
        raise ValueError("kernels.rms_norm: weight is a DTensor but x is not; pass both as DTensors")
    if not dt.is_dtensor(weight):
        if any(isinstance(p, dt.Shard) for p in x.placements):
            raise ValueError(
                "kernels.rms_norm: x is a sharded DTensor but weight is a plain tensor, so its gradient "
                "would cover one shard only; pass weight as a Replicate DTensor on x's mesh"
            )
        w_local = weight
    else:
        dt.same_mesh("rms_norm", x, weight)
        grad_placements = [dt.Partial() if isinstance(p, dt.Shard) else dt.Replicate() for p in x.placements]
        w_local = weight.to_local(grad_placements=grad_placements)
    return dt.like(_rms_norm_local(x.to_local(), w_local, eps, backend), x)


class RMSNorm(nn.Module):
    """Drop-in for HF ``LlamaRMSNorm``: same ``weight`` parameter name, so HF state dicts load as-is."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, backend: str = "torch") -> None:
        super().__init__()
        _check_name(backend)
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.backend)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, backend={self.backend}"
