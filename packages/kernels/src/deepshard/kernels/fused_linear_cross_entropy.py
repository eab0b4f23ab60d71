"""Linear + cross-entropy without materializing the [tokens, vocab] logits.

The lm-head logits are the largest activation of a Llama step (8192 tokens x 128256 vocab in fp32 is
4 GiB), so, like Liger's FusedLinearCrossEntropy, tokens are processed in chunks and the gradients
w.r.t. ``hidden`` and ``weight`` are computed during the forward pass, chunk by chunk; backward only
scales them by the incoming gradient (fp16 recomputes the chunks in backward instead, with the loss
scale applied before anything is rounded to fp16). Peak extra memory is one [chunk, vocab] fp32 block plus an
fp32 accumulator for the weight gradient.

Both backends share the chunk loop; they differ in the per-chunk softmax/loss/grad step: a Triton
kernel that overwrites the logits block with its gradient (online softmax over vocab blocks), or the
same math in PyTorch in-place ops.

DTensor: all arguments must be plain tensors or Replicate DTensors. A vocab-sharded weight
(Shard(0), e.g. a column-parallel lm-head) or a sharded hidden dim raises ``ValueError``: the softmax
normalizer is a reduction over the whole vocab and would be wrong on a shard.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from deepshard.kernels import _dtensor as dt
from deepshard.kernels.backend import (
    _check_name,
    check_triton_device,
    lazy_jit,
    next_power_of_2,
    num_warps_for,
    resolve_backend,
)

tl: Any = None  # bound to triton.language on first launch (see backend.LazyKernel)

_REDUCTIONS = ("mean", "sum")


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Materialize the logits and call F.cross_entropy (in fp32): the oracle, and the memory baseline."""
    logits = (hidden @ weight.t()).float()
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)


@lazy_jit
def _ce_fwd_bwd_kernel(LOGITS, stride, TARGETS, LOSS, SCALE, n_cols, ignore_index, BLOCK: tl.constexpr):
    # One program per token row: online logsumexp over vocab blocks, then overwrite the row with
    # d(loss)/d(logits) = (softmax - onehot(target)) * scale (zero for ignored rows).
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride
    target = tl.load(TARGETS + row)
    valid = target != ignore_index
    safe_target = tl.where(valid, target, 0)
    scale = tl.load(SCALE) * valid.to(tl.float32)
    m = float("-inf")
    d = 0.0
    for off in range(0, n_cols, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(d)
    x_target = tl.load(ptr + safe_target).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - x_target, 0.0))
    for off in range(0, n_cols, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - tl.where(cols == safe_target, 1.0, 0.0)
        tl.store(ptr + cols, (g * scale).to(LOGITS.dtype.element_ty), mask=mask)


def _ce_chunk_triton(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, scale: torch.Tensor, need_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss; ``logits`` (fp32, contiguous) is overwritten with its gradient."""
    check_triton_device(logits.device)
    rows, n_cols = logits.shape
    targets = targets.contiguous()
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    block = min(4096, next_power_of_2(n_cols))
    _ce_fwd_bwd_kernel[(rows,)](
        logits, logits.stride(0), targets, loss, scale, n_cols, ignore_index, BLOCK=block, num_warps=num_warps_for(block)
    )
    return loss.sum(), logits


def _ce_chunk_torch(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, scale: torch.Tensor, need_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as the Triton step, in in-place PyTorch ops (no second [chunk, vocab] buffer)."""
    valid = targets != ignore_index
    safe_targets = targets.masked_fill(~valid, 0).unsqueeze(1)
    target_logits = logits.gather(1, safe_targets).squeeze(1)
    # logsumexp by hand so exp() lands in the logits buffer itself (torch.logsumexp allocates another)
    row_max = logits.amax(dim=-1, keepdim=True)
    exp_sum = logits.sub_(row_max).exp_().sum(dim=-1, keepdim=True)
    lse = (row_max + exp_sum.log()).squeeze(1)
    loss = ((lse - target_logits) * valid).sum()
    if need_grad:
        logits.div_(exp_sum)  # softmax
        logits.scatter_add_(1, safe_targets, torch.full_like(safe_targets, -1, dtype=logits.dtype))
        logits.mul_((valid * scale).unsqueeze(1))
    return loss, logits


def _chunk_loop(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, ignore_index: int,
                scale: torch.Tensor, chunk_size: int, use_triton: bool, need_h: bool, need_w: bool,
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One pass over the token chunks: the summed loss and, where asked, the gradients of
    ``scale * loss_sum`` w.r.t. ``hidden`` (in its dtype) and ``weight`` (fp32)."""
    loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
    grad_w = None  # fp32; the first chunk's product is its first value (no V x H memset per call)
    ce_chunk = _ce_chunk_triton if use_triton else _ce_chunk_torch
    for start in range(0, hidden.shape[0], chunk_size):
        end = min(start + chunk_size, hidden.shape[0])
        h = hidden[start:end]
        logits = (h @ weight.t()).float().contiguous()
        loss, grad_logits = ce_chunk(logits, targets[start:end], ignore_index, scale, need_h or need_w)
        loss_sum += loss
        if need_h or need_w:
            low = grad_logits.to(hidden.dtype)
            if need_h:
                torch.matmul(low, weight, out=grad_h[start:end])
            if need_w:
                grad_w = _add_weight_grad(grad_w, grad_logits, low, h)
            del low
        del logits, grad_logits
    if need_w and grad_w is None:  # no tokens: no chunk ran
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    return loss_sum, grad_h, grad_w


_MM_OUT_DTYPE: dict[tuple[str, torch.dtype], bool] = {}


def _mm_out_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``a @ b`` with fp32 accumulation *and output* from 16-bit inputs where the backend offers it
    (CUDA's ``mm(..., out_dtype=)``), else None.  Probed once per device type and dtype."""
    key = (a.device.type, a.dtype)
    if key not in _MM_OUT_DTYPE:
        try:
            torch.mm(a[:1, :1], b[:1, :1], out_dtype=torch.float32)
            _MM_OUT_DTYPE[key] = a.device.type == "cuda"
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE[key] = False
    return torch.mm(a, b, out_dtype=torch.float32) if _MM_OUT_DTYPE[key] else None


def _add_weight_grad(grad_w: torch.Tensor | None, grad_logits: torch.Tensor, low: torch.Tensor,
                     h: torch.Tensor) -> torch.Tensor:
    """grad_w (fp32) + grad_logits.T @ h (in place; the product itself where grad_w is None) without
    rounding each chunk's sum to 16 bits (a bf16/fp16 partial sum per chunk loses the small entries and
    turns cancellations into exact zeros)."""
    if h.dtype == torch.float32:
        return torch.mm(grad_logits.t(), h) if grad_w is None else grad_w.addmm_(grad_logits.t(), h)
    part = _mm_out_fp32(low.t(), h)
    if part is None:  # no fp32-output 16-bit matmul here (CPU): the chunk's product in fp32
        return torch.mm(grad_logits.t(), h.float()) if grad_w is None else grad_w.addmm_(grad_logits.t(), h.float())
    return part if grad_w is None else grad_w.add_(part)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Chunked linear + CE.

    fp32/bf16: the gradients are produced in forward and multiplied by the incoming gradient (in
    fp32) in backward.  fp16: its range cannot hold unscaled per-token gradients (1/n_valid of a
    softmax underflows) nor every scale (>= 65536 overflows), so forward computes only the loss and
    backward recomputes the chunks with the incoming gradient (the fp16 loss scale) already
    applied, in fp32, before anything is rounded to fp16: the values plain autograd would produce.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int,
        reduction: str,
        chunk_size: int,
        use_triton: bool,
        grad_enabled: bool,
    ) -> torch.Tensor:
        # needs_input_grad is True under no_grad too; grad_enabled (read before apply) skips the grad work
        need_h, need_w = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        n_valid = (targets != ignore_index).sum()
        # on device (no host sync); clamped so all-ignored batches give zero grads, not nan
        per_token = (1.0 / n_valid.clamp(min=1).float()) if reduction == "mean" else torch.ones(
            (), dtype=torch.float32, device=hidden.device)
        ctx.defer = hidden.dtype == torch.float16 and (need_h or need_w)
        ctx.options = dict(ignore_index=ignore_index, chunk_size=chunk_size, use_triton=use_triton,
                           need_h=need_h, need_w=need_w)
        ctx.weight_dtype = weight.dtype
        if ctx.defer:
            loss_sum, _, _ = _chunk_loop(hidden, weight, targets, scale=per_token,
                                         **{**ctx.options, "need_h": False, "need_w": False})
            ctx.save_for_backward(hidden, weight, targets, per_token)
        else:
            loss_sum, grad_h, grad_w = _chunk_loop(hidden, weight, targets, scale=per_token, **ctx.options)
            ctx.save_for_backward(grad_h, grad_w)
        # mean over zero valid tokens is nan, as in F.cross_entropy; the sum is 0
        return loss_sum / n_valid if reduction == "mean" else loss_sum

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.defer:
            hidden, weight, targets, per_token = ctx.saved_tensors
            scale = (grad_out.float() * per_token).contiguous()
            _, grad_h, grad_w = _chunk_loop(hidden, weight, targets, scale=scale, **ctx.options)
        else:
            grad_h, grad_w = ctx.saved_tensors
            if grad_h is not None:  # the multiply in fp32: a bf16-rounded grad_out would bias every gradient
                grad_h = grad_h * grad_out if grad_h.dtype == torch.float32 else (
                    grad_h.float().mul_(grad_out.float()).to(grad_h.dtype))
            if grad_w is not None:
                grad_w = grad_w * grad_out.float()
        if grad_w is not None:
            grad_w = grad_w.to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None, None, None


def _check_args(hidden: Any, weight: Any, targets: Any, reduction: str, chunk_size: int) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"kernels.linear_cross_entropy: reduction={reduction!r}; valid: {', '.join(_REDUCTIONS)}")
    if chunk_size < 1:
        raise ValueError(f"kernels.linear_cross_entropy: chunk_size={chunk_size}; must be >= 1")
    if hidden.dim() != 2 or weight.dim() != 2 or targets.dim() != 1:
        raise ValueError("kernels.linear_cross_entropy: expected hidden [N, H], weight [V, H], targets [N]")
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != targets.shape[0]:
        raise ValueError(
            f"kernels.linear_cross_entropy: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
            f"targets {tuple(targets.shape)} do not match"
        )


def linear_cross_entropy(
    hidden: Any,
    weight: Any,
    targets: Any,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int = 1024,
    backend: str = "torch",
) -> Any:
    """Cross-entropy of ``hidden @ weight.T`` against ``targets``, chunked over tokens (scalar loss)."""
    _check_name(backend)
    _check_args(hidden, weight, targets, reduction, chunk_size)
    is_dt = any(dt.is_dtensor(t) for t in (hidden, weight, targets))
    ref = None
    if is_dt:
        why = "the softmax normalizer is a reduction over the whole vocab and the matmul over hidden"
        for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
            dt.check_placements("linear_cross_entropy", name, t, allow_shard=False, why=why)
        dt.same_mesh("linear_cross_entropy", hidden, weight, targets)
        ref = hidden if dt.is_dtensor(hidden) else None
        hidden, weight, targets = dt.to_local(hidden), dt.to_local(weight), dt.to_local(targets)
    use_triton = resolve_backend(backend, hidden.device) == "triton"
    loss = LinearCrossEntropyFunction.apply(
        hidden, weight, targets, ignore_index, reduction, chunk_size, use_triton, torch.is_grad_enabled()
    )
    if ref is not None:
        return dt.DTensor.from_local(loss, ref.device_mesh, ref.placements, run_check=False)
    return loss
