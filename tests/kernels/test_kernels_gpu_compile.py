"""Every Triton kernel compiles for a real GPU target (sm_90 -> cubin), with no GPU present.

The interpreter checks the numerics but not what only the compiler checks (types of loop-carried
values, int->pointer casts, constexpr use), so each kernel is also lowered through Triton's CUDA
pipeline here. Skipped under TRITON_INTERPRET=1, where triton.jit builds interpreter functions.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest

from deepshard.kernels.backend import FP_FUSION
from tests.kernels.kernels_testutil import INTERPRETING

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.skipif(INTERPRETING, reason="triton is in interpreter mode in this process"),
]


def _mod(name: str):
    return importlib.import_module(f"deepshard.kernels.{name}")


def _ptrs(dt: str, *names: str) -> dict[str, str]:
    return {n: f"*{dt}" for n in names}


def _ints(*names: str) -> dict[str, str]:
    return dict.fromkeys(names, "i32")


CASES = {
    "rms_norm_fwd": ("rms_norm", "_rms_norm_fwd_kernel",
                     {**_ptrs("bf16", "X", "W", "Y"), "RSTD": "*fp32", **_ints("stride_x", "stride_y", "n_cols"),
                      "eps": "fp32"}, {"BLOCK": 4096}),
    "rms_norm_bwd": ("rms_norm", "_rms_norm_bwd_kernel",
                     {**_ptrs("bf16", "DY", "X", "W"), "RSTD": "*fp32", "DX": "*bf16", "DW_PART": "*fp32",
                      **_ints("stride_dy", "stride_x", "stride_dx", "n_rows", "n_cols", "rows_per_program")},
                     {"BLOCK": 4096}),
    "swiglu_fwd": ("swiglu", "_swiglu_fwd_kernel", {**_ptrs("bf16", "GATE", "UP", "OUT"), "n": "i32"},
                   {"BLOCK": 1024}),
    "swiglu_bwd": ("swiglu", "_swiglu_bwd_kernel",
                   {**_ptrs("bf16", "DOUT", "GATE", "UP", "DGATE", "DUP"), "n": "i32"}, {"BLOCK": 1024}),
    "rope_bwd": ("rope", "_rope_kernel",
                 {**_ptrs("bf16", "X", "OUT", "COS", "SIN"),
                  **_ints("sx_b", "sx_h", "sx_s", "so_b", "so_h", "so_s", "sc_b", "sc_s", "seq_len", "n_heads", "half")},
                 {"BACKWARD": True, "BLOCK_H": 32, "BLOCK_D": 64}),
    "cross_entropy": ("fused_linear_cross_entropy", "_ce_fwd_bwd_kernel",
                      {"LOGITS": "*fp32", "stride": "i32", "TARGETS": "*i64", "LOSS": "*fp32", "SCALE": "*fp32",
                       **_ints("n_cols", "ignore_index")}, {"BLOCK": 4096}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_compiles_to_cubin(case: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, kernel, signature, constexprs = CASES[case]
    lazy = getattr(_mod(module), kernel)
    lazy.fn.__globals__["tl"] = tl
    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    src = ASTSource(fn=triton.jit(lazy.fn), signature=signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 8, "enable_fp_fusion": FP_FUSION})  # as our launches
    assert compiled.asm.get("cubin"), f"{case}: no cubin"
