"""Fixtures of the app's tests."""

import pytest


@pytest.fixture(scope="session")
def inductor_cache(tmp_path_factory) -> str:
    """One inductor cache dir for the session's compile tests: a graph compiled once (by any process
    of the run: pool workers, the test process) is a cache hit for the next test."""
    return str(tmp_path_factory.mktemp("inductor_cache"))
