"""Swap files are scratch: gone after close, exit, SIGINT/SIGTERM; crashes leave dirs the launcher can sweep."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from deepshard.core.update_rule import AdamW
from deepshard.offload import (
    AioConfig,
    NvmeStateStore,
    OffloadConfig,
    remove_scratch,
    remove_stale_scratch,
    scratch,
)

CHILD = textwrap.dedent("""
    import os, signal, sys, time, torch
    from deepshard.core.update_rule import AdamW
    from deepshard.offload import OffloadConfig, make_store_factory
    path, run_id, mode = sys.argv[1:4]
    if mode == "custom":
        def handler(signum, frame):
            open(os.path.join(path, f"handled-{run_id}"), "w").close()
            sys.exit(3)
        signal.signal(signal.SIGTERM, handler)
    cfg = OffloadConfig(device="nvme", nvme_path=path, sub_group_size=4096, buffer_size=4096)
    params = [torch.randn(20_000)]
    store = make_store_factory(cfg, 0, run_id)(params, [0.0], AdamW())
    assert os.listdir(store.dir)
    print("ready", flush=True)
    if mode == "exit":
        sys.exit(0)  # no close(): atexit must clean up
    step = 0
    while True:
        step += 1
        store.step([torch.randn(20_000)], lr=1e-3, step=step)
        time.sleep(0.01)
""")


def nvme_config(path) -> OffloadConfig:
    return OffloadConfig(device="nvme", nvme_path=str(path), sub_group_size=4096, buffer_size=4096,
                         aio=AioConfig(block_size=4096))


def test_close_removes_swap_files(tmp_path):
    store = NvmeStateStore([torch.randn(10_000)], [0.0], AdamW(), config=nvme_config(tmp_path),
                           run_id="close")
    files = [f.path for f in store.files.values()]
    assert all(os.path.exists(f) for f in files)
    store.close()
    store.close()  # idempotent
    assert not any(os.path.exists(f) for f in files)
    assert list(tmp_path.iterdir()) == []  # run and rank dirs too


def test_two_stores_share_a_rank_dir(tmp_path):
    a = NvmeStateStore([torch.randn(100)], [0.0], AdamW(), config=nvme_config(tmp_path), run_id="two")
    b = NvmeStateStore([torch.randn(100)], [0.0], AdamW(), config=nvme_config(tmp_path), run_id="two")
    assert a.dir != b.dir and a.dir.parent == b.dir.parent
    a.close()
    assert b.dir.exists() and all(os.path.exists(f.path) for f in b.files.values())
    b.close()
    assert list(tmp_path.iterdir()) == []


def test_forked_child_does_not_remove_parent_files(tmp_path):
    store = NvmeStateStore([torch.randn(100)], [0.0], AdamW(), config=nvme_config(tmp_path), run_id="fork")
    try:
        pid = os.fork()
        if pid == 0:  # e.g. a DataLoader worker hit by the same Ctrl-C
            scratch.cleanup_all()
            os._exit(0)
        os.waitpid(pid, 0)
        assert store.dir.exists()
    finally:
        store.close()


@pytest.mark.slow  # fault injection (signals), five fresh interpreters: the full suite only
def test_signals_exit_and_crash(tmp_path):
    """One child per case, run concurrently (each costs an `import torch`)."""
    cases = {"int": "loop", "term": "loop", "chain": "custom", "exit": "exit", "kill": "loop"}
    procs = {run_id: subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), run_id, mode],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for run_id, mode in cases.items()}
    try:
        for run_id, proc in procs.items():
            line = proc.stdout.readline()
            assert line.strip() == "ready", (run_id, line, proc.stderr.read() if proc.poll() is not None else "")
        time.sleep(0.3)  # let them get into the stepping loop
        procs["int"].send_signal(signal.SIGINT)
        procs["term"].send_signal(signal.SIGTERM)
        procs["chain"].send_signal(signal.SIGTERM)
        procs["kill"].send_signal(signal.SIGKILL)
        codes = {run_id: proc.wait(timeout=30) for run_id, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert codes["int"] != 0 and "KeyboardInterrupt" in procs["int"].stderr.read()
    assert codes["term"] == -signal.SIGTERM  # chained to the default action
    assert codes["chain"] == 3 and (tmp_path / "handled-chain").exists()  # previous handler ran
    assert codes["exit"] == 0 and codes["kill"] == -signal.SIGKILL
    for run_id in ("int", "term", "chain", "exit"):
        assert not (tmp_path / f"deepshard-{run_id}").exists(), run_id
    # SIGKILL leaves the files; the owner pid is dead, so a later run's sweep (or the launcher) removes them
    assert (tmp_path / "deepshard-kill").exists()
    assert remove_stale_scratch(tmp_path) == [tmp_path / "deepshard-kill"]
    assert not (tmp_path / "deepshard-kill").exists()


def test_remove_scratch_and_live_owner(tmp_path):
    store = NvmeStateStore([torch.randn(100)], [0.0], AdamW(), config=nvme_config(tmp_path), run_id="live")
    try:
        assert remove_stale_scratch(tmp_path) == []  # this process is alive: not stale
        assert remove_scratch(tmp_path, "live")
        assert not (tmp_path / "deepshard-live").exists()
        assert not remove_scratch(tmp_path, "live")
    finally:
        store.close()  # tolerates files already gone
