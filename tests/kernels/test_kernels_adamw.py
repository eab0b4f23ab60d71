"""Multi-tensor fused AdamW against torch.optim.AdamW over 10 steps (fp32, rtol=atol=1e-5)."""

from __future__ import annotations

import pytest
import torch
from kernels_testutil import assert_fp32_close

from deepshard.kernels import fused_adamw_, fused_adamw_reference

# odd sizes: smaller than a block, just over one, several, an empty one, a matrix
SHAPES = [(5,), (1030,), (3, 1001), (0,), (17, 19)]
HP = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _run(update) -> None:
    torch.manual_seed(0)
    params = [torch.randn(s) for s in SHAPES]
    ours = [p.clone() for p in params]
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    torch_params = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(
        torch_params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], weight_decay=HP["weight_decay"]
    )
    for step in range(1, 11):
        grads = [torch.randn_like(p) for p in params]
        update(ours, grads, exp_avgs, exp_avg_sqs, step=step, **HP)
        for p, g in zip(torch_params, grads):
            p.grad = g.clone()
        opt.step()
    for i, (p, q) in enumerate(zip(ours, torch_params)):
        assert_fp32_close(p, q.detach(), f"param {i}")
        assert_fp32_close(exp_avgs[i], opt.state[q]["exp_avg"], f"exp_avg {i}")
        assert_fp32_close(exp_avg_sqs[i], opt.state[q]["exp_avg_sq"], f"exp_avg_sq {i}")


def test_reference_matches_torch_adamw() -> None:
    _run(fused_adamw_reference)


def test_torch_backend_matches_torch_adamw() -> None:
    _run(lambda *a, **k: fused_adamw_(*a, **k, backend="torch"))


@pytest.mark.triton
def test_triton_backend_matches_torch_adamw() -> None:
    _run(lambda *a, **k: fused_adamw_(*a, **k, backend="triton"))


def test_rejects_non_fp32_and_bad_step() -> None:
    p = [torch.zeros(3, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match="fp32"):
        fused_adamw_(p, p, p, p, step=1, **HP)
    q = [torch.zeros(3)]
    with pytest.raises(ValueError, match="step=0"):
        fused_adamw_(q, q, q, q, step=0, **HP)
