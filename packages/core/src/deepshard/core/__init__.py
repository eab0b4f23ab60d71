"""deepshard.core: mesh, ZeRO stages 0-3 on DTensor placements, precision, optimizer, memory.

The names below are imported on first use (``lazy_exports``): a process that needs one small
submodule (the launcher's checkpoint-owner marker) does not pay for torch and the engine."""

from deepshard.core.lazy_exports import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "deepshard.core.config": ("EngineConfig", "OptimConfig", "ZeroConfig"),
    "deepshard.core.engine": ("Engine", "initialize"),
    "deepshard.core.mesh": ("ParallelDims", "build_mesh", "init_distributed"),
    "deepshard.core.precision": ("LossScaleAtMinimum", "LossScaler", "PrecisionConfig"),
    "deepshard.core.schedules": ("LRSchedule", "SchedulerConfig"),
    "deepshard.core.state_store": ("DeviceStateStore", "StateStore"),
    "deepshard.core.training_engine": ("TrainingEngine",),
    "deepshard.core.update_rule": ("AdamW", "UpdateRule"),
})

__all__ = [
    "AdamW", "DeviceStateStore", "Engine", "EngineConfig", "LRSchedule", "LossScaleAtMinimum", "LossScaler",
    "OptimConfig", "ParallelDims", "PrecisionConfig", "SchedulerConfig", "StateStore", "TrainingEngine", "UpdateRule",
    "ZeroConfig", "build_mesh", "init_distributed", "initialize",
]
