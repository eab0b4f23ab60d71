"""Shared test settings (one thread per process keeps multi-rank tests honest on 2 cores) and fixtures."""

import os

import pytest

from tests.alone import pytest_runtest_protocol, pytest_terminal_summary  # noqa: F401  (the `alone` marker's lock, hooks)
from tests.checkpoint.tmpfs import tmpfs_mounter
from tests.inductor_cache import pytest_configure as start_inductor_cache
from tests.inductor_cache import pytest_unconfigure  # noqa: F401  (one inductor cache per run)

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config: pytest.Config) -> None:
    """One inductor cache for the run; the CPU census (tests/cpu_census.py) where it is asked for."""
    import tests.cpu_census

    start_inductor_cache(config)
    config.pluginmanager.register(tests.cpu_census, "deepshard-cpu-census")


@pytest.fixture
def mount_tmpfs(tmp_path):
    """``mount_tmpfs("2m")``: a fresh tmpfs of that size under tmp_path, unmounted afterwards."""
    count = iter(range(1000))

    def new_dir():
        mnt = tmp_path / f"tmpfs-{next(count)}"
        mnt.mkdir()
        return mnt

    yield from tmpfs_mounter(new_dir)


# The files that take a minute or more (.ci/run's durations), heaviest first.  Under the two xdist workers
# (which take whole files in collection order) they start first, so the workers end together on the quick
# tests instead of one of them finishing a long file alone.
# The two SmolLM2 files go to one worker, one after the other (the first converts the weights, ~20 CPU-s; the
# second finds them), while the other worker starts on the compile tests.
HEAVY_FIRST = ("tests/models/test_smollm2.py", "tests/app/test_compile.py", "tests/models/test_smollm2_qlora.py",
               "tests/launch/test_cli_launch.py",
               "tests/launch/test_cli_restart.py", "tests/launch/test_node_restart.py",
               "tests/compat/test_hf_stack_launch.py", "tests/compat/test_hf_stack.py",
               "tests/zeropp/test_quantized.py", "tests/faults/test_slow_saves.py", "tests/faults/test_checkpoint_faults.py",
               "tests/compat/test_hf_trainer.py", "tests/faults/test_async_checkpoint_faults.py",
               "tests/faults/test_run_faults.py", "tests/checkpoint/test_app_preempt.py", "tests/zeropp/test_hsdp_qgz.py")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files in this order: :data:`HEAVY_FIRST`, then the other files with slow tests, then the quick ones
    (a stable sort: each file's tests keep their order, so its module fixtures start once)."""
    def path(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    slow = {path(item) for item in items if item.get_closest_marker("slow")}

    def rank(item: pytest.Item) -> tuple[int, int]:
        p = path(item)
        return (0, HEAVY_FIRST.index(p)) if p in HEAVY_FIRST else (1 if p in slow else 2, 0)

    items.sort(key=rank)


DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def no_process_group_outlives_its_test():
    """A test that joins a 1-rank group in this process (``deepspeed.initialize``, ``init_distributed``)
    leaves neither the group nor its environment behind: the next test's fake world would find the group,
    and an app it launches would inherit MASTER_PORT and collide with the group's store (EADDRINUSE)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # a wider-scoped fixture's group: not this test's
        yield
        return
    saved = {k: os.environ.get(k) for k in DIST_ENV}
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session", autouse=True)
def gloo_pool():
    """``gloo_pool(world).run(fn, *args)``: ``fn`` on ``world`` ranks of one gloo group kept for the whole
    run (tests/gloo_pool.py), each rank's result, rank-ordered.  For multi-rank work that is a plain
    function of the group; fault injection and per-process memory measurements keep ``launch_local``.
    (``tests.gloo_pool.pool`` is the same, for helpers that are not fixtures.)  Ends every pool at the end."""
    from tests.gloo_pool import close_pools, pool

    yield pool
    close_pools()
