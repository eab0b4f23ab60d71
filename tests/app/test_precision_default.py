"""The default precision follows the host: bf16 on CUDA, fp32 on a CPU-only host; explicit choices stay."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deepshard.finetune.config import resolve_dtype

CONF = Path(__file__).resolve().parents[2] / "conf"


@pytest.mark.parametrize(("cuda", "want"), [(True, "bf16"), (False, "fp32")])
def test_auto_is_bf16_on_cuda_fp32_on_cpu(cuda, want):
    assert resolve_dtype("auto", cuda_available=cuda) == want


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("cuda", [True, False])
def test_explicit_dtype_is_kept(dtype, cuda):
    assert resolve_dtype(dtype, cuda_available=cuda) == dtype  # fp16 on CPU: runtime.fp16_fallback decides


def test_auto_is_the_configured_default():
    defaults = yaml.safe_load((CONF / "config.yaml").read_text())["defaults"]
    assert {"precision": "auto"} in defaults
    assert yaml.safe_load((CONF / "precision" / "auto.yaml").read_text()) == {"dtype": "auto"}
