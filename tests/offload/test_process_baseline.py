"""The processes of a local run before training (#31): what the preflight counts for them against
what the memory cgroup charges, and the trims that keep them small.

- A worker's garbage collections leave the forkserver's pages shared (the server freezes what its
  imports made): a full ``gc.collect()`` in a forked worker adds almost no private memory.
- In a real memory cgroup, a 2-worker tiny app run: the preflight's baseline (``job_baseline``, read
  in a fresh process with the app imported, as the launcher is at its preflight) is within 20% of
  what the group grows by from the preflight until both workers have joined their group; and the
  launcher, which only waits from then on, has given back what its input checks parsed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from deepshard.launch.local import launch_local

ROOT = Path(__file__).resolve().parents[2]
from bench.bench_infinity import cgroup_available  # noqa: E402
from bench.bench_process_baseline import estimate, measure  # noqa: E402

MiB = 2**20


def _private_dirty() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Private_Dirty:"):
            return int(line.split()[1]) * 1024
    return 0


def _gc_growth() -> int:
    import gc

    before = _private_dirty()
    gc.collect()
    return _private_dirty() - before


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs /proc/PID/smaps_rollup")
def test_a_workers_gc_does_not_copy_the_servers_pages():
    """Before the server froze its objects: +80 MB per worker at this collection (torch imported)."""
    grown = launch_local(_gc_growth, 2, threads_per_worker=1)
    assert max(grown) < 8 * MiB, [g / MiB for g in grown]


@pytest.mark.alone  # the group's usage counts page cache it reads first
@pytest.mark.slow
@pytest.mark.skipif(not cgroup_available(), reason="needs root and the cgroup v1 memory controller")
def test_baseline_estimate_matches_the_cgroup_and_the_launcher_trims():
    got = measure(["train.max_steps=2"], nproc=2)
    assert got["rc"] == 0, got.get("stderr")
    est = estimate(None, 2)
    preflight, started = got["at_server_start"], got["workers_started"]  # the server starts right after it
    launcher_then = preflight["procs"]["launcher"]["Anonymous"]
    predicted = 2 * est["per_rank"] + sum(v for k, v in est.items() if k != "per_rank")
    growth = started["usage"] - launcher_then  # MiB: the launcher at its preflight is the room's usage
    assert 0.8 <= predicted / growth <= 1.2, (predicted, growth, est, started)
    # the launcher's own growth through the input checks, once it waits (before the trim: +61 MiB)
    grown = started["procs"]["launcher"]["Private_Dirty"] - preflight["procs"]["launcher"]["Private_Dirty"]
    assert grown < 48, (grown, preflight["procs"]["launcher"], started["procs"]["launcher"])
