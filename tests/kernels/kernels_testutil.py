"""Comparison helpers shared by the kernel tests.

Tolerances (the same for every kernel):
- fp32: kernel vs the PyTorch reference with ``rtol=1e-5, atol=1e-5`` (values and every gradient).
- bf16: the kernel's max abs error against an fp64 oracle (the reference run on the same bf16
  inputs upcast to fp64) must be at most 2x PyTorch eager-bf16's own max error plus one bf16 ulp of
  the largest magnitude (``2**-8 * max|oracle|``): "at least about as accurate as eager bf16".
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
# decided once, at process start: see conftest.py for why the Triton tests need a fresh process
INTERPRETING = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")

FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}


def assert_fp32_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, **FP32_TOL, msg=lambda m: f"{what}: {m}")


def assert_bf16_close(actual: torch.Tensor, eager: torch.Tensor, oracle: torch.Tensor, what: str) -> None:
    assert actual.dtype == eager.dtype, f"{what}: dtype {actual.dtype} != {eager.dtype}"
    oracle = oracle.double()
    err = (actual.double() - oracle).abs().max().item()
    eager_err = (eager.double() - oracle).abs().max().item()
    bound = 2 * eager_err + 2**-8 * oracle.abs().max().item()
    assert err <= bound, f"{what}: max error {err:.3g} > bound {bound:.3g} (eager bf16 error {eager_err:.3g})"


def grads(outputs: torch.Tensor | tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...],
          cotangents: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(outputs, inputs, cotangents)


def leaf(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.detach().to(dtype).requires_grad_(True)


def check_kernel(kernel, reference, inputs: list[torch.Tensor], cotangents: list[torch.Tensor],
                 dtype: torch.dtype, what: str) -> None:
    """Compare ``kernel(*leaves)`` with ``reference(*leaves)``: every output and every input gradient.

    ``inputs`` are fp32 tensors, rounded to ``dtype`` first so kernel, eager and oracle all see the
    same values; the functions get leaves of one dtype (cast any other operand to ``leaves[0].dtype``).
    """
    base = [t.to(dtype) for t in inputs]

    def run(fn, cast: torch.dtype) -> list[torch.Tensor]:
        leaves = [leaf(b, cast) for b in base]
        outs = fn(*leaves)
        outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
        cots = [c.to(o.dtype) for c, o in zip(cotangents, outs)]
        return [o.detach() for o in outs] + list(torch.autograd.grad(outs, leaves, cots))

    got = run(kernel, dtype)
    names = [f"{what} out{i}" for i in range(len(cotangents))] + [f"{what} grad{i}" for i in range(len(inputs))]
    if dtype == torch.float32:
        for name, g, e in zip(names, got, run(reference, torch.float32)):
            assert_fp32_close(g, e, name)
    else:
        for name, g, e, o in zip(names, got, run(reference, dtype), run(reference, torch.float64)):
            assert_bf16_close(g, e, o, name)
