"""Rotary position embedding (HF Llama convention): Triton kernels, autograd.Function, reference.

Convention: ``q``/``k`` are [batch, heads, seq, head_dim] (``k`` may have fewer heads, GQA);
``cos``/``sin`` are [seq, head_dim] (or [batch, seq, head_dim], as HF's rotary module returns) with
the two halves duplicated; ``out = x * cos + rotate_half(x) * sin``. The backward kernel applies the
exact transpose (it reads both halves of cos/sin), so it is right even for non-duplicated tables.
The Triton path does not differentiate cos/sin (they are buffers in every model we know of) and
refuses tables that require grad rather than silently dropping that gradient.

DTensor: ``q``/``k`` may be Replicate, Partial (rope is linear) or Shard on batch (dim 0) or heads
(dim 1, tensor parallel); ``cos``/``sin`` must be plain tensors or Replicate. Shard on seq (would need
matching cos/sin shards) or on head_dim (rotate_half pairs the two halves) raises ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import torch

from deepshard.kernels import _dtensor as dt
from deepshard.kernels.backend import (
    _check_name,
    check_triton_device,
    lazy_jit,
    next_power_of_2,
    resolve_backend,
)

tl: Any = None  # bound to triton.language on first launch (see backend.LazyKernel)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _broadcast_table(t: torch.Tensor) -> torch.Tensor:
    # [seq, d] -> [1, 1, seq, d]; [batch, seq, d] -> [batch, 1, seq, d]
    return t[None, None] if t.dim() == 2 else t.unsqueeze(1)


def apply_rotary_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF ``apply_rotary_pos_emb`` (Llama), the oracle for the kernels."""
    cos, sin = _broadcast_table(cos), _broadcast_table(sin)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@lazy_jit
def _rope_kernel(
    X, OUT, COS, SIN,
    sx_b, sx_h, sx_s, so_b, so_h, so_s, sc_b, sc_s,
    seq_len, n_heads, half,
    BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per (batch, position): cos/sin rows are loaded once and reused for every head.
    pid = tl.program_id(0).to(tl.int64)
    b = pid // seq_len
    s = pid % seq_len
    d = tl.arange(0, BLOCK_D)
    dmask = d < half
    c1 = tl.load(COS + b * sc_b + s * sc_s + d, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + b * sc_b + s * sc_s + half + d, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + b * sc_b + s * sc_s + d, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + b * sc_b + s * sc_s + half + d, mask=dmask, other=0.0).to(tl.float32)
    h = tl.arange(0, BLOCK_H)
    mask = (h[:, None] < n_heads) & dmask[None, :]
    x_off = b * sx_b + s * sx_s + h[:, None] * sx_h + d[None, :]
    o_off = b * so_b + s * so_s + h[:, None] * so_h + d[None, :]
    x1 = tl.load(X + x_off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + x_off + half, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        # transpose of [x1, x2] -> [x1*c1 - x2*s1, x2*c2 + x1*s2]
        o1 = x1 * c1[None, :] + x2 * s2[None, :]
        o2 = x2 * c2[None, :] - x1 * s1[None, :]
    else:
        o1 = x1 * c1[None, :] - x2 * s1[None, :]
        o2 = x2 * c2[None, :] + x1 * s2[None, :]
    tl.store(OUT + o_off, o1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(OUT + o_off + half, o2.to(OUT.dtype.element_ty), mask=mask)


def _table_3d(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(0) if t.dim() == 2 else t


def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backward: bool) -> torch.Tensor:
    """Rotate one [batch, heads, seq, head_dim] tensor (or apply the transpose when ``backward``)."""
    check_triton_device(x.device)
    bsz, n_heads, seq_len, head_dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos3, sin3 = _table_3d(cos).contiguous(), _table_3d(sin).contiguous()
    if cos3.shape[0] not in (1, bsz) or cos3.shape[1:] != (seq_len, head_dim) or sin3.shape != cos3.shape:
        raise ValueError(
            f"kernels.apply_rotary: cos/sin shapes {tuple(cos.shape)}/{tuple(sin.shape)} do not match "
            f"q/k [batch={bsz}, heads, seq={seq_len}, head_dim={head_dim}]"
        )
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
    if x.numel():
        sc_b = cos3.stride(0) if cos3.shape[0] == bsz and bsz > 1 else 0
        _rope_kernel[(bsz * seq_len,)](
            x, out, cos3, sin3,
            x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2),
            sc_b, cos3.stride(1), seq_len, n_heads, head_dim // 2,
            BACKWARD=backward, BLOCK_H=next_power_of_2(n_heads), BLOCK_D=next_power_of_2(head_dim // 2),
        )
    return out


class RotaryFunction(torch.autograd.Function):
    """Triton rotary embedding for q and k together; saves only cos/sin."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(cos, sin)
        ctx.dtypes = (q.dtype, k.dtype)
        return rope_triton(q, cos, sin, backward=False), rope_triton(k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        dq = rope_triton(dq, cos, sin, backward=True).to(ctx.dtypes[0])
        dk = rope_triton(dk, cos, sin, backward=True).to(ctx.dtypes[1])
        return dq, dk, None, None


def _check_shapes(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"kernels.apply_rotary: q/k must be [batch, heads, seq, head_dim], got {q.dim()}-d/{k.dim()}-d")
    if q.shape[-1] % 2 or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"kernels.apply_rotary: q {tuple(q.shape)} and k {tuple(k.shape)} need equal batch, seq and "
            "an even, equal head_dim"
        )


def _apply_rotary_local(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_shapes(q, k)
    if resolve_backend(backend, q.device) == "triton":
        if cos.requires_grad or sin.requires_grad:
            raise ValueError("kernels.apply_rotary: backend='triton' does not differentiate cos/sin; detach them")
        return RotaryFunction.apply(q, k, cos, sin)
    return apply_rotary_reference(q, k, cos, sin)


def apply_rotary(
    q: Any, k: Any, cos: Any, sin: Any, backend: str = "torch"
) -> tuple[Any, Any]:
    """Rotate q and k by position (see module docstring for layout and accepted DTensor placements)."""
    _check_name(backend)
    if not any(dt.is_dtensor(t) for t in (q, k, cos, sin)):
        return _apply_rotary_local(q, k, cos, sin, backend)
    why = "only batch (dim 0) and heads (dim 1) may be sharded"
    for name, x in (("q", q), ("k", k)):
        dt.check_placements("apply_rotary", name, x, forbidden_dims=(2, 3), allow_partial=True, why=why)
    for name, t in (("cos", cos), ("sin", sin)):
        dt.check_placements("apply_rotary", name, t, allow_shard=False, why="cos/sin must be replicated")
    if not (dt.is_dtensor(q) and dt.is_dtensor(k)):
        raise ValueError("kernels.apply_rotary: pass q and k both as DTensors or both as tensors")
    dt.same_mesh("apply_rotary", q, k, cos, sin)
    q_out, k_out = _apply_rotary_local(q.to_local(), k.to_local(), dt.to_local(cos), dt.to_local(sin), backend)
    return dt.like(q_out, q), dt.like(k_out, k)
