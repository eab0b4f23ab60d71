"""A ZeRO-Infinity run that trains inside a memory cgroup also saves its checkpoint there.

The save writes 12 bytes per parameter (master and both moments) from the swap files.  DCP's writer
clones every tensor whose storage is larger than the tensor and holds each clone until its file is
written; the store's views used to share one mapping of a whole swap file, so the save held the rank's
whole state in anonymous memory and was OOM-killed after the training fitted.  Here a 20M-parameter
Llama (240 MB of checkpointed state) trains one step and saves inside a 352 MiB cgroup v1 group
(the trained process holds ~275 MiB of anonymous memory: torch, gloo, the swap buffers); the
checkpoint must be complete and verify.  Needs root and the memory controller (skipped otherwise). ~15 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.bench_infinity import cgroup_available, memory_cgroup  # noqa: E402
from deepshard.core.checkpoint.manifest import verify_checkpoint  # noqa: E402

LIMIT = 352 * 2**20
WORKER = Path(__file__).with_name("infinity_save_worker.py")


@pytest.mark.slow
@pytest.mark.skipif(not cgroup_available(), reason="needs root and the cgroup v1 memory controller")
def test_checkpoint_save_fits_where_training_fits(tmp_path):
    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    swap.mkdir()
    spec = {"nvme_path": str(swap), "ckpt": str(ckpt), "params_m": 20}
    env = {**os.environ, "OMP_NUM_THREADS": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29761", "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    with memory_cgroup(LIMIT) as group:
        cmd = ["sh", "-c", f'echo $$ > {group}/tasks && exec "$@"', "sh", sys.executable, str(WORKER), json.dumps(spec)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, f"rc {proc.returncode} (-9/137: OOM-killed) {proc.stderr[-1500:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    manifest = verify_checkpoint(out["saved"])  # every file's crc32 against the manifest
    assert manifest["step"] == 1
    written = sum(f["bytes"] for f in manifest["files"].values())
    assert written >= 12 * out["num_params"] > (LIMIT - 200 * 2**20)  # more state than the group had left
    assert not any(swap.iterdir()), "swap files left behind"
