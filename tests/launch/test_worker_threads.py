"""OpenMP threads per local worker: the host's cores shared out per rank on GPU hosts, 1 on CPU-only hosts."""

from __future__ import annotations

import inspect
import os

import pytest

from deepshard.launch.local import launch_local, worker_threads


@pytest.mark.parametrize(("nproc", "cpus", "want"), [(8, 96, 12), (8, 100, 12), (1, 16, 16), (4, 2, 1), (3, 3, 1)])
def test_gpu_host_gives_each_rank_its_share_of_the_cores(nproc, cpus, want):
    assert worker_threads(nproc, cuda=True, cpus=cpus) == want


@pytest.mark.parametrize(("nproc", "cpus"), [(2, 2), (2, 64), (4, 2)])
def test_cpu_only_host_keeps_one_thread(nproc, cpus):
    assert worker_threads(nproc, cuda=False, cpus=cpus) == 1


def test_default_counts_the_cores_this_process_may_use():
    usable = len(os.sched_getaffinity(0))
    assert worker_threads(1, cuda=True) == usable
    assert worker_threads(usable * 2, cuda=True) == 1  # more ranks than cores: never 0
    assert inspect.signature(launch_local).parameters["threads_per_worker"].default is None  # auto


@pytest.mark.parametrize(("nproc", "gpus", "want"), [(2, 1, True), (4, 2, True), (2, 2, False), (2, 0, False)])
def test_more_workers_than_gpus_run_on_cpu(nproc, gpus, want):
    from deepshard.launch.local import workers_on_cpu

    assert workers_on_cpu(nproc, gpus) is want


def test_app_refuses_more_workers_than_gpus():
    from deepshard.finetune.config.world import resolve_nproc

    with pytest.raises(ValueError, match=r"launcher.nproc_per_node=2 > 1 visible GPU\(s\)"):
        resolve_nproc("2", 1)
    assert resolve_nproc("2", 0) == 2 and resolve_nproc("auto", 4) == 4


def _what_a_worker_sees() -> tuple[str | None, int, str]:
    import torch

    return os.environ.get("DEEPSHARD_TEST_MARK"), torch.get_num_threads(), os.getcwd()


@pytest.mark.slow
def test_each_launch_gives_its_workers_the_launchers_current_environment(tmp_path, monkeypatch):
    """Workers fork from a server started at the first launch: a later launch's environment, thread
    count and directory still reach its workers (as with spawn), not the first launch's."""
    monkeypatch.setenv("DEEPSHARD_TEST_MARK", "first")
    first = launch_local(_what_a_worker_sees, 1, threads_per_worker=1)
    monkeypatch.setenv("DEEPSHARD_TEST_MARK", "second")
    monkeypatch.chdir(tmp_path)
    second = launch_local(_what_a_worker_sees, 2, threads_per_worker=2)
    monkeypatch.delenv("DEEPSHARD_TEST_MARK")
    third = launch_local(_what_a_worker_sees, 1, threads_per_worker=1)
    assert first == [("first", 1, first[0][2])]
    assert second == [("second", 2, str(tmp_path))] * 2
    assert third == [(None, 1, str(tmp_path))]
