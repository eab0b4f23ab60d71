"""``deepspeed.runtime.zero.partition_parameters``: ``ZeroParamStatus`` and the ZeRO-3 context managers.

``zero_wrapper_for_fp_tensor_constructor`` and ``_orig_torch_arange`` are the names transformers'
``prevent_arange_dtype_change`` swaps around ``zero.Init`` under ``from_pretrained`` (DeepSpeed wraps
torch's tensor constructors to cast and place them).  Our ``Init`` builds parameters on the meta
device and wraps no constructor, so the wrapper is the identity and RoPE buffers keep their dtype.
"""

from collections.abc import Callable
from typing import Any

import torch

from ...zero import GatheredParameters, Init, ZeroParamStatus, register_external_parameter

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: Any = None,
                                           target_device: Any = None) -> Callable:
    """DeepSpeed's constructor wrapper: here ``fn`` itself (nothing is cast or moved)."""
    return fn


__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "zero_wrapper_for_fp_tensor_constructor"]
