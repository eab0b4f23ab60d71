"""The tests' app runner (tests/app_runner.py) is bypassed only where a run asks for it, never silently.

An environment variable left behind in the pytest worker (torch's elastic agent wrote one into the
launching process until ``launch_local`` gave the environment back) sent every later app run of the
worker to a fresh interpreter: ~2-9 s of CPU each, unseen.  Such drift now warns, naming the keys."""

from __future__ import annotations

import warnings

import pytest

from tests import app_runner

pytestmark = pytest.mark.slow  # starts the worker's runner (its imports) where no earlier test did


def test_a_drifted_environment_warns_naming_the_key(tmp_path, monkeypatch):
    app_runner._runner()  # the runner this worker's later runs share (already up in a full run)
    # what inductor writes into any process that loads a compiled kernel is read at run time: no drift
    monkeypatch.setenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = app_runner.run_module("json.tool", ["--help"], cwd=tmp_path)
    assert quiet.returncode == 0
    monkeypatch.setenv("DEEPSHARD_LEFT_BEHIND", "1")
    with pytest.warns(UserWarning, match=r"bypassed.*changed \[.*'DEEPSHARD_LEFT_BEHIND'.*\]"):
        run = app_runner.run_module("json.tool", ["--help"], cwd=tmp_path)
    assert run.returncode == 0 and "usage" in run.stdout
