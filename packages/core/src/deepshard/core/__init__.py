"""deepshard.core: mesh, ZeRO stages 0-3 on DTensor placements, precision, optimizer, memory."""

from deepshard.core.config import EngineConfig, OptimConfig, ZeroConfig
from deepshard.core.engine import Engine, initialize
from deepshard.core.mesh import ParallelDims, build_mesh, init_distributed
from deepshard.core.precision import LossScaleAtMinimum, LossScaler, PrecisionConfig
from deepshard.core.schedules import LRSchedule, SchedulerConfig
from deepshard.core.state_store import AdamWConfig, DeviceStateStore, StateStore
from deepshard.core.trainer_protocol import Trainer

__all__ = [
    "AdamWConfig", "DeviceStateStore", "Engine", "EngineConfig", "LRSchedule", "LossScaleAtMinimum", "LossScaler",
    "OptimConfig", "ParallelDims", "PrecisionConfig", "SchedulerConfig", "StateStore", "Trainer", "ZeroConfig", "build_mesh",
    "init_distributed", "initialize",
]
