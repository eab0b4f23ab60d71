"""SwiGLU: the Triton kernel (under the interpreter) against ``F.silu(gate) * up``."""

from __future__ import annotations

import pytest
import torch

from deepshard.kernels import SwiGLU, swiglu, swiglu_reference
from tests.kernels.kernels_testutil import check_kernel

SHAPES = [(3, 37, 123), (1, 1025), (7,)]


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_swiglu_triton_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    gate, up, dy = torch.randn(shape) * 4, torch.randn(shape), torch.randn(shape)
    check_kernel(
        lambda g, u: swiglu(g, u, backend="triton"), swiglu_reference, [gate, up], [dy], dtype, f"swiglu{shape}"
    )


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(-g) -> inf is intended
def test_swiglu_triton_extreme_gate_values_stay_finite() -> None:
    gate = torch.tensor([-1e4, -100.0, 0.0, 100.0, 1e4])
    up = torch.ones(5)
    torch.testing.assert_close(swiglu(gate, up, backend="triton"), swiglu_reference(gate, up))


def test_swiglu_module_matches_llama_mlp() -> None:
    torch.manual_seed(0)
    mlp = SwiGLU(16, 40)
    x = torch.randn(2, 5, 16)
    expected = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(mlp(x), expected)


def test_swiglu_shape_mismatch_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="swiglu"):
        swiglu(torch.randn(3, 4), torch.randn(3, 5))
