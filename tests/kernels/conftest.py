"""Triton tests run only where Triton's CPU interpreter is active for the whole process.

TRITON_INTERPRET is read by triton when it is first imported (its own library functions are
created then), and pytest collects every test folder in one process, so setting it here would be
too late or would leak into other folders. Instead, tests marked ``triton`` are deselected in a
normal run and ``test_kernels_triton_interpreter.py`` re-runs just them in a child pytest with
TRITON_INTERPRET=1 in its environment from the start.

On a CUDA host (without the interpreter) the ``triton`` tests run natively instead, on GPU tensors:
``pytest tests/kernels -m triton`` (bench/gpu_check.sh).  Their tensors are created on the CPU as
written and land on the GPU through a TorchFunctionMode: a factory call without ``device=`` gets
``cuda``, and one with a (CPU) ``generator`` draws on the CPU and is copied, so the numbers are the
same as on CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

from tests.kernels.kernels_testutil import HERE, INTERPRETING

NATIVE_GPU = torch.cuda.is_available() and not INTERPRETING


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "triton: runs a Triton kernel (on CPU only under TRITON_INTERPRET=1)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if INTERPRETING or NATIVE_GPU:
        return
    keep, drop = [], []
    for item in items:
        mine = HERE in Path(str(item.fspath)).resolve().parents
        (drop if mine and item.get_closest_marker("triton") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


class _OnCuda(TorchFunctionMode):
    """Tensor factories without ``device=`` create on the GPU (CPU-generator draws are copied there)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _device_constructors() and kwargs.get("device") is None:
            if kwargs.get("generator") is not None:
                return func(*args, **kwargs).to("cuda")
            kwargs = {**kwargs, "device": "cuda"}
        return func(*args, **kwargs)


@pytest.fixture(autouse=True)
def _triton_tests_on_gpu(request: pytest.FixtureRequest) -> Iterator[None]:
    if not (NATIVE_GPU and request.node.get_closest_marker("triton")):
        yield
        return
    with _OnCuda():
        yield
