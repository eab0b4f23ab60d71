"""The app's config: Hydra's schema and the frozen ``Settings`` (``settings``), the ``+deepspeed=FILE``
overrides (``ds_config``) and Hydra's errors as one line (``hydra_errors``)."""

from deepshard.finetune.config.settings import (
    AppSchema,
    CheckpointConfig,
    DataConfig,
    LauncherConfig,
    PipelineConfig,
    ProfileConfig,
    Settings,
    TrainConfig,
    register,
    resolve_dtype,
    validate,
)

__all__ = ["AppSchema", "CheckpointConfig", "DataConfig", "LauncherConfig", "PipelineConfig", "ProfileConfig",
           "Settings", "TrainConfig", "register", "resolve_dtype", "validate"]
