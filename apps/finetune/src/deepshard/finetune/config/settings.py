"""The app's typed config: dataclasses registered in Hydra's ConfigStore, and their validation.

Library configs (core's ``ZeroConfig``, ``OptimConfig``, a model family's config, ``LoraConfig``, ...) are
frozen and validate themselves; Hydra needs mutable twins with the same fields, made here so the two
can never drift apart.  Every default lives in one place: these dataclasses (a twin's are its library
config's); a file under conf/ sets only what its choice changes (``+zero=stage3`` sets ``stage: 3``).
The dataclasses win over the YAML because the library configs need defaults anyway, for users who
call ``deepshard.core.initialize`` without Hydra.

``validate`` turns a composed config into one frozen ``Settings``, in the launcher, before any
worker starts, raising one ValueError that names the key, the value and what is valid; the workers
receive that object.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from deepshard.compat.resolve import host_dtype
from deepshard.core import OptimConfig, PrecisionConfig, SchedulerConfig, ZeroConfig
from deepshard.core.config import AC_MODES, EngineConfig
from deepshard.core.config_error import named
from deepshard.core.mesh import ParallelDims
from deepshard.finetune.config.compile_check import check_compile
from deepshard.finetune.config.ds_config import resolve_batch_as_given
from deepshard.finetune.config.layout_checks import (
    check_ep,
    check_mlp_tiles,
    check_padding,
    check_param_swap,
    validate_pipeline_layout,
    validate_sp,
    validate_zeropp,
)
from deepshard.finetune.config.world import host_world_size, resolve_nproc
from deepshard.finetune.models import registry
from deepshard.finetune.models.lora import LoraConfig, check_lora_parallel, lora_settings
from deepshard.kernels import resolve_backend
from deepshard.offload import AioConfig, OffloadConfig, validate_config, validate_offload

# A switch's field in the Hydra schema is typed Any, marked with this: OmegaConf's bool would take 2, 0,
# 'yes' or 'off' as a boolean; Any keeps what was given, and check_switches wants true or false.
SWITCH = {"switch": True}


def switch(default: bool) -> Any:
    """A schema field for a boolean key (see SWITCH)."""
    return field(default=default, metadata=SWITCH)


def hydra_twin(cls: type, name: str, exclude: tuple[str, ...] = (), unset: tuple[str, ...] = ()) -> type:
    """A mutable dataclass with ``cls``'s fields and defaults (tuples become lists for OmegaConf,
    booleans switches: :data:`SWITCH`; ``unset``: default None, "pick for me")."""
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        tp = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(tp):  # nested config: its own mutable twin
            twin = hydra_twin(tp, f"{tp.__name__}Schema")
            fields.append((f.name, twin, field(default_factory=twin)))
        elif f.name in unset:
            fields.append((f.name, typing.Optional[tp], field(default=None)))  # noqa: UP045 - OmegaConf
        elif tp is bool:
            fields.append((f.name, Any, switch(default)))
        elif typing.get_origin(tp) is tuple:  # tuple[float, float] or tuple[str, ...]
            tp = list[typing.get_args(tp)[0]]
            fields.append((f.name, tp, field(default_factory=lambda d=default: list(d))))
        else:
            fields.append((f.name, tp, field(default=default)))
    return dataclasses.make_dataclass(name, fields)


ZeroSchema = hydra_twin(ZeroConfig, "ZeroSchema")
OptimSchema = hydra_twin(OptimConfig, "OptimSchema")
SchedulerSchema = hydra_twin(SchedulerConfig, "SchedulerSchema")
# plus the app's own switch: fp16 on a CPU-only host really runs fp16 (slowly) instead of falling back to fp32
PrecisionSchema = dataclasses.make_dataclass(
    "PrecisionSchema", [("force_fp16_on_cpu", Any, switch(False))],
    bases=(hydra_twin(PrecisionConfig, "PrecisionTwin"),))
ParallelSchema = hydra_twin(ParallelDims, "ParallelSchema")
# left out (None), these the preflight picks for the memory the run has, and says so (param_buffer_size:
# validate makes it the largest gathered unit's shard); a given value is kept
OFFLOAD_PICKS = ("sub_group_size", "buffer_count", "param_buffer_count", "param_prefetch", "param_buffer_size")
OffloadSchema = hydra_twin(OffloadConfig, "OffloadSchema", unset=OFFLOAD_PICKS)


MOE_RUN_KEYS = {"capacity_factor": float, "eval_capacity_factor": float, "min_capacity": int, "drop_tokens": bool,
                "router_z_loss_coef": float}

# the architecture's keys and defaults are the default family's config's (the tiny preset); ``kernels``
# is the top-level key
ModelSchema = dataclasses.make_dataclass(
    "ModelSchema", [("name", str, field(default="tiny")),  # tiny | small | hf
                    ("path", typing.Optional[str], field(default=None)),  # noqa: UP045 - OmegaConf needs Optional
                    # MoE run-time keys (models/moe.py); None: the family's default (dropless, no z-loss)
                    *((k, typing.Optional[t], field(default=None)) for k, t in MOE_RUN_KEYS.items())],  # noqa: UP045
    bases=(hydra_twin(registry.get(registry.DEFAULT_FAMILY).config, "ArchTwin", exclude=("kernels",)),))


AUTO = ("auto", "auto_or_fresh")  # checkpoint.resume values that search checkpoint.dir


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 0  # 0: only at the end (and on preemption)
    keep_last: int = 3  # 0 keeps every checkpoint
    # auto: the newest good checkpoint under dir (none there: start fresh; some, none usable: an error)
    # | auto_or_fresh: the same, but starts fresh (with a warning) when none is usable | none | PATH
    # (a step-* directory, or a folder of them)
    resume: str = "auto"
    dir: typing.Optional[str] = None  # noqa: UP045 - OmegaConf needs Optional; default <run dir>/checkpoints
    on_error: str = "stop"  # a failed save (disk full, I/O error): stop the run | continue training
    # true: the step waits only while the state is copied into host buffers (one copy, reused); a writer
    # thread writes, verifies and seals it (``async`` itself is a Python keyword, so the key is async_save)
    async_save: bool = False
    async_policy: str = "wait"  # a save due while one is still being written: wait for it | skip this one


def validate_checkpoint(c: dict[str, Any]) -> CheckpointConfig:
    """Typed checkpoint settings; ValueError naming the key."""
    s = CheckpointConfig(**c)
    for key in ("every_steps", "keep_last"):
        value = getattr(s, key)
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"checkpoint.{key}={value}: must be an integer >= 0")
    if not isinstance(s.async_save, bool):
        raise ValueError(f"checkpoint.async_save={s.async_save!r}: must be true or false")
    if s.async_policy not in ("wait", "skip"):
        raise ValueError(f"checkpoint.async_policy={s.async_policy!r}: valid values are 'wait' and 'skip'")
    if s.on_error not in ("stop", "continue"):
        raise ValueError(f"checkpoint.on_error={s.on_error!r}: valid values are 'stop' and 'continue'")
    if s.resume not in AUTO + ("none",) and not Path(s.resume).is_dir():
        raise ValueError(f"checkpoint.resume={s.resume!r}: valid values are 'auto', 'auto_or_fresh', 'none' or an "
                         f"existing checkpoint directory")
    return s


@dataclass(frozen=True)
class DataConfig:
    name: str = "embedded"  # embedded | jsonl | text | hf_disk
    path: typing.Optional[str] = None  # noqa: UP045 - a file, directory or glob
    seq_len: int = 128
    num_docs: int = 3000
    seed: int = 0
    pack: bool = True  # false: one document per row, padded with -100 labels
    doc_mask: bool = True  # packed rows: attention stays inside each document
    eval_fraction: float = 0.0  # documents held out for eval loss / perplexity
    # the eval set from its own file/dir/glob, read as data.path is (then data.path trains whole and
    # eval_fraction is not applied); not for data=embedded
    eval_path: typing.Optional[str] = None  # noqa: UP045
    text_field: str = "text"
    prompt_field: str = "prompt"
    response_field: str = "response"
    text_unit: str = "file"  # data=text: file | paragraph | line is one document
    split: str = "train"  # data=hf_disk: the split of a saved DatasetDict
    chat_template: typing.Optional[str] = None  # noqa: UP045 - data=chat: a Jinja file (default: the tokenizer's)
    # data.pack=false: each batch padded to its longest row rounded up to this multiple (at most seq_len),
    # not every row to seq_len; null/0: off (data/collate.py)
    pad_to_multiple_of: typing.Optional[int] = None  # noqa: UP045


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = 100
    micro_batch_size: int = 8
    grad_accum: int = 1
    log_every: int = 10
    seed: int = 0
    global_batch_size: int = 0  # DeepSpeed's train_batch_size; 0: micro_batch_size * grad_accum * dp
    eval_every: int = 0  # steps between evals (0: only at the end, when data.eval_fraction > 0)
    sample_prompt: typing.Optional[str] = None  # noqa: UP045 - greedy sample from rank 0 at the end
    sample_tokens: int = 16
    tensorboard_dir: typing.Optional[str] = None  # noqa: UP045 - default: <run dir>/tensorboard
    # without a dynamic loss scale (fp32, bf16): this many consecutive non-finite steps stop the run
    max_bad_steps: int = 3
    # an update that leaves the parameters' global norm more than this many times the newest good
    # state's is a bad step (divergence.py); 0: only non-finite parameters are
    max_param_growth: float = 10.0


@dataclass(frozen=True)
class PipelineConfig:
    """Used when parallel.pp > 1 (or tp > 1): torch.distributed.pipelining stages and schedule."""

    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zero_bubble
    microbatches: int = 4  # micro-batches per step and dp replica (the pipeline's gradient accumulation)
    partition: str = "uniform"  # uniform | parameters | type:REGEX (DeepSpeed's partition_method)
    virtual_stages: int = 0  # stages per rank for the interleaved schedules; 0: the schedule's default


# ``+peft=lora``: LoRA adapters on a frozen base (models/lora.py), defaults LoraConfig'; name none trains
# every weight
PeftSchema = dataclasses.make_dataclass(
    "PeftSchema", [("name", str, field(default="none"))],  # none | lora
    bases=(hydra_twin(LoraConfig, "LoraTwin"),))


@dataclass(frozen=True)
class ProfileConfig:
    enabled: bool = False  # per-step wall-clock split, FLOP/s and MFU
    trace_steps: tuple[int, ...] = ()  # steps to record a torch.profiler trace of
    peak_tflops: float = 0.0  # per-rank peak for MFU; 0: from the device table


@dataclass(frozen=True)
class LauncherConfig:
    nproc_per_node: str = "auto"  # auto: every local GPU, or 2 workers on a CPU-only host
    # bytes; > 0 fixes glibc's mmap threshold in the workers, so freed host buffers leave RSS
    # (about half the peak RSS of a CPU ZeRO-3 run, at ~30% step time); 0 keeps glibc's default
    malloc_mmap_threshold: int = 0
    timeout_s: float = 600.0  # collective timeout of the process group (a rank that never answers)
    hang_s: float = 300.0  # the launcher stops a job whose rank made no progress this long; 0: never
    # on SIGTERM/SIGINT to the launcher, the workers finish their step and save; this long after the
    # signal, whatever still runs is SIGKILLed (torchelastic's shutdown timeout); keep it under the
    # scheduler's own grace, and above a save's time, or the preemption's save is lost
    shutdown_grace_s: int = 30


# Hydra's mutable twins of the app's own sections (Settings holds the frozen configs above)
TrainSchema = hydra_twin(TrainConfig, "TrainSchema")
LauncherSchema = hydra_twin(LauncherConfig, "LauncherSchema")
DataSchema = hydra_twin(DataConfig, "DataSchema")
ProfileSchema = hydra_twin(ProfileConfig, "ProfileSchema")
PipelineSchema = hydra_twin(PipelineConfig, "PipelineSchema")
CheckpointSchema = hydra_twin(CheckpointConfig, "CheckpointSchema")


@dataclass
class AppSchema:
    train: TrainSchema = field(default_factory=TrainSchema)  # type: ignore[valid-type]
    launcher: LauncherSchema = field(default_factory=LauncherSchema)  # type: ignore[valid-type]
    model: ModelSchema = field(default_factory=ModelSchema)
    data: DataSchema = field(default_factory=DataSchema)  # type: ignore[valid-type]
    optim: OptimSchema = field(default_factory=OptimSchema)  # type: ignore[valid-type]
    scheduler: SchedulerSchema = field(default_factory=SchedulerSchema)  # type: ignore[valid-type]
    precision: PrecisionSchema = field(default_factory=PrecisionSchema)  # type: ignore[valid-type]
    zero: ZeroSchema = field(default_factory=ZeroSchema)  # type: ignore[valid-type]
    parallel: ParallelSchema = field(default_factory=ParallelSchema)  # type: ignore[valid-type]
    offload: OffloadSchema = field(default_factory=OffloadSchema)  # type: ignore[valid-type]
    profile: ProfileSchema = field(default_factory=ProfileSchema)  # type: ignore[valid-type]
    pipeline: PipelineSchema = field(default_factory=PipelineSchema)  # type: ignore[valid-type]
    peft: PeftSchema = field(default_factory=PeftSchema)
    # auto: none, unless the run's working set needs ac=full to fit the memory its workers will have
    # (preflight picks it and says so); none | full | every_2 as given
    ac: str = "auto"
    ac_offload: Any = switch(False)  # the checkpointed blocks' inputs kept in host memory (ac=full or every_2)
    kernels: str = "auto"  # auto | triton | torch: fused Triton kernels where CUDA is present
    compile: Any = switch(False)  # torch.compile per block (after TP and AC, before ZeRO)
    checkpoint: CheckpointSchema = field(default_factory=CheckpointSchema)  # type: ignore[valid-type]


def check_switches(cfg: dict, schema: type = AppSchema, prefix: str = "") -> None:
    """Every boolean key of a composed config holds true or false (``checkpoint.async_save=2`` is a
    mistake, not a yes); ValueError naming the first that does not."""
    for f in dataclasses.fields(schema):
        value = cfg.get(f.name)
        if f.metadata.get("switch"):
            if not isinstance(value, bool):
                raise ValueError(f"{prefix}{f.name}={value!r}: must be true or false")
        elif dataclasses.is_dataclass(f.default_factory) and isinstance(value, dict):
            check_switches(value, f.default_factory, f"{prefix}{f.name}.")


def warmup_steps(total: int, fraction: float) -> int:
    """``${warmup_steps:${train.max_steps},0.1}``: a warm-up that always fits inside the run."""
    return max(0, min(int(total * fraction), total - 1))


def register() -> None:
    """The schema for Hydra and the resolvers conf/ uses."""
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="app_schema", node=AppSchema)
    if not OmegaConf.has_resolver("warmup_steps"):
        OmegaConf.register_new_resolver("warmup_steps", warmup_steps)


@dataclass(frozen=True)
class Settings:
    """Everything a worker needs, typed and validated once, before any worker starts (it pickles)."""

    engine: EngineConfig
    model: Any  # a model family's config (``registry.spec_of(model)``: its family)
    model_name: str
    model_path: str | None
    world_size: int  # torchrun's, or the local workers the app starts
    parallel: ParallelDims  # resolved for world_size: dp is never -1 here
    offload: OffloadConfig
    train: TrainConfig  # the batch triple resolved for the data-parallel size
    data: DataConfig
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    peft: LoraConfig | None = None  # +peft=lora
    ac_auto: bool = False  # ac=auto: engine.ac (none) may become full where memory needs it (preflight)
    # offload keys left out (OFFLOAD_PICKS): ``offload`` holds OffloadConfig's defaults there until the
    # preflight picks them (and empties this); the workers get plain values and nothing left to pick
    offload_picks: tuple[str, ...] = ()

    @property
    def uses_pipeline(self) -> bool:
        """Pipeline parallel: the model goes through deepshard.pipeline (tp alone runs in the engine)."""
        return self.parallel.pp > 1

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches of ``train.micro_batch_size`` rows per dp rank and step: under pp the schedule
        runs ``pipeline.microbatches`` of them for each of the ``train.grad_accum`` accumulations."""
        return self.train.grad_accum * (self.pipeline.microbatches if self.uses_pipeline else 1)

    def tokens_per_step(self, dp_size: int) -> int:
        """Token positions of one optimizer step over all data-parallel ranks (the tokens/s numerator)."""
        return self.train.micro_batch_size * self.micro_batches_per_step * self.data.seq_len * dp_size


def _positive(key: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}={value}: must be a positive integer")


def _at_least(key: str, value: float, low: float, note: str = "") -> None:
    if isinstance(value, float) and not math.isfinite(value):  # nan compares false: it would pass below
        raise ValueError(f"{key}={value}: must be a finite number >= {low}{note}")
    if value < low:
        raise ValueError(f"{key}={value}: must be >= {low}{note}")


def _validate_launcher(c: dict) -> LauncherConfig:
    """Timeouts: a positive collective timeout; a hang limit >= 0 (0: off).  A hang limit at or above
    the collective timeout never fires first: the waiting rank's collective times out instead."""
    s = LauncherConfig(**{**c, "nproc_per_node": str(c["nproc_per_node"])})
    resolve_nproc(s.nproc_per_node, 0)  # the value's form; the GPU count is checked with the world size
    _at_least("launcher.malloc_mmap_threshold", s.malloc_mmap_threshold, 0, " bytes (0: glibc's default)")
    if not (math.isfinite(s.timeout_s) and s.timeout_s > 0):
        raise ValueError(f"launcher.timeout_s={s.timeout_s}: must be a finite number > 0 seconds")
    _at_least("launcher.hang_s", s.hang_s, 0, " seconds (0: no hang watchdog)")
    _at_least("launcher.shutdown_grace_s", s.shutdown_grace_s, 0, " seconds (0: no save on preemption)")
    return s


def _validate_train(c: dict, parallel: ParallelDims, world: int, microbatches: int) -> TrainConfig:
    """The batch triple resolved for the data-parallel size (``train.global_batch_size``; under pp each
    accumulation step runs ``pipeline.microbatches`` micro-batches), then checked."""
    c = dict(c)
    if c["global_batch_size"]:
        resolve_batch_as_given(c, parallel.resolve(world).dp, microbatches=microbatches if parallel.pp > 1 else 1)
    t = TrainConfig(**c)
    for key in ("max_steps", "micro_batch_size", "log_every", "sample_tokens", "max_bad_steps"):
        _positive(f"train.{key}", getattr(t, key))  # grad_accum: EngineConfig checks it
    for key in ("eval_every", "global_batch_size"):
        _at_least(f"train.{key}", getattr(t, key), 0)
    if not (t.max_param_growth == 0 or t.max_param_growth > 1):
        raise ValueError(f"train.max_param_growth={t.max_param_growth}: must be 0 (off) or > 1 (a factor on the "
                         f"parameter norm of the newest good state)")
    return t


def _validate_data(c: dict) -> DataConfig:
    """The data source, the window, the held-out split."""
    from deepshard.finetune.data.sources import SOURCES

    d = DataConfig(**c)
    if d.name not in SOURCES:
        raise ValueError(f"data.name={d.name!r}: valid values are {sorted(SOURCES)}")
    _positive("data.seq_len", d.seq_len)
    _positive("data.num_docs", d.num_docs)
    if not 0 <= d.eval_fraction < 1:
        raise ValueError(f"data.eval_fraction={d.eval_fraction}: must be in [0, 1)")
    if d.text_unit not in ("file", "paragraph", "line"):
        raise ValueError(f"data.text_unit={d.text_unit!r}: valid values are ['file', 'paragraph', 'line']")
    if d.eval_path is not None:
        from deepshard.finetune.data.records import expand

        if d.name == "embedded":
            raise ValueError(f"data.eval_path={d.eval_path!r}: data=embedded generates its documents; an eval "
                             f"file needs a file-backed source (data=jsonl|text|hf_disk|chat)")
        expand(d.eval_path, "data.eval_path")  # something is there (its format: prelaunch reads it through)
    return d


def _validate_profile(c: dict) -> ProfileConfig:
    p = ProfileConfig(**{**c, "trace_steps": tuple(c["trace_steps"])})
    _at_least("profile.peak_tflops", p.peak_tflops, 0, " (0: from the device table)")
    if any(s < 1 for s in p.trace_steps):
        raise ValueError(f"profile.trace_steps={p.trace_steps}: steps count from 1")
    return p


def _validate_model(c: dict, kernels: str, seq_len: int) -> Any:
    """The architecture: a preset's keys (the default family's config checks the head split), or
    model=hf's config.json (read by the family its model_type names)."""
    if c["name"] not in ("tiny", "small", "hf"):
        raise ValueError(f"model.name={c['name']!r}: valid values are ['tiny', 'small', 'hf']")
    if c["name"] == "hf":
        if not c["path"]:
            raise ValueError("model.path=None: model=hf needs model.path=DIR, a local HF checkpoint directory")
        hf = registry.for_hf(c["path"]).hf
        model = dataclasses.replace(hf.config_from_hf(c["path"]), mlp_tiles=c.get("mlp_tiles", 1))
    moe = {k: c[k] for k in MOE_RUN_KEYS if c.get(k) is not None}
    if moe and not getattr(model if c["name"] == "hf" else None, "num_experts", 0):
        raise ValueError(f"model.{next(iter(moe))}={next(iter(moe.values()))}: an MoE key; model "
                         f"{c['name']!r} has no experts (use model=hf with an MoE checkpoint)")
    if c["name"] == "hf":
        model = dataclasses.replace(model, **moe)
    else:
        arch = {k: v for k, v in c.items() if k not in ("name", "path", *MOE_RUN_KEYS)}
        for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
            _positive(f"model.{key}", arch[key])
        model = registry.get(registry.DEFAULT_FAMILY).config(**arch)
    if seq_len > model.max_seq_len:
        raise ValueError(f"data.seq_len={seq_len}: must be <= model.max_seq_len={model.max_seq_len}")
    return dataclasses.replace(model, kernels=_kernels_backend(kernels))


def resolve_dtype(dtype: str, *, cuda_available: bool) -> str:
    """``precision=auto`` (the default): bf16 where CUDA is present (tensor-core speed, fp32 masters,
    no loss scale to tune), fp32 on a CPU-only host (bf16 is emulated there, 4-5x slower).  Any other
    value is kept; ``precision=fp32`` on a GPU is strict fp32 (TF32 off, torch's default)."""
    if dtype != "auto":
        return dtype
    return "bf16" if cuda_available else "fp32"


def _validate_precision(c: dict) -> PrecisionConfig:
    """The compute dtype for this host: ``auto`` resolved, fp16 on a CPU-only host -> fp32 (a notice)."""
    import torch

    c = dict(c)
    force = c.pop("force_fp16_on_cpu")
    cuda = torch.cuda.is_available()
    dtype = host_dtype(resolve_dtype(c["dtype"], cuda_available=cuda), force_fp16_on_cpu=force, cuda=cuda)
    return PrecisionConfig(**{**c, "dtype": dtype})


def _kernels_backend(name: str) -> str:
    """The backend for this host's device, checked now (triton on CPU needs TRITON_INTERPRET=1)."""
    import torch

    try:
        return resolve_backend(name, device="cuda" if torch.cuda.is_available() else "cpu")
    except RuntimeError as err:
        raise ValueError(f"kernels={name!r}: {err}; or use kernels=torch") from err


def _validate_offload(c: dict, stage: int) -> OffloadConfig:
    """The library's config: a key left None (``OFFLOAD_PICKS``) at OffloadConfig's own default."""
    offload = OffloadConfig(**{**{k: v for k, v in c.items() if v is not None}, "aio": AioConfig(**c["aio"])})
    validate_offload(stage, offload.device, offload.params)
    validate_config(offload)
    return offload


def validate(cfg: dict, *, world_size: int | None = None) -> Settings:
    """The typed settings of a composed config (a plain dict, left as it is), for ``world_size`` ranks
    (default: torchrun's, or the workers the app starts on this host); ValueError naming the first bad key.

    Every key has its default in one place, the schema's dataclasses above (or the library config they
    twin); each value is checked once, here or by the typed config it lands in.
    """
    check_switches(cfg)
    launcher = _validate_launcher(cfg["launcher"])
    world = world_size or host_world_size(launcher.nproc_per_node)
    parallel = ParallelDims(**cfg["parallel"])
    train = _validate_train(cfg["train"], parallel, world, cfg["pipeline"]["microbatches"])
    data = _validate_data(cfg["data"])
    model = _validate_model(cfg["model"], cfg["kernels"], data.seq_len)
    o = dict(cfg["optim"])
    o["betas"] = tuple(o["betas"])
    with named("zero"):  # core names its own fields; the user's key goes in front
        zero = ZeroConfig(**cfg["zero"])
    with named("precision"):
        precision = _validate_precision(cfg["precision"])
    with named("optim"):
        optim = OptimConfig(**o)
    with named("scheduler"):
        scheduler = SchedulerConfig(**cfg["scheduler"])
    ac_auto = cfg["ac"] == "auto"
    if ac_auto:  # ac_offload asks for checkpointed blocks: auto means every block then
        ac = "full" if cfg["ac_offload"] else "none"
    elif cfg["ac"] not in AC_MODES:
        raise ValueError(f"ac={cfg['ac']!r}: valid values are {['auto', *AC_MODES]}")
    else:
        ac = cfg["ac"]
    with named({"grad_accum": "train.grad_accum", "ac": "ac", "ac_offload": "ac_offload"}.__getitem__):
        engine = EngineConfig(zero=zero, precision=precision, optim=optim, scheduler=scheduler,
                              grad_accum=train.grad_accum, ac=ac, ac_offload=cfg["ac_offload"],
                              compile=cfg.get("compile", False))
    settings = Settings(engine=engine, model=model, model_name=cfg["model"]["name"], model_path=cfg["model"]["path"],
                        world_size=world, parallel=parallel, offload=_validate_offload(cfg["offload"], engine.zero.stage),
                        train=train, data=data, profile=_validate_profile(cfg["profile"]),
                        checkpoint=validate_checkpoint(cfg["checkpoint"]), pipeline=PipelineConfig(**cfg["pipeline"]),
                        launcher=launcher, peft=lora_settings(cfg["peft"]), ac_auto=ac_auto and not cfg["ac_offload"],
                        offload_picks=tuple(k for k in OFFLOAD_PICKS if cfg["offload"].get(k) is None))
    if settings.peft is not None:  # adapters split with their layers under pp/tp; what cannot, said here
        check_lora_parallel(settings.peft, tp=parallel.tp)
        if settings.peft.init_from:  # a PEFT folder to start from: its settings must match the run's
            from deepshard.finetune.models.peft_adapter import check_init_from

            check_init_from(settings.peft.init_from, settings.peft)
        if settings.peft.base_quant != "none":  # QLoRA: what its NF4 base cannot run, said before start
            from deepshard.finetune.models.qlora import check_qlora

            check_qlora(settings.peft, settings.model, stage=engine.zero.stage, dp=parallel.resolve(world).dp,
                        tp=parallel.tp, pp=parallel.pp, sp=parallel.sp, dp_replicate=parallel.dp_replicate,
                        offload_params=settings.offload.params, quantized_weights=engine.zero.quantized_weights)
    if settings.offload.params == "nvme" and (parallel.pp > 1 or parallel.tp > 1 or settings.peft is not None):
        raise ValueError("offload.params='nvme' swaps whole ZeRO-3 units of plain (not tensor-parallel) "
                         "parameters, whole blocks of one model: not with parallel.pp/tp > 1 or +peft=lora "
                         "(use offload.params=cpu or none there)")
    if settings.offload.params == "nvme":  # space and buffers for this model, before any worker starts
        settings = dataclasses.replace(settings, offload=check_param_swap(settings, world))
    if registry.spec_of(settings.model).check_parallel is not None:  # what a family cannot run (MoE), by key
        registry.spec_of(settings.model).check_parallel(settings.model, pp=parallel.pp, tp=parallel.tp,
                                                        sp=parallel.sp, lora=settings.peft,
                                                        **({"ep": parallel.ep} if parallel.ep > 1 else {}))
    if parallel.ep > 1:
        check_ep(settings, parallel.ep)
    if parallel.tp > 1:
        registry.spec_of(settings.model).check_tp(settings.model, parallel.tp)
    if parallel.sp > 1:
        validate_sp(settings)
    if settings.model.mlp_tiles > 1:  # (one tile always fits; the layout's own checks come first)
        check_mlp_tiles(settings)
    check_padding(settings)  # data.pad_to_multiple_of: its value, then the layout's lengths
    if settings.uses_pipeline:
        validate_pipeline_layout(settings)
    validate_zeropp(settings, parallel.resolve(world))
    check_optimizer(settings)
    if settings.engine.compile:
        check_compile(settings)
    return dataclasses.replace(settings, parallel=parallel.resolve(world))


def check_optimizer(settings: Settings) -> None:
    """Muon and bf16 states where they are built; the rest refused here, before any worker starts."""
    optim, offload = settings.engine.optim, settings.offload
    # offload.device=cpu runs: the host store updates every parameter in one call, as Muon needs
    if optim.name == "muon" and (offload.device == "nvme" or offload.params != "none"):
        raise ValueError(f"optim.name=muon with offload.device={offload.device!r}/offload.params={offload.params!r}: "
                         "the NVMe stores update the state piece by piece as it streams, and Muon's Newton-Schulz "
                         "needs each whole matrix at once; parameter offload with Muon is untested (use "
                         "offload.device=cpu with offload.params=none, or optim=adamw)")
    if optim.name == "muon" and settings.parallel.tp > 1:
        raise ValueError(f"optim.name=muon with parallel.tp={settings.parallel.tp}: Newton-Schulz over "
                         "tensor-parallel matrices is not built (use parallel.tp=1)")
    if optim.state_dtype == "bf16" and offload.device != "none":
        raise ValueError(f"optim.state_dtype=bf16 with offload.device={offload.device!r}: the host and NVMe "
                         "stores keep fp32 state (use offload.device=none)")
    if optim.state_dtype == "bf16" and settings.engine.precision.dtype == "fp16":
        raise ValueError("optim.state_dtype=bf16 with precision=fp16: bf16 states need bf16 (or fp32) "
                         "params as their masters (use precision=bf16)")
