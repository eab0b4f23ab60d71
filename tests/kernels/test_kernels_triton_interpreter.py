"""Runs every ``@pytest.mark.triton`` test of this folder in a child pytest with TRITON_INTERPRET=1.

The interpreter must be chosen before triton is first imported, which a shared pytest process cannot
promise (see conftest.py), so the Triton kernels are exercised in a fresh process. Run them directly,
with per-test output, via ``TRITON_INTERPRET=1 pytest tests/kernels -m triton``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tests.kernels.kernels_testutil import HERE, INTERPRETING

pytestmark = pytest.mark.slow  # a fresh interpreter running every kernel interpreted (~9 s)


@pytest.mark.skipif(INTERPRETING, reason="the Triton tests run in this process already")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_under_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    # -n 0: the project's addopts would start two xdist workers for ~30 quick tests (13.7 -> 6.9 CPU-s)
    cmd = [sys.executable, "-m", "pytest", "-n", "0", "-m", "triton", "-p", "no:cacheprovider", str(HERE)]
    out = subprocess.run(cmd, cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=900)
    log = out.stdout[-8000:] + out.stderr[-2000:]
    assert out.returncode == 0, log
    passed = re.search(r"(\d+) passed", out.stdout)
    assert passed and int(passed.group(1)) >= 30 and " skipped" not in out.stdout, log
