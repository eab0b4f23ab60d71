"""deepshard.core: mesh, ZeRO stages 0-3 on DTensor placements, precision, optimizer, memory.

The names load with their module on first use (``deepshard.core.lazy``): a process that needs one
small module (a launcher's process helpers) does not import DTensor, FSDP and the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepshard.core.lazy import lazy_names

_HOMES = {
    "EngineConfig": "config", "OptimConfig": "config", "ZeroConfig": "config",
    "Engine": "engine", "initialize": "engine",
    "ParallelDims": "mesh", "build_mesh": "mesh", "init_distributed": "mesh",
    "LossScaleAtMinimum": "precision", "LossScaler": "precision", "PrecisionConfig": "precision",
    "LRSchedule": "schedules", "SchedulerConfig": "schedules",
    "DeviceStateStore": "state_store", "StateStore": "state_store",
    "TrainingEngine": "training_engine",
    "AdamW": "update_rule", "UpdateRule": "update_rule",
}
__all__ = [
    "AdamW", "DeviceStateStore", "Engine", "EngineConfig", "LRSchedule", "LossScaleAtMinimum", "LossScaler",
    "OptimConfig", "ParallelDims", "PrecisionConfig", "SchedulerConfig", "StateStore", "TrainingEngine", "UpdateRule",
    "ZeroConfig", "build_mesh", "init_distributed", "initialize",
]

if TYPE_CHECKING:
    from deepshard.core.config import EngineConfig, OptimConfig, ZeroConfig
    from deepshard.core.engine import Engine, initialize
    from deepshard.core.mesh import ParallelDims, build_mesh, init_distributed
    from deepshard.core.precision import LossScaleAtMinimum, LossScaler, PrecisionConfig
    from deepshard.core.schedules import LRSchedule, SchedulerConfig
    from deepshard.core.state_store import DeviceStateStore, StateStore
    from deepshard.core.training_engine import TrainingEngine
    from deepshard.core.update_rule import AdamW, UpdateRule

__getattr__, __dir__ = lazy_names(__name__, _HOMES)
