"""The app's typed config: dataclasses registered in Hydra's ConfigStore, and their validation.

Library configs (core's ``ZeroConfig``, ``OptimConfig``, ...) are frozen and validate themselves;
Hydra needs mutable twins with the same fields, made here so the two can never drift apart.
``validate`` turns a composed config into typed settings, raising one ValueError that names the
key, the value and what is valid, before any process is started.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from deepshard.core import OptimConfig, PrecisionConfig, SchedulerConfig, ZeroConfig
from deepshard.core.config import AC_MODES, EngineConfig
from deepshard.core.mesh import ParallelDims
from deepshard.finetune.checkpointing import CheckpointSchema, validate_checkpoint
from deepshard.finetune.models.hf import llama_config_from_hf
from deepshard.finetune.models.llama import LlamaConfig
from deepshard.finetune.models.lora import LORA_TARGETS, LoraSettings, lora_settings
from deepshard.kernels import resolve_backend
from deepshard.offload import AioConfig, OffloadConfig, validate_config, validate_offload


def hydra_twin(cls: type, name: str) -> type:
    """A mutable dataclass with ``cls``'s fields and defaults (tuples become lists for OmegaConf)."""
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(tp):  # nested config: its own mutable twin
            twin = hydra_twin(tp, f"{tp.__name__}Schema")
            fields.append((f.name, twin, field(default_factory=twin)))
        elif typing.get_origin(tp) is tuple:
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
    "PrecisionSchema", [("force_fp16_on_cpu", bool, field(default=False))],
    bases=(hydra_twin(PrecisionConfig, "PrecisionTwin"),))
ParallelSchema = hydra_twin(ParallelDims, "ParallelSchema")
OffloadSchema = hydra_twin(OffloadConfig, "OffloadSchema")


@dataclass
class ModelSchema:
    name: str = "tiny"  # tiny | small | hf
    path: typing.Optional[str] = None  # noqa: UP045 - OmegaConf needs Optional
    vocab_size: int = 2048
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_hidden: int = 704
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    loss_chunk_size: int = 1024  # tokens per chunk of the fused linear + cross-entropy; 0: materialize logits


@dataclass
class DataSchema:
    name: str = "embedded"  # embedded | jsonl | text | hf_disk
    path: typing.Optional[str] = None  # noqa: UP045 - a file, directory or glob
    seq_len: int = 128
    num_docs: int = 3000
    seed: int = 0
    pack: bool = True  # false: one document per row, padded with -100 labels
    doc_mask: bool = True  # packed rows: attention stays inside each document
    eval_fraction: float = 0.0  # documents held out for eval loss / perplexity
    text_field: str = "text"
    prompt_field: str = "prompt"
    response_field: str = "response"
    text_unit: str = "file"  # data=text: file | paragraph | line is one document
    split: str = "train"  # data=hf_disk: the split of a saved DatasetDict
    chat_template: typing.Optional[str] = None  # noqa: UP045 - data=chat: a Jinja file (default: the tokenizer's)


@dataclass
class TrainSchema:
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


@dataclass
class PipelineSchema:
    """Used when parallel.pp > 1 (or tp > 1): torch.distributed.pipelining stages and schedule."""

    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zero_bubble
    microbatches: int = 4  # micro-batches per step and dp replica (the pipeline's gradient accumulation)
    partition: str = "uniform"  # uniform | parameters | type:REGEX (DeepSpeed's partition_method)
    virtual_stages: int = 0  # stages per rank for the interleaved schedules; 0: the schedule's default


@dataclass
class PeftSchema:
    """``+peft=lora``: LoRA adapters on a frozen base (models/lora.py); name none trains every weight."""

    name: str = "none"  # none | lora
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    modules_to_save: list[str] = field(default_factory=list)
    init_from: typing.Optional[str] = None  # noqa: UP045 - a PEFT adapter folder to continue from


@dataclass
class ProfileSchema:
    enabled: bool = False  # per-step wall-clock split, FLOP/s and MFU
    trace_steps: list[int] = field(default_factory=list)  # steps to record a torch.profiler trace of
    peak_tflops: float = 0.0  # per-rank peak for MFU; 0: from the device table


@dataclass
class LauncherSchema:
    nproc_per_node: str = "auto"  # auto: every local GPU, or 2 workers on a CPU-only host
    # bytes; > 0 fixes glibc's mmap threshold in the workers, so freed host buffers leave RSS
    # (about half the peak RSS of a CPU ZeRO-3 run, at ~30% step time); 0 keeps glibc's default
    malloc_mmap_threshold: int = 0
    timeout_s: float = 600.0  # collective timeout of the process group (a rank that never answers)
    hang_s: float = 300.0  # the launcher stops a job whose rank made no progress this long; 0: never


@dataclass
class AppSchema:
    train: TrainSchema = field(default_factory=TrainSchema)
    launcher: LauncherSchema = field(default_factory=LauncherSchema)
    model: ModelSchema = field(default_factory=ModelSchema)
    data: DataSchema = field(default_factory=DataSchema)
    optim: OptimSchema = field(default_factory=OptimSchema)  # type: ignore[valid-type]
    scheduler: SchedulerSchema = field(default_factory=SchedulerSchema)  # type: ignore[valid-type]
    precision: PrecisionSchema = field(default_factory=PrecisionSchema)  # type: ignore[valid-type]
    zero: ZeroSchema = field(default_factory=ZeroSchema)  # type: ignore[valid-type]
    parallel: ParallelSchema = field(default_factory=ParallelSchema)  # type: ignore[valid-type]
    offload: OffloadSchema = field(default_factory=OffloadSchema)  # type: ignore[valid-type]
    profile: ProfileSchema = field(default_factory=ProfileSchema)
    pipeline: PipelineSchema = field(default_factory=PipelineSchema)
    peft: PeftSchema = field(default_factory=PeftSchema)
    ac: str = "none"
    kernels: str = "auto"  # auto | triton | torch: fused Triton kernels where CUDA is present
    checkpoint: CheckpointSchema = field(default_factory=CheckpointSchema)


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
    """Everything a worker needs, typed and validated."""

    engine: EngineConfig
    model: LlamaConfig
    model_name: str
    model_path: str | None
    parallel: ParallelDims
    offload: OffloadConfig
    train: TrainSchema
    data: DataSchema
    nproc_per_node: str
    profile: ProfileSchema = field(default_factory=ProfileSchema)
    checkpoint: CheckpointSchema = field(default_factory=CheckpointSchema)
    pipeline: PipelineSchema = field(default_factory=PipelineSchema)
    launcher: LauncherSchema = field(default_factory=LauncherSchema)
    peft: LoraSettings | None = None  # +peft=lora

    @property
    def uses_pipeline(self) -> bool:
        """Pipeline or tensor parallel: the model goes through deepshard.pipeline, not the plain engine."""
        return self.parallel.pp > 1 or self.parallel.tp > 1

    @property
    def micro_batches_per_step(self) -> int:
        return self.pipeline.microbatches if self.uses_pipeline else self.train.grad_accum

    def tokens_per_step(self, dp_size: int) -> int:
        """Token positions of one optimizer step over all data-parallel ranks (the tokens/s numerator)."""
        return self.train.micro_batch_size * self.micro_batches_per_step * self.data.seq_len * dp_size


def _validate_pipeline(settings: Settings) -> None:
    """pp/tp runs: the schedule, the split, the TP divisibility, and what they do not support yet."""
    from deepshard.finetune.models.parallelize import check_tp
    from deepshard.pipeline import validate_pipeline

    p, par, d, t = settings.pipeline, settings.parallel, settings.data, settings.train
    virtual = p.virtual_stages or (2 if p.schedule in ("interleaved_1f1b", "zero_bubble") else 1)
    validate_pipeline(schedule=p.schedule, pp=par.pp, microbatches=p.microbatches, virtual_stages=virtual,
                      num_layers=settings.model.n_layers, partition=p.partition)
    check_tp(settings.model, par.tp)
    unsupported = [("train.grad_accum", t.grad_accum, t.grad_accum != 1, "use pipeline.microbatches"),
                   ("data.eval_fraction", d.eval_fraction, d.eval_fraction > 0, "set it to 0"),
                   ("train.sample_prompt", t.sample_prompt, bool(t.sample_prompt), "leave it unset"),
                   ("data.doc_mask", d.doc_mask, d.doc_mask and d.pack,
                    "set data.doc_mask=false"),
                   ("model.name", settings.model_name, settings.model_name == "hf", "use model=tiny|small")]
    for key, value, bad, fix in unsupported:
        if bad:
            raise ValueError(f"{key}={value!r} with parallel.pp={par.pp} parallel.tp={par.tp}: not supported with "
                             f"pipeline/tensor parallelism yet; {fix}")


def _positive(key: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}={value}: must be a positive integer")


def resolve_nproc(value: str, cuda_devices: int) -> int:
    """``auto``: every local GPU, or 2 workers on a CPU-only host (so the default run really shards)."""
    if str(value) == "auto":
        return cuda_devices or 2
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"launcher.nproc_per_node={value!r}: valid values are 'auto' or a positive integer")
    if 0 < cuda_devices < n:
        raise ValueError(f"launcher.nproc_per_node={n} > {cuda_devices} visible GPU(s): nccl needs one GPU per "
                         f"rank; use at most {cuda_devices} (or 'auto')")
    return n


def _validate_extras(d: dict, t: dict, prof: dict) -> None:
    """The data sources, the held-out split, eval/sample and profiler keys."""
    from deepshard.finetune.data.sources import SOURCES

    if d["name"] not in SOURCES:
        raise ValueError(f"data.name={d['name']!r}: valid values are {sorted(SOURCES)}")
    if not 0 <= d.get("eval_fraction", 0.0) < 1:
        raise ValueError(f"data.eval_fraction={d['eval_fraction']}: must be in [0, 1)")
    if d.get("text_unit", "file") not in ("file", "paragraph", "line"):
        raise ValueError(f"data.text_unit={d['text_unit']!r}: valid values are ['file', 'paragraph', 'line']")
    for key in ("eval_every", "global_batch_size"):
        if t.get(key, 0) < 0:
            raise ValueError(f"train.{key}={t[key]}: must be >= 0")
    if t.get("sample_tokens", 1) < 1:
        raise ValueError(f"train.sample_tokens={t['sample_tokens']}: must be a positive integer")
    if prof.get("peak_tflops", 0.0) < 0:
        raise ValueError(f"profile.peak_tflops={prof['peak_tflops']}: must be >= 0 (0: from the device table)")
    if any(s < 1 for s in prof.get("trace_steps", [])):
        raise ValueError(f"profile.trace_steps={prof['trace_steps']}: steps count from 1")


def _validate_launcher(c: dict) -> LauncherSchema:
    """Timeouts: a positive collective timeout; a hang limit >= 0 (0: off).  A hang limit at or above
    the collective timeout never fires first: the waiting rank's collective times out instead."""
    s = LauncherSchema(**c)
    if not s.timeout_s > 0:
        raise ValueError(f"launcher.timeout_s={s.timeout_s}: must be > 0 seconds")
    if s.hang_s < 0:
        raise ValueError(f"launcher.hang_s={s.hang_s}: must be >= 0 seconds (0: no hang watchdog)")
    return s


def resolve_dtype(dtype: str, *, cuda_available: bool) -> str:
    """``precision=auto`` (the default): bf16 where CUDA is present (tensor-core speed, fp32 masters,
    no loss scale to tune), fp32 on a CPU-only host (bf16 is emulated there, 4-5x slower).  Any other
    value is kept; ``precision=fp32`` on a GPU is strict fp32 (TF32 off, torch's default)."""
    if dtype != "auto":
        return dtype
    return "bf16" if cuda_available else "fp32"


def _resolve_precision(p: dict) -> dict:
    import torch

    return {**p, "dtype": resolve_dtype(p.get("dtype", "fp32"), cuda_available=torch.cuda.is_available())}


def _kernels_backend(name: str) -> str:
    """The backend for this host's device, checked now (triton on CPU needs TRITON_INTERPRET=1)."""
    import torch

    try:
        return resolve_backend(name, device="cuda" if torch.cuda.is_available() else "cpu")
    except RuntimeError as err:
        raise ValueError(f"kernels={name!r}: {err}; or use kernels=torch") from err


def validate(cfg: dict) -> Settings:
    """Typed settings from a composed config (a plain dict); ValueError naming the first bad key."""
    t, d, m = cfg["train"], cfg["data"], cfg["model"]
    for key in ("max_steps", "micro_batch_size", "grad_accum", "log_every"):
        _positive(f"train.{key}", t[key])
    _positive("data.seq_len", d["seq_len"])
    _positive("data.num_docs", d["num_docs"])
    _validate_extras(d, t, cfg.get("profile") or {})
    if m["name"] not in ("tiny", "small", "hf"):
        raise ValueError(f"model.name={m['name']!r}: valid values are ['tiny', 'small', 'hf']")
    if m["name"] == "hf" and not m.get("path"):
        raise ValueError("model.path=None: model=hf needs model.path=DIR, a local HF checkpoint directory")
    arch = {k: v for k, v in m.items() if k not in ("name", "path")}
    for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
        _positive(f"model.{key}", arch[key])
    model = llama_config_from_hf(m["path"]) if m["name"] == "hf" else LlamaConfig(**arch)
    model = dataclasses.replace(model, kernels=_kernels_backend(cfg.get("kernels", "auto")))
    if d["seq_len"] > model.max_seq_len:
        raise ValueError(f"data.seq_len={d['seq_len']}: must be <= model.max_seq_len={model.max_seq_len}")
    if cfg["ac"] not in AC_MODES:
        raise ValueError(f"ac={cfg['ac']!r}: valid values are {list(AC_MODES)}")
    o = dict(cfg["optim"])
    o["betas"] = tuple(o["betas"])
    engine = EngineConfig(
        zero=ZeroConfig(**cfg["zero"]),
        precision=PrecisionConfig(**_resolve_precision(
            {k: v for k, v in cfg["precision"].items() if k != "force_fp16_on_cpu"})),
        optim=OptimConfig(**o), scheduler=SchedulerConfig(**cfg["scheduler"]),
        grad_accum=t["grad_accum"], ac=cfg["ac"],
    )
    parallel = ParallelDims(**cfg["parallel"])
    off = dict(cfg["offload"])
    offload = OffloadConfig(**{**off, "aio": AioConfig(**off["aio"])})
    validate_offload(engine.zero.stage, offload.device, offload.params)
    validate_config(offload)
    nproc = str(cfg["launcher"]["nproc_per_node"])
    resolve_nproc(nproc, 0)
    threshold = cfg["launcher"].get("malloc_mmap_threshold", 0)
    if threshold < 0:
        raise ValueError(f"launcher.malloc_mmap_threshold={threshold}: must be >= 0 bytes (0: glibc's default)")
    launcher = _validate_launcher(cfg["launcher"])
    _positive("train.max_bad_steps", t.get("max_bad_steps", 3))
    settings = Settings(engine=engine, model=model, model_name=m["name"], model_path=m.get("path"),
                        parallel=parallel, offload=offload, train=TrainSchema(**t), data=DataSchema(**d),
                        nproc_per_node=nproc, profile=ProfileSchema(**(cfg.get("profile") or {})),
                        checkpoint=validate_checkpoint(cfg.get("checkpoint") or {}),
                        pipeline=PipelineSchema(**(cfg.get("pipeline") or {})), launcher=launcher,
                        peft=lora_settings(cfg.get("peft")))
    if settings.peft is not None and settings.uses_pipeline:
        raise ValueError(f"+peft=lora with parallel.pp={parallel.pp} parallel.tp={parallel.tp}: LoRA adapters are "
                         f"not supported with pipeline/tensor parallelism yet (tp would have to split A of the "
                         f"row-parallel and B of the column-parallel projections); use parallel.pp=1 parallel.tp=1 "
                         f"with any zero stage")
    if settings.uses_pipeline:
        _validate_pipeline(settings)
    return settings
