"""Fixtures of the app's tests."""

import os

import pytest


@pytest.fixture(scope="session")
def inductor_cache(tmp_path_factory) -> str:
    """The run's inductor cache dir for compile tests (tests/inductor_cache.py: one for every process of
    the pytest run, so a graph compiled once, by any of them, is a cache hit for the next test)."""
    from tests.inductor_cache import CACHE_ENV

    return os.environ.get(CACHE_ENV) or str(tmp_path_factory.mktemp("inductor_cache"))
