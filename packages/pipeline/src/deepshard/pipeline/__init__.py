"""deepshard.pipeline: split a decoder into stages, run torch.distributed.pipelining schedules,
and train the stages with core's ZeRO (and TP) on one (pp, dp, tp) mesh."""

from deepshard.pipeline.build import Pipeline, build_pipeline
from deepshard.pipeline.partition import partition_layers
from deepshard.pipeline.schedule import SCHEDULES, MicrobatchLoss, validate_pipeline
from deepshard.pipeline.split import DecoderSpec, StageLayers, split_model
from deepshard.pipeline.trainer import (
    CompositeStage,
    PipelineStepResult,
    PipelineTrainer,
    ShardedPart,
    build_trainer,
)

__all__ = [
    "SCHEDULES", "CompositeStage", "DecoderSpec", "MicrobatchLoss", "Pipeline", "PipelineStepResult",
    "PipelineTrainer", "ShardedPart", "StageLayers", "build_pipeline", "build_trainer",
    "partition_layers", "split_model", "validate_pipeline",
]
