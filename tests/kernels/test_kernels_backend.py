"""Backend selection, and that importing the package neither needs nor imports triton."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from deepshard.kernels import resolve_backend, triton_interpreting


def test_bad_name_is_a_value_error_naming_kernels_value_and_choices() -> None:
    with pytest.raises(ValueError, match=r"kernels.*'cuda'.*auto, triton, torch"):
        resolve_backend("cuda")


def test_torch_and_auto_on_cpu() -> None:
    assert resolve_backend("torch") == "torch"
    if not torch.cuda.is_available():
        assert resolve_backend("auto") == "torch"
    assert resolve_backend("auto", torch.device("cpu")) == "torch"  # even on a GPU host


@pytest.mark.skipif(triton_interpreting(), reason="the interpreter is active in this process")
def test_triton_on_cpu_without_interpreter_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", torch.device("cpu"))


@pytest.mark.triton
@pytest.mark.skipif(not triton_interpreting(), reason="CPU tensors take Triton only under the interpreter")
def test_triton_on_cpu_under_interpreter_resolves() -> None:
    assert resolve_backend("triton", "cpu") == "triton"


_CHILD = """
import sys
import torch
import deepshard.kernels as k
x = torch.randn(3, 8)
k.rms_norm(x, torch.ones(8)); k.swiglu(x, x)
assert "triton" not in sys.modules, "importing/using the torch paths imported triton"
sys.modules["triton"] = None  # from here on triton is 'absent'
import importlib; importlib.reload(k.backend)
assert k.backend.resolve_backend("auto") == "torch"
try:
    k.backend.resolve_backend("triton")
except RuntimeError as e:
    assert "not installed" in str(e), e
else:
    raise AssertionError("expected RuntimeError")
print("ok")
"""


def test_import_is_lazy_and_works_without_triton() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr
