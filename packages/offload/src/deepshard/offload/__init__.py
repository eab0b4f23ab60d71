"""deepshard.offload: optimizer-state stores in host memory and on NVMe for core's StateStore seam."""

from .aio import AioEngine, SwapFile, aligned_empty
from .config import AioConfig, OffloadConfig, validate_aio, validate_config, validate_nvme, validate_offload
from .cpu_store import CpuStateStore
from .factory import StoreFactory, make_store_factory
from .nvme_store import NvmeStateStore
from .pinned import host_buffer_stats, pinned_empty
from .scratch import remove_scratch, remove_stale_scratch

__all__ = [
    "AioConfig",
    "AioEngine",
    "CpuStateStore",
    "NvmeStateStore",
    "OffloadConfig",
    "StoreFactory",
    "SwapFile",
    "aligned_empty",
    "host_buffer_stats",
    "make_store_factory",
    "pinned_empty",
    "remove_scratch",
    "remove_stale_scratch",
    "validate_aio",
    "validate_config",
    "validate_nvme",
    "validate_offload",
]
