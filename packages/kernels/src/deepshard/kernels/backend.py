"""Backend selection and lazy Triton loading shared by every kernel family.

Triton is never imported when ``deepshard.kernels`` is imported: kernels are written as plain
functions and handed to ``triton.jit`` on first launch (:class:`LazyKernel`). That keeps the package
importable without triton and lets ``TRITON_INTERPRET=1`` (Triton's CPU interpreter) be set any time
before triton itself is first imported.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch

Backend = Literal["triton", "torch"]
VALID_BACKENDS = ("auto", "triton", "torch")
# Every launch compiles with FP fusion (FMA) on, as the kernels were tested: Triton 3.9 defaults to it
# but warns that 3.10 turns it off, a warning the user cannot act on and a numerics change we choose.
FP_FUSION = True


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "on", "yes")


@functools.cache
def triton_importable() -> bool:
    """True when the triton package can be imported (checked once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """True when triton runs kernels through its CPU interpreter.

    Triton fixes the mode of its own library functions (``tl.sum``...) when it is first imported,
    so once imported we ask triton itself rather than the environment variable.
    """
    import sys

    if "triton" not in sys.modules:
        return _env_true("TRITON_INTERPRET")
    import triton.language.standard as std
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(std.sum, InterpretedFunction)


def _check_name(name: str) -> None:
    if name not in VALID_BACKENDS:
        raise ValueError(f"kernels backend={name!r} is not valid; choose one of {', '.join(VALID_BACKENDS)}")


def resolve_backend(name: str, device: torch.device | str | None = None) -> Backend:
    """Map ``auto|triton|torch`` to the backend that will run.

    ``auto`` picks triton only where it compiles (CUDA present, or ``device`` a CUDA device, and triton
    importable; a CPU tensor on a GPU host stays on torch); an explicit
    ``triton`` is honoured and, when ``device`` is given, checked now so a misconfiguration fails
    with a clear message instead of an obscure driver error at launch.
    """
    _check_name(name)
    if name == "torch":
        return "torch"
    if name == "auto":
        on_gpu = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
        return "triton" if on_gpu and triton_importable() else "torch"
    if device is not None:
        check_triton_device(torch.device(device))
    elif not triton_importable():
        raise RuntimeError("kernels backend='triton' requested but triton is not installed")
    return "triton"


def check_triton_device(device: torch.device) -> None:
    """Raise a clear error when a Triton kernel cannot run on ``device``."""
    if not triton_importable():
        raise RuntimeError("kernels backend='triton' requested but triton is not installed")
    if device.type == "cpu" and not triton_interpreting():
        raise RuntimeError(
            "kernels backend='triton' on a CPU tensor needs Triton's interpreter: set TRITON_INTERPRET=1 "
            "before triton is first imported (Triton has no CPU backend)"
        )


def compile_quietly(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """``torch.compile(fn, **options)``, after importing ``torch.utils.mkldnn`` (which inductor imports
    on the first compiled call) with its own ``torch.jit.script_method`` DeprecationWarnings silenced:
    torch's code, not the user's, and under ``-W error::DeprecationWarning`` they would fail that call."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is", category=DeprecationWarning)
        import torch.utils.mkldnn  # noqa: F401
    return torch.compile(fn, **options)


class LazyKernel:
    """A kernel function that is passed to ``triton.jit`` on its first launch.

    The function body refers to the module global ``tl``, which is bound to ``triton.language`` here
    just before jitting. Kernels must not call other jitted helpers (inline them instead).  Each
    launch passes ``enable_fp_fusion=FP_FUSION`` (the interpreter ignores it).
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._jitted: Any = None

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        if self._jitted is None:
            import triton
            import triton.language

            self.fn.__globals__["tl"] = triton.language
            self._jitted = triton.jit(self.fn)
        return functools.partial(self._jitted[grid], enable_fp_fusion=FP_FUSION)


def lazy_jit(fn: Callable[..., Any]) -> LazyKernel:
    """Decorator form of :class:`LazyKernel`."""
    return LazyKernel(fn)


def next_power_of_2(n: int) -> int:
    """Triton block sizes must be powers of two."""
    return 1 << max(0, (int(n) - 1).bit_length())


def num_warps_for(block: int) -> int:
    """Warps per program for a row of ``block`` elements (Liger's heuristic; ignored by the interpreter)."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def num_programs_hint(device: torch.device) -> int:
    """How many persistent programs to launch for row-looping kernels (SM count on CUDA)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter runs programs one after another; few programs keep it quick
