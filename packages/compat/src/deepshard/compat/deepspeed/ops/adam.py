"""``deepspeed.ops.adam.FusedAdam`` and ``DeepSpeedCPUAdam`` as torch optimizers with DeepSpeed's
signatures and math (``adam_w_mode``/``adamw_mode``: decoupled weight decay; off: L2 added to the
gradient, torch's Adam).  Stand-alone they step like torch's Adam; given to
``deepspeed.initialize(optimizer=...)`` their hyper-parameters become the engine's AdamW over fp32
masters (where the state lives is the ds_config's ``offload_optimizer``, as in DeepSpeed).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def _check(name: str, bias_correction: bool, amsgrad: bool) -> None:
    if not bias_correction:
        raise ValueError(f"{name}(bias_correction=False): not supported; deepshard's Adam always corrects the "
                         f"moments' bias (the default)")
    if amsgrad:
        raise ValueError(f"{name}(amsgrad=True): not supported (DeepSpeed's fused kernels refuse it too)")


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad)``."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        _check(type(self).__name__, bias_correction, amsgrad)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode)
        self.adam_w_mode = adam_w_mode


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's ``DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
    adamw_mode, fp32_optimizer_states)``: the same update as FusedAdam (DeepSpeed runs it on the host)."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        _check(type(self).__name__, bias_correction, amsgrad)
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPUAdam(fp32_optimizer_states=False): not supported; optimizer state is fp32")
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adamw_mode)
        self.adam_w_mode = adamw_mode


__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
