"""Offload at world size 2 (real gloo ranks): ZeRO stages 1-3 with optimizer state on the host and on
NVMe train exactly like the same run without offload (fp32: losses and parameters within 1e-6)."""

from __future__ import annotations

import pytest
import torch

from deepshard.launch.local import launch_local
from tests.core.zero_harness import distributed_run, engine_config

STEPS = 4


def _worker(nvme_path: str):
    import torch.distributed as dist

    from deepshard.core import init_distributed
    from deepshard.offload import OffloadConfig, make_store_factory

    init_distributed()
    rank = dist.get_rank()
    out = {}
    for stage in (1, 2, 3):
        cfg = engine_config(stage, 2, 0.05)
        for device in ("none", "cpu", "nvme"):
            off = OffloadConfig(device=device, nvme_path=nvme_path if device == "nvme" else None,
                                sub_group_size=1000, buffer_size=1000, buffer_count=2)
            factory = make_store_factory(off, rank, "world2")
            losses, params, stats, memory = distributed_run(cfg, STEPS, store_factory=factory)
            out[(stage, device)] = (losses, params, memory["measured"].as_dict())
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = tmp_path_factory.mktemp("swap")
    results = launch_local(_worker, 2, str(path))
    assert not any(path.iterdir()), "swap files left behind"
    return results


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offload_matches_no_offload(runs, stage, device):
    for rank in (0, 1):
        base_losses, base_params, _ = runs[rank][(stage, "none")]
        losses, params, memory = runs[rank][(stage, device)]
        assert losses == pytest.approx(base_losses, rel=1e-6)
        for name, ref in base_params.items():
            torch.testing.assert_close(params[name], ref, rtol=1e-6, atol=0)
        if device == "nvme":  # the Adam moments left device memory
            assert memory["optimizer"] == 0 and memory["nvme"] > 0
