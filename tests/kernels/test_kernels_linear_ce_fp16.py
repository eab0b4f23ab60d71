"""fp16 through the chunked linear + cross-entropy at DeepSpeed's loss scales (2^16 and up).

fp16 cannot hold a loss scale >= 65536 (its max is 65504) nor the unscaled per-token gradients of
a mean over many tokens (1/n_valid of a softmax underflows): the scale must reach the gradients
before they are rounded to fp16.  References, written here with plain torch: the logits
materialized in fp16 with F.cross_entropy (what an unfused fp16 model does), and the same loss in
fp32 with its gradients multiplied by the scale.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepshard.kernels import linear_cross_entropy

N, H, V, CHUNK = 192, 48, 3000, 64


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.05
    targets = torch.randint(0, V, (N,), generator=g)
    targets[: N // 3] = -100  # a masked prompt
    return hidden, weight, targets


def _grads(loss_fn, hidden: torch.Tensor, weight: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    (loss_fn(h, w) * scale).backward()
    return h.grad, w.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _plain(targets: torch.Tensor, reduction: str):
    return lambda h, w: F.cross_entropy((h @ w.t()).float(), targets, ignore_index=-100, reduction=reduction)


def _chunked(targets: torch.Tensor, reduction: str):
    return lambda h, w: linear_cross_entropy(h, w, targets, reduction=reduction, chunk_size=CHUNK, backend="torch")


@pytest.mark.parametrize("power", [16, 17, 18, 19, 20])
def test_fp16_scaled_grads_finite_and_equal_to_plain_fp16_loss(power: int) -> None:
    hidden, weight, targets = (t.half() if t.is_floating_point() else t for t in _data())
    scale = float(2**power)
    ours = _grads(_chunked(targets, "mean"), hidden, weight, scale)
    plain = _grads(_plain(targets, "mean"), hidden, weight, scale)
    for name, a, b in zip(("hidden", "weight"), ours, plain):
        assert a.dtype == torch.float16
        assert torch.isfinite(a).all(), f"{name} grad at scale 2^{power} is not finite"
        assert torch.isfinite(b).all()  # the reference itself does not overflow here
        assert _rel(a, b) < 1e-3, f"{name} grad at scale 2^{power}: {_rel(a, b):.2e}"


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fp16_at_65536_matches_scaled_fp32_reference(reduction: str) -> None:
    hidden, weight, targets = _data()
    scale = 65536.0 if reduction == "mean" else 65536.0 / (targets != -100).sum().item()
    ref = _grads(_plain(targets, reduction), hidden, weight, scale)  # fp32 throughout
    ours = _grads(_chunked(targets, reduction), hidden.half(), weight.half(), scale)
    for name, a, b in zip(("hidden", "weight"), ours, ref):
        assert torch.isfinite(a).all(), name
        assert _rel(a, b) < 1e-3, f"{name} ({reduction}): {_rel(a, b):.2e}"
        zeros, ref_zeros = int((a == 0).sum()), int((b == 0).sum())
        assert zeros <= ref_zeros, f"{name} ({reduction}): {zeros} exact zeros vs {ref_zeros} in the reference"


def test_sum_reduction_with_no_valid_token_is_zero_not_nan() -> None:
    hidden, weight, _ = _data()
    targets = torch.full((N,), -100)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy(h, w, targets, reduction="sum", chunk_size=CHUNK)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(h.grad) == 0 and torch.count_nonzero(w.grad) == 0
