"""RMSNorm: the Triton kernel (under the interpreter) against HF's formula; the module's HF mapping."""

from __future__ import annotations

import pytest
import torch

from deepshard.kernels import RMSNorm, rms_norm, rms_norm_reference
from tests.kernels.kernels_testutil import check_kernel

SHAPES = [(3, 37, 123), (5, 64), (2, 1, 1000)]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_triton_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x, w, dy = torch.randn(shape) * 3, 1 + 0.1 * torch.randn(shape[-1]), torch.randn(shape)
    check_kernel(
        lambda x, w: rms_norm(x, w, 1e-6, backend="triton"),
        lambda x, w: rms_norm_reference(x, w, 1e-6),
        [x, w], [dy], dtype, f"rms_norm{shape}",
    )


@pytest.mark.triton
def test_rms_norm_triton_mixed_dtype_promotes_like_hf() -> None:
    """bf16 activations with an fp32 weight give fp32 output in HF; the kernel must agree."""
    x = torch.randn(4, 33).bfloat16()
    w = torch.rand(33)
    y = rms_norm(x, w, backend="triton")
    assert y.dtype == torch.float32
    # the normalized activations pass through bf16 (as in HF): allow one bf16 ulp (interpreter truncates)
    torch.testing.assert_close(y, rms_norm_reference(x, w), rtol=2**-7, atol=1e-5)


def test_rms_norm_module_loads_hf_state_dict_and_matches_transformers() -> None:
    """The module against HF's own LlamaRMSNorm (an implementation we do not share), state dict and all."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    hf = LlamaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(48))
    norm = RMSNorm(48, eps=1e-5)
    norm.load_state_dict(hf.state_dict())
    x = torch.randn(2, 3, 48)
    torch.testing.assert_close(norm(x), hf(x))
    xb = x.bfloat16()  # HF computes in fp32 and casts back: so must we
    torch.testing.assert_close(norm.bfloat16()(xb), hf.bfloat16()(xb))


def test_rms_norm_bad_backend_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="kernels.*'cuda'.*auto, triton, torch"):
        RMSNorm(8, backend="cuda")
