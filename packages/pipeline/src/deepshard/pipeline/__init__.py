"""deepshard.pipeline: split a decoder into stages, run torch.distributed.pipelining schedules,
and train the stages with core's ZeRO (and TP) on one (pp, dp, tp) mesh."""

import warnings
from typing import Any

from deepshard.pipeline.build import Pipeline, build_pipeline
from deepshard.pipeline.engine import (
    CompositeStage,
    PipelineEngine,
    PipelineStepResult,
    ShardedPart,
    build_engine,
)
from deepshard.pipeline.partition import partition_layers
from deepshard.pipeline.schedule import SCHEDULES, MicrobatchLoss, validate_pipeline
from deepshard.pipeline.split import DecoderSpec, StageLayers, split_model

__all__ = [
    "SCHEDULES", "CompositeStage", "DecoderSpec", "MicrobatchLoss", "Pipeline", "PipelineStepResult",
    "PipelineEngine", "ShardedPart", "StageLayers", "build_pipeline", "build_engine",
    "partition_layers", "split_model", "validate_pipeline",
]

# names before issue 47, shipped in this package's README: deprecated aliases, warned on use
_RENAMED = {"PipelineTrainer": "PipelineEngine", "build_trainer": "build_engine"}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        warnings.warn(f"deepshard.pipeline.{name} is deprecated: use deepshard.pipeline.{_RENAMED[name]}",
                      DeprecationWarning, stacklevel=2)
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module 'deepshard.pipeline' has no attribute {name!r}")
