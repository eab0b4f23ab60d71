"""Typed configs for the library API; the app builds them from Hydra, library users by hand."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepshard.core.config_error import ConfigError
from deepshard.core.precision import PrecisionConfig
from deepshard.core.schedules import SchedulerConfig

AC_MODES = ("none", "full", "every_2")
REDUCE_DTYPES = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class ZeroConfig:
    """DeepSpeed's zero_optimization knobs that apply to our layouts (sizes in elements)."""

    stage: int = 0
    # 5e6 elements (20 MB fp32, DDP's 25 MiB bucket): several buckets per model, so the reduction
    # overlaps backward, and one bucket is what the buffers cost.  Measured (bench/bench_zero.py --hf, HF Llama
    # 17M, world 2, gloo): step time flat from 1e6 to 5e7 within the host's noise, buffers 12 / 18.8 / 64.5
    # MiB per collective kind at 1e6 / 5e6 / 5e7 (5e7, the former default, was one bucket: no overlap)
    reduce_bucket_size: int = 5_000_000
    allgather_bucket_size: int = 5_000_000
    overlap_comm: bool = True
    # stages 1-2: the all-gather of updated params runs inside the next forward, bucket k+1 while
    # bucket k's layers compute (forward pre-hooks; ``state_dict()`` and the next step wait for the
    # rest).  A direct read of a param's values between ``step()`` and the next forward must call
    # ``engine.gather_params()`` first; off, the gather completes inside ``step()``.
    overlap_allgather: bool = False
    reshard_after_forward: bool = True
    prefetch: int = 1
    # the dtype gradients are reduced in at every stage (DeepSpeed's communication_data_type); they are
    # accumulated across micro-steps in fp32 whatever this says
    reduce_dtype: str = "fp32"
    # ZeRO++ (stage 3, deepshard.core.zero.quantized): qwZ, the parameter all-gathers carry int8 blocks
    # (one fp32 scale per 4096 elements) dequantized on arrival, the sharded fp32 masters untouched; qgZ,
    # gradients reduce-scattered as int8/int4 blocks by all-to-all, within each node first, then across,
    # summed in fp32 on arrival.  quantized_gradients_node_size: ranks per node for qgZ's two hops (0:
    # torchrun's LOCAL_WORLD_SIZE).  hpz_partition_size > 1 (hpZ): after forward each block keeps a secondary
    # shard of its compute-dtype weights over groups of that many consecutive ranks (a node), so backward's
    # all-gathers stay inside the node; it must divide the ZeRO group (FSDP2's int reshard_after_forward)
    quantized_weights: bool = False
    quantized_gradients: bool = False
    quantized_gradients_bits: int = 8
    quantized_gradients_node_size: int = 0
    hpz_partition_size: int = 1
    # LoCo (DeepSpeed's zeropp_loco_param, deepshard.core.zero.loco): qgZ's quantizations add back what the
    # last one rounded away, e = err_beta * e + (1 - err_beta) * error, buffers cleared every loco_reset_t uses
    loco: bool = False
    loco_err_beta: float = 0.8
    loco_reset_t: int = 1024

    def __post_init__(self) -> None:
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ConfigError("reduce_dtype", self.reduce_dtype, f"valid values are {list(REDUCE_DTYPES)}")
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError("stage", self.stage, "valid stages are 0, 1, 2, 3")
        for key in ("reduce_bucket_size", "allgather_bucket_size"):
            if getattr(self, key) <= 0:
                raise ConfigError(key, getattr(self, key), "must be a positive number of elements")
        if self.prefetch < 0:
            raise ConfigError("prefetch", self.prefetch, "must be >= 0")
        self._check_zeropp()

    def _check_zeropp(self) -> None:
        for key in ("quantized_weights", "quantized_gradients"):
            if getattr(self, key) and self.stage != 3:
                raise ConfigError(key, True, f"ZeRO++'s quantized collectives are stage 3's (FSDP2's all-gather and "
                                             f"reduce-scatter); got stage={self.stage}")
        if self.quantized_gradients_bits not in (8, 4):
            raise ConfigError("quantized_gradients_bits", self.quantized_gradients_bits, "valid values are 8 and 4")
        if self.quantized_gradients_node_size < 0:
            raise ConfigError("quantized_gradients_node_size", self.quantized_gradients_node_size,
                              "must be >= 0 (0: LOCAL_WORLD_SIZE)")
        if self.loco and not self.quantized_gradients:
            raise ConfigError("loco", True, "LoCo's error feedback compensates qgZ's quantization: needs "
                                            "quantized_gradients=true")
        if not 0.0 <= self.loco_err_beta <= 1.0:
            raise ConfigError("loco_err_beta", self.loco_err_beta, "must be in [0, 1] (DeepSpeed's err_beta)")
        if self.loco_reset_t < 1:
            raise ConfigError("loco_reset_t", self.loco_reset_t, "must be >= 1 (DeepSpeed's reset_T)")
        if self.hpz_partition_size < 1:
            raise ConfigError("hpz_partition_size", self.hpz_partition_size, "must be >= 1 (1: off)")
        if self.hpz_partition_size > 1 and (self.stage != 3 or not self.reshard_after_forward):
            raise ConfigError("hpz_partition_size", self.hpz_partition_size,
                              f"hpZ's secondary partition replaces stage 3's reshard after forward: needs stage=3 and "
                              f"reshard_after_forward=true (got stage={self.stage}, "
                              f"reshard_after_forward={str(self.reshard_after_forward).lower()})")


OPTIMIZERS = ("adamw", "muon")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with decoupled weight decay on matrices (norm weights are not decayed); or Muon on the
    hidden matrices with AdamW on the rest (``name="muon"``, core/muon.py)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    name: str = "adamw"  # "adamw" | "muon"
    # Muon's keys (DeepSpeed's muon_lr and momentum; torch.optim.Muon's nesterov and ns_steps); lr drives
    # AdamW's half (DeepSpeed's adam_lr) and the schedule scales both halves alike
    muon_lr: float = 0.02
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_dtype: str = "fp32"  # Newton-Schulz in fp32, or bf16 as torch.optim.Muon runs it (faster on GPUs)
    # "bf16": the optimizer states in bf16, and the masters where the params are bf16 (stochastic
    # rounding of the fp32 result: core/low_precision.py)
    state_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError("lr", self.lr, "must be > 0")
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError("betas", self.betas, "each must be in [0, 1)")
        if self.eps <= 0:
            raise ConfigError("eps", self.eps, "must be > 0")
        if self.weight_decay < 0:
            raise ConfigError("weight_decay", self.weight_decay, "must be >= 0")
        if self.grad_clip < 0:
            raise ConfigError("grad_clip", self.grad_clip, "must be >= 0 (0 disables clipping)")
        if self.name not in OPTIMIZERS:
            raise ConfigError("name", self.name, f"valid values are {list(OPTIMIZERS)}")
        if self.muon_lr <= 0:
            raise ConfigError("muon_lr", self.muon_lr, "must be > 0")
        if not 0 <= self.momentum < 1:
            raise ConfigError("momentum", self.momentum, "must be in [0, 1)")
        if not 1 <= self.ns_steps < 100:
            raise ConfigError("ns_steps", self.ns_steps, "must be in [1, 100)")
        for key in ("ns_dtype", "state_dtype"):
            if getattr(self, key) not in ("fp32", "bf16"):
                raise ConfigError(key, getattr(self, key), "valid values are ['fp32', 'bf16']")


@dataclass(frozen=True)
class EngineConfig:
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    grad_accum: int = 1
    ac: str = "none"
    ac_offload: bool = False  # checkpointed blocks' inputs in host memory (activation_checkpoint.offloaded_checkpoint)
    compile: bool = False  # torch.compile per block (core/compile.py), after TP and AC, before ZeRO

    def __post_init__(self) -> None:
        if self.grad_accum < 1:
            raise ConfigError("grad_accum", self.grad_accum, "must be >= 1")
        if self.ac not in AC_MODES:
            raise ConfigError("ac", self.ac, f"valid values are {list(AC_MODES)}")
        if self.ac_offload and self.ac == "none":
            raise ConfigError("ac_offload", self.ac_offload, "needs checkpointed blocks: set ac=full or every_2")
