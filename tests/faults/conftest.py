"""The fault tests' shared launch: one world-2 app run that two tests read (test_job_lock.py and
test_run_faults.py check different things of the same layout, and the faults do not interfere: the
second jobs are refused and gone before rank 1 is stopped)."""

from __future__ import annotations

import pytest

from tests.faults.run_harness import StoppedJob, run_stopped_job


@pytest.fixture(scope="session")
def stopped_job(tmp_path_factory) -> StoppedJob:
    """tests.faults.run_harness.run_stopped_job, run once for the tests that read it."""
    return run_stopped_job(tmp_path_factory.mktemp("stopped"))
