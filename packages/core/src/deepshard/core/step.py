"""The arithmetic of one training step, written once for every training engine (design.md, "The loss of a step").

The engine (``deepshard.core.initialize``) and the pipeline engine (``deepshard.pipeline``) both run a
step as: count the valid label tokens of the whole global batch (:func:`count_valid_tokens`), backprop
each micro-batch's *summed* token loss times :func:`loss_scale_factor`, report
:func:`token_mean`.  The gradient is then that of ``sum of token losses / global valid-token count``
whatever the layout (micro-batches, gradient accumulation, dp ranks, pipeline micro-batches, tp).

Extra loss terms (an MoE router's balancing loss) join the step without any engine or stepper
knowing them: the model calls :func:`add_aux_loss` in its forward (see there for the weighting).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from deepshard.core.dtensor_utils import local_tensor

IGNORE_INDEX = -100  # a label that does not count in the loss (prompt tokens, padding): torch's default

__all__ = ["IGNORE_INDEX", "add_aux_loss", "aux_loss_scale", "count_valid_tokens", "eval_mode", "local_valid_tokens",
           "loss_scale_factor", "num_params", "token_mean"]


def local_valid_tokens(labels: torch.Tensor | Iterable[torch.Tensor]) -> torch.Tensor:
    """This rank's label positions that count in the loss (``labels != -100``), over one tensor or
    several micro-batches' labels; an int64 tensor on the labels' device (no host sync)."""
    if isinstance(labels, torch.Tensor):
        return (labels != IGNORE_INDEX).sum()
    return sum((t != IGNORE_INDEX).sum() for t in labels)  # type: ignore[return-value]


def count_valid_tokens(local_count: int | torch.Tensor, *, group: dist.ProcessGroup | None,
                       device: torch.device) -> torch.Tensor:
    """The step's global valid-token count: this rank's count over all its micro-batches, summed over
    ``group`` (the ranks that split the batch: ZeRO's dp, or dp x sp) in one all-reduce.

    Call it once per step, before the first backward: every micro-batch's gradient is divided by
    the same count.  fp32 on ``device`` (collectives need the compute device), unclamped (a rank's
    share may be empty; :func:`loss_scale_factor` and :func:`token_mean` clamp the whole).
    """
    count = torch.as_tensor(local_count, dtype=torch.float32, device=device).reshape(())
    dist.all_reduce(count, group=group)
    return count


def loss_scale_factor(loss_scale: float, *, group_size: int, num_items: torch.Tensor | float | None = None,
                      micro_batches: int = 1, device: torch.device | None = None) -> torch.Tensor | float:
    """What a micro-batch's loss is multiplied by before ``backward``.

    - ``num_items`` given: the loss is the micro-batch's *summed* token loss and ``num_items`` the
      step's global count (:func:`count_valid_tokens`).  The factor is ``loss_scale * group_size /
      num_items``: times ``group_size`` because the ZeRO reducers average gradients over the group,
      so the reduced gradient is that of the global sum over the global count.
    - ``num_items=None`` (DeepSpeed's contract): the loss is the micro-batch's mean; the factor is
      ``loss_scale / micro_batches``, ranks averaged: a mean of means, exact only when every
      micro-batch holds as many valid tokens.

    ``device``: where the factor lives (the loss's device; default ``num_items``'s).
    """
    if num_items is None:
        return loss_scale / micro_batches
    if device is None and isinstance(num_items, torch.Tensor):
        device = num_items.device
    count = torch.as_tensor(num_items, dtype=torch.float32, device=device).clamp(min=1.0)
    return (loss_scale * group_size) / count


def token_mean(loss_sum: torch.Tensor, num_items: torch.Tensor, *, copies: int = 1) -> torch.Tensor:
    """The step's reported loss: the global summed token loss over the global valid-token count.
    ``copies``: how many ranks of the summing group contributed the same sum (tp ranks of a replica)."""
    return loss_sum / (copies * num_items.clamp(min=1.0))


def num_params(params: Iterable[torch.Tensor], *, shards: int = 1) -> int:
    """Ψ of the ZeRO memory formulas for this rank: its parameters after TP, before dp sharding.
    ``params`` are what the rank holds (DTensors count their local part); ``shards``: how many dp
    ranks split them (ZeRO-3's shards), 1 when each rank holds them whole."""
    return sum(local_tensor(p.data).numel() for p in params) * shards


@contextlib.contextmanager
def eval_mode(modules: nn.Module | Iterable[nn.Module]) -> Iterator[None]:
    """Modules in eval mode (dropout off) for a forward-only pass, each back in its own mode after."""
    mods = [modules] if isinstance(modules, nn.Module) else list(modules)
    was = [m.training for m in mods]
    for m in mods:
        m.eval()
    try:
        yield
    finally:
        for m, mode in zip(mods, was):
            m.train(mode)


# ---- extra loss terms


class _AuxLossGrad(torch.autograd.Function):
    """Identity on ``x`` in forward; in backward, ``aux``'s gradient is ``weight`` times the step's
    current aux scale (Megatron's MoEAuxLossAutoScaler): the term needs no path to the main loss, so
    it works on any pipeline stage and under any stepper."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(aux)
        ctx.weight = weight
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.weight * _AUX_SCALE[0]), None


_AUX_SCALE = [1.0]  # set by the engine for each backward (aux_loss_scale); 1.0 for a plain loop


def add_aux_loss(x: torch.Tensor, aux: torch.Tensor, *, weight: float) -> torch.Tensor:
    """Attach an extra loss term ``weight * aux`` (a scalar computed in the forward, e.g. an MoE
    router's load-balancing loss) to the activation ``x``; use the returned tensor in place of ``x``.

    The step's objective becomes ``sum of token losses / global valid-token count + weight * (mean of
    aux over every micro-batch of the global batch)``: the token-weighted main loss stays exact and
    the term is averaged per micro-batch, as DeepSpeed's and Megatron's MoE losses are.  The engine
    sets the scale (:func:`aux_loss_scale`); the reported loss is the main loss alone.  Outside
    autograd (eval, ``no_grad``) it is the identity.
    """
    if not (torch.is_grad_enabled() and aux.requires_grad):
        return x
    return _AuxLossGrad.apply(x, aux, float(weight))


@contextlib.contextmanager
def aux_loss_scale(loss_scale: float, *, micro_batches: int) -> Iterator[None]:
    """For the backwards inside it: an extra term's gradient is ``weight * loss_scale / micro_batches``
    (``micro_batches`` on this rank this step; the ZeRO reducers average the ranks), so each term
    counts as its mean over the global batch's micro-batches at the fp16 loss scale."""
    was = _AUX_SCALE[0]
    _AUX_SCALE[0] = loss_scale / micro_batches
    try:
        yield
    finally:
        _AUX_SCALE[0] = was
