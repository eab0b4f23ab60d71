"""Rotary embedding: the Triton kernel (under the interpreter) against HF's apply_rotary_pos_emb."""

from __future__ import annotations

import pytest
import torch

from deepshard.kernels import apply_rotary, apply_rotary_reference
from tests.kernels.kernels_testutil import check_kernel


def hf_tables(seq: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin as HF's LlamaRotaryEmbedding builds them: [seq, head_dim], halves duplicated."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.outer(torch.arange(seq).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


# (batch, q_heads, kv_heads, seq, head_dim): GQA, odd seq, non-power-of-2 head_dim
SHAPES = [(2, 4, 2, 37, 18), (1, 3, 3, 5, 64), (3, 5, 1, 1, 6)]


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rope_triton_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    b, hq, hk, s, d = shape
    cos, sin = hf_tables(s, d)
    q, k = torch.randn(b, hq, s, d), torch.randn(b, hk, s, d)
    dq, dk = torch.randn_like(q), torch.randn_like(k)

    def kernel(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q, k, cos.to(q.dtype), sin.to(q.dtype), backend="triton")

    def reference(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary_reference(q, k, cos.to(q.dtype), sin.to(q.dtype))

    check_kernel(kernel, reference, [q, k], [dq, dk], dtype, f"rope{shape}")


@pytest.mark.triton
def test_rope_triton_general_tables_noncontiguous_q_and_batched_cos() -> None:
    """Arbitrary (non-duplicated) per-batch tables and HF's transposed [b, s, h, d] -> [b, h, s, d] view."""
    torch.manual_seed(0)
    b, h, s, d = 2, 3, 7, 10
    q = torch.randn(b, s, h, d).transpose(1, 2).requires_grad_()
    k = torch.randn(b, 1, s, d, requires_grad=True)
    cos, sin = torch.randn(b, s, d), torch.randn(b, s, d)
    dq, dk = torch.randn(b, h, s, d), torch.randn(b, 1, s, d)
    out = apply_rotary(q, k, cos, sin, backend="triton")
    got = [*out, *torch.autograd.grad(out, (q, k), (dq, dk))]
    ref = apply_rotary_reference(q, k, cos, sin)
    want = [*ref, *torch.autograd.grad(ref, (q, k), (dq, dk))]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.triton
def test_rope_triton_refuses_differentiable_tables() -> None:
    cos, sin = hf_tables(4, 8)
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="cos/sin"):
        apply_rotary(q, q, cos.requires_grad_(), sin, backend="triton")


def test_rope_torch_backend_is_hf_formula() -> None:
    cos, sin = hf_tables(5, 8)
    q = torch.randn(2, 3, 5, 8)
    q_out, _ = apply_rotary(q, q, cos, sin)
    q1, q2 = q.chunk(2, -1)
    torch.testing.assert_close(q_out, q * cos + torch.cat((-q2, q1), -1) * sin)


def test_rope_bad_layout_is_a_value_error() -> None:
    cos, sin = hf_tables(5, 8)
    with pytest.raises(ValueError, match="apply_rotary"):
        apply_rotary(torch.randn(3, 5, 8), torch.randn(3, 5, 8), cos, sin)
