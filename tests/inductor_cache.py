"""One inductor cache for the compile tests of a pytest run, shared by all its processes, and no
compile-worker pools (pytest hooks that tests/conftest.py imports).

The controller makes the dir before xdist starts its workers and names it in ``DEEPSHARD_TEST_INDUCTOR_CACHE``,
which every process of the run inherits (both workers, their gloo pools, the app runs); the compile tests
point ``TORCHINDUCTOR_CACHE_DIR`` at it (tests/app/conftest.py's ``inductor_cache``), so a graph compiled
once, by any of them, is a cache hit for the next.  It is fresh for each run (the tests measure cold
compiles, as on a fresh clone) and removed at its end.  Other processes keep inductor's default cache
(``/tmp/torchinductor_$USER``, kept between runs): host Adam's compiled step (deepshard.kernels.host_adam)
stays warm there from one run to the next.

``TORCHINDUCTOR_COMPILE_THREADS=1``: inductor's default on a 2-core host starts, in each process that
compiles C++, a sidecar and 2 compile workers that import torch again; the ranks of a test already take
the cores.  In process, tests/app/test_compile.py's launch took 93 s instead of 121 s (serially, here).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

CACHE_ENV = "DEEPSHARD_TEST_INDUCTOR_CACHE"
_OWNER = "_DEEPSHARD_TEST_INDUCTOR_CACHE_OWNER"  # the pid that made it (and removes it)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or CACHE_ENV in os.environ:  # an xdist worker, or a run inside a run
        return
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    if "torch._inductor.config" in sys.modules:  # inductor reads it at import: already read in this process
        sys.modules["torch._inductor.config"].compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])
    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="deepshard-inductor-")
    os.environ[_OWNER] = str(os.getpid())


def pytest_unconfigure(config: pytest.Config) -> None:
    if os.environ.get(_OWNER) != str(os.getpid()):
        return
    shutil.rmtree(os.environ.pop(CACHE_ENV), ignore_errors=True)
    os.environ.pop(_OWNER)
