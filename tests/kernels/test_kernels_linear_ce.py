"""Chunked linear + cross-entropy (torch and Triton backends) against logits + F.cross_entropy."""

from __future__ import annotations

import pytest
import torch

from deepshard.kernels import linear_cross_entropy, linear_cross_entropy_reference
from tests.kernels.kernels_testutil import assert_fp32_close, check_kernel

# (tokens, hidden, vocab, chunk): vocab not a multiple of the chunk, a chunk larger than N, chunk 1
CASES = [(37, 24, 123, 16), (5, 33, 517, 64), (9, 8, 50, 1)]


def make(n: int, h: int, v: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h**0.5 * 3
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::4] = -100
    return hidden, weight, targets


def _check(backend: str, case: tuple[int, ...], dtype: torch.dtype, reduction: str) -> None:
    n, h, v, chunk = case
    hidden, weight, targets = make(n, h, v)
    check_kernel(
        lambda x, w: linear_cross_entropy(x, w, targets, reduction=reduction, chunk_size=chunk, backend=backend),
        lambda x, w: linear_cross_entropy_reference(x, w, targets, reduction=reduction),
        [hidden, weight], [torch.tensor(1.7)], dtype, f"linear_ce[{backend},{reduction}]{case}",
    )


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_chunked_torch_matches_reference(case: tuple[int, ...], dtype: torch.dtype, reduction: str) -> None:
    _check("torch", case, dtype, reduction)


@pytest.mark.triton
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_chunked_triton_matches_reference(case: tuple[int, ...], dtype: torch.dtype, reduction: str) -> None:
    _check("triton", case, dtype, reduction)


@pytest.mark.triton
def test_triton_vocab_spans_several_blocks() -> None:
    """Vocab > the kernel's 4096 block: the online logsumexp must carry across blocks."""
    _check("triton", (3, 8, 9000, 2), torch.float32, "mean")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_all_ignored_matches_torch_nan_loss_and_zero_grads(backend: str) -> None:
    hidden, weight, _ = make(6, 8, 20)
    targets = torch.full((6,), -1, dtype=torch.long)
    x, w = hidden.requires_grad_(), weight.requires_grad_()
    loss = linear_cross_entropy(x, w, targets, ignore_index=-1, chunk_size=4, backend=backend)
    ref = linear_cross_entropy_reference(hidden, weight, targets, ignore_index=-1)
    assert torch.isnan(loss) and torch.isnan(ref)
    loss.backward()
    assert torch.all(x.grad == 0) and torch.all(w.grad == 0)


def test_no_grad_path_and_weight_only_grad() -> None:
    hidden, weight, targets = make(37, 24, 123)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets, chunk_size=10)
    assert_fp32_close(loss, linear_cross_entropy_reference(hidden, weight, targets), "no-grad loss")
    w = weight.clone().requires_grad_()
    linear_cross_entropy(hidden, w, targets, chunk_size=10).backward()
    w_ref = weight.clone().requires_grad_()
    linear_cross_entropy_reference(hidden, w_ref, targets).backward()
    assert_fp32_close(w.grad, w_ref.grad, "weight grad")


def test_bad_arguments_are_value_errors() -> None:
    hidden, weight, targets = make(4, 8, 10)
    with pytest.raises(ValueError, match="reduction='none'"):
        linear_cross_entropy(hidden, weight, targets, reduction="none")
    with pytest.raises(ValueError, match="chunk_size=0"):
        linear_cross_entropy(hidden, weight, targets, chunk_size=0)
    with pytest.raises(ValueError, match="do not match"):
        linear_cross_entropy(hidden, weight[:, :4], targets)
