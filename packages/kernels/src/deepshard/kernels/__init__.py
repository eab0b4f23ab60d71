"""deepshard.kernels: Triton kernels for Llama training, each beside an exact PyTorch reference.

Every entry point takes ``backend`` in ``auto|triton|torch`` (see :func:`resolve_backend`). Importing
this package never imports triton; kernels are jitted on first launch.
"""

from deepshard.kernels.backend import VALID_BACKENDS, resolve_backend, triton_importable, triton_interpreting
from deepshard.kernels.fused_linear_cross_entropy import (
    linear_cross_entropy,
    linear_cross_entropy_reference,
)
from deepshard.kernels.rms_norm import RMSNorm, rms_norm, rms_norm_reference
from deepshard.kernels.rope import apply_rotary, apply_rotary_reference, rotate_half
from deepshard.kernels.swiglu import SwiGLU, swiglu, swiglu_reference

__all__ = [
    "VALID_BACKENDS",
    "RMSNorm",
    "SwiGLU",
    "apply_rotary",
    "apply_rotary_reference",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "resolve_backend",
    "rms_norm",
    "rms_norm_reference",
    "rotate_half",
    "swiglu",
    "swiglu_reference",
    "triton_importable",
    "triton_interpreting",
]
