"""deepshard.offload: optimizer-state stores in host memory and on NVMe for core's StateStore seam."""

from .aio import AioEngine, SwapFile, aligned_empty
from .config import AioConfig, OffloadConfig, validate_aio, validate_config, validate_nvme, validate_offload
from .cpu_store import CpuStateStore
from .factory import InfinityFactory, StoreFactory, make_store_factory, param_offload
from .infinity_store import InfinityStore
from .nvme_store import NvmeStateStore
from .param_swap import ParamSwap
from .pinned import host_buffer_stats, pinned_empty
from .scratch import remove_scratch, remove_stale_scratch

__all__ = [
    "AioConfig",
    "AioEngine",
    "CpuStateStore",
    "InfinityFactory",
    "InfinityStore",
    "NvmeStateStore",
    "OffloadConfig",
    "ParamSwap",
    "StoreFactory",
    "SwapFile",
    "aligned_empty",
    "host_buffer_stats",
    "make_store_factory",
    "param_offload",
    "pinned_empty",
    "remove_scratch",
    "remove_stale_scratch",
    "validate_aio",
    "validate_config",
    "validate_nvme",
    "validate_offload",
]
