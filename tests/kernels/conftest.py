"""Triton tests run only where Triton's CPU interpreter is active for the whole process.

TRITON_INTERPRET is read by triton when it is first imported (its own library functions are
created then), and pytest collects every test folder in one process, so setting it here would be
too late or would leak into other folders. Instead, tests marked ``triton`` are deselected in a
normal run and ``test_kernels_triton_interpreter.py`` re-runs just them in a child pytest with
TRITON_INTERPRET=1 in its environment from the start.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kernels_testutil import HERE, INTERPRETING


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "triton: runs a Triton kernel (on CPU only under TRITON_INTERPRET=1)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if INTERPRETING:
        return
    keep, drop = [], []
    for item in items:
        mine = HERE in Path(str(item.fspath)).resolve().parents
        (drop if mine and item.get_closest_marker("triton") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
