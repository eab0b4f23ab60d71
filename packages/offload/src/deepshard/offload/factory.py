"""The one entry point the app uses: a typed config in, a StateStore constructor out."""

from __future__ import annotations

import torch

from deepshard.core.state_store import AdamWConfig, DeviceStateStore, StateStore, StoreFactory

from .config import OffloadConfig, validate_config
from .cpu_store import CpuStateStore
from .nvme_store import NvmeStateStore


def make_store_factory(config: OffloadConfig, rank: int, run_id: str) -> StoreFactory:
    """Validate ``config`` now (before any model is built) and return the store constructor core calls.

    ``run_id`` names the launcher's run (its run id or pid) so swap dirs of a crashed run can be
    found and removed by :func:`deepshard.offload.remove_scratch`.  Space and buffer-size checks
    that need the shard sizes run when the store is built, still before the first step.
    """
    validate_config(config)
    if config.device == "none":
        return DeviceStateStore
    if config.device == "cpu":
        return CpuStateStore

    def nvme(params: list[torch.Tensor], weight_decays: list[float], adamw: AdamWConfig) -> StateStore:
        return NvmeStateStore(params, weight_decays, adamw, config=config, rank=rank, run_id=run_id)

    return nvme
