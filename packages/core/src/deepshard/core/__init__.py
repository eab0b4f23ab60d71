"""deepshard.core: mesh, ZeRO stages 0-3 on DTensor placements, precision, optimizer, memory."""

from deepshard.core.config import EngineConfig, OptimConfig, ZeroConfig
from deepshard.core.engine import Engine, initialize
from deepshard.core.mesh import ParallelDims, build_mesh, init_distributed
from deepshard.core.precision import LossScaleAtMinimum, LossScaler, PrecisionConfig
from deepshard.core.schedules import LRSchedule, SchedulerConfig
from deepshard.core.state_store import DeviceStateStore, StateStore
from deepshard.core.training_engine import TrainingEngine
from deepshard.core.update_rule import AdamW, UpdateRule

__all__ = [
    "AdamW", "DeviceStateStore", "Engine", "EngineConfig", "LRSchedule", "LossScaleAtMinimum", "LossScaler",
    "OptimConfig", "ParallelDims", "PrecisionConfig", "SchedulerConfig", "StateStore", "TrainingEngine", "UpdateRule",
    "ZeroConfig", "build_mesh", "init_distributed", "initialize",
]
