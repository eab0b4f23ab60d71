"""A ds_config (dict or JSON path) as core's typed ``EngineConfig``, through the one translation.

``deepshard.compat.ds_config.translate`` turns the DeepSpeed keys into deepshard's typed values, per
section; :func:`engine_config` applies those to DeepSpeed's defaults (not the app's Hydra defaults: a
DeepSpeed user without ``gradient_clipping`` gets none) and builds the frozen core configs.  The
batch triple goes through ``deepshard.compat.resolve``.  A bad value is named by the ds_config's own
key (core's ``ConfigError`` put under it, by table, never by rewriting text) and the file it came from.
"""

from __future__ import annotations

import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepshard.compat.ds_config import Translation, load, translate
from deepshard.compat.resolve import DS_BATCH_KEYS, fp16_fallback, resolve_batch
from deepshard.core import EngineConfig, OptimConfig, PrecisionConfig, SchedulerConfig, ZeroConfig
from deepshard.core.config_error import ConfigError, named

from .result_keys import refuse_result_changing

# our key -> the ds_config key it came from (for error messages)
DS_KEYS = {
    "train.global_batch_size": "train_batch_size", "train.micro_batch_size": "train_micro_batch_size_per_gpu",
    "train.grad_accum": "gradient_accumulation_steps", "optim.lr": "optimizer.params.lr",
    "optim.betas": "optimizer.params.betas", "optim.eps": "optimizer.params.eps",
    "optim.weight_decay": "optimizer.params.weight_decay", "optim.grad_clip": "gradient_clipping",
    "zero.stage": "zero_optimization.stage", "zero.reduce_bucket_size": "zero_optimization.reduce_bucket_size",
    "zero.allgather_bucket_size": "zero_optimization.allgather_bucket_size",
    "zero.prefetch": "zero_optimization.stage3_prefetch_bucket_size", "zero.reduce_dtype": "communication_data_type",
    **{f"precision.{k}": f"fp16.{k}" for k in ("loss_scale", "initial_scale_power", "loss_scale_window",
                                               "hysteresis", "min_loss_scale", "consecutive_hysteresis")},
    **{f"scheduler.{k}": f"scheduler.params.{k}" for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                                         "warmup_type", "total_num_steps", "warmup_min_ratio",
                                                         "cos_min_ratio")},
}
# DeepSpeed's defaults where they differ from our library's (deepspeed/runtime/lr_schedules.py, its Adam)
DS_OPTIM = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
            "grad_clip": 1.0}  # gradient_clipping: GRADIENT_CLIPPING_DEFAULT = 1.0 in DeepSpeed 0.19.8
DS_SCHEDULER = {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 1000, "warmup_type": "log"}


@dataclass
class CompatConfig:
    """What ``initialize`` needs: the engine config, the batch triple, offload and the translation."""

    engine: EngineConfig
    micro_batch_size: int
    grad_accum: int
    train_batch_size: int
    offload: dict[str, Any] = field(default_factory=dict)
    translation: Translation = field(default_factory=Translation)
    fp16_on_cpu: bool = False
    tag_validation: str = "WARN"  # checkpoint.tag_validation: WARN | IGNORE | FAIL (DeepSpeed's default WARN)
    async_save: bool = False  # checkpoint.writer.decoupled: saves written by a thread while training goes on


def ds_key(ours: str) -> str:
    """The ds_config's key for one of ours (``zero.stage`` -> ``zero_optimization.stage``)."""
    return DS_KEYS.get(ours, ours)


def _typed(cls: type, values: dict[str, Any], section: str) -> dict[str, Any]:
    """``values`` checked against ``cls``'s field types (a ConfigError naming the field, which the
    caller puts under the ds_config's key); ints pass for floats, as JSON writes them."""
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        want = hints.get(key)
        if typing.get_origin(want) is tuple:
            ok = isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                         for v in value)
        elif want is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif want is int:
            ok = (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float)
                                                                             and value.is_integer())
        elif want in (bool, str):
            ok = isinstance(value, want)
        else:
            ok = True
        if not ok:
            kind = {float: "a number", int: "an integer", bool: "true or false", str: "a string"}.get(want, "a list of numbers")
            raise ConfigError(key, value, f"expected {kind}")
    return values


def engine_config(s: dict[str, dict[str, Any]], *, grad_accum: int) -> EngineConfig:
    """Core's EngineConfig from a translation's sections, on DeepSpeed's defaults."""
    optim = {**DS_OPTIM, **s["optim"]}
    optim["betas"] = tuple(optim["betas"])
    scheduler = {**DS_SCHEDULER, **s["scheduler"]} if s["scheduler"].get("name") else {}
    if scheduler.get("name") == "WarmupLR" and "warmup_max_lr" not in s["scheduler"]:
        scheduler["warmup_max_lr"] = optim["lr"]  # DeepSpeed's WarmupLR peaks at the optimizer's lr by default
    if scheduler.get("name") == "WarmupCosineLR":  # its warm-up is a ratio of the optimizer's lr
        scheduler = {k: v for k, v in scheduler.items() if k not in ("warmup_min_lr", "warmup_max_lr")}
    with named(lambda f: ds_key(f"optim.{f}")):
        _typed(OptimConfig, s["optim"], "optim")
        optim_config = OptimConfig(**optim)
    with named(lambda f: ds_key(f"scheduler.{f}")):
        _typed(SchedulerConfig, s["scheduler"], "scheduler")
        scheduler_config = SchedulerConfig(**scheduler)
    with named(lambda f: ds_key(f"zero.{f}")):
        zero = ZeroConfig(**_typed(ZeroConfig, s["zero"], "zero"))
    with named(lambda f: ds_key(f"precision.{f}")):
        precision = PrecisionConfig(**_typed(PrecisionConfig, s["precision"], "precision"))
    with named({"grad_accum": "gradient_accumulation_steps", "ac": "activation_checkpointing",
                "ac_offload": "activation_checkpointing.cpu_checkpointing"}.__getitem__):
        return EngineConfig(zero=zero, precision=precision, optim=optim_config, scheduler=scheduler_config,
                            grad_accum=grad_accum, ac=s["app"].get("ac", "none"),
                            ac_offload=bool(s["app"].get("ac_offload", False)),
                            compile=bool(s["app"].get("compile", False)))


def read_ds_config(config: dict | str | Path | None) -> tuple[dict, str]:
    """The ds_config dict and how to name it in errors (the file's name, or ``ds_config``)."""
    if config is None:
        raise ValueError("deepspeed.initialize(): give config= (or config_params=): a ds_config dict or a JSON path")
    if isinstance(config, (str, Path)):
        return load(str(config)), Path(config).name
    if not isinstance(config, dict):
        raise ValueError(f"config={type(config).__name__}: expected a ds_config dict or the path of a JSON file")
    return dict(config), "ds_config"


def compat_config(config: dict | str | Path | None, *, dp: int, cuda: bool, optimizer_defaults: dict | None = None,
                  warn: bool = True) -> CompatConfig:
    """Translate, resolve the batch at this data-parallel size and build the engine config."""
    ds, source = read_ds_config(config)
    try:
        tr = translate(ds)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None
    if optimizer_defaults and "optimizer" not in ds:  # a torch optimizer given to initialize()
        for k, v in optimizer_defaults.items():
            tr.set(f"optim.{k}", v)
    s = tr.sections()
    sp = s["app"].get("parallel.sp", 1)
    if sp != 1:  # Ulysses needs to reach into the model's attention: the app's Llama has that, a user's model not
        raise ValueError(f"{source}: sequence_parallel_size={sp}: deepshard.compat.deepspeed trains your model as it "
                         "is and does not split its sequences; Ulysses sequence parallelism runs in the app "
                         "(python apps/finetune/main.py parallel.sp=N, or +deepspeed= with this file)")
    ep = s["app"].get("parallel.ep", 1)
    if ep != 1:  # AutoEP swaps a HF model's MoE blocks for its own layer; ours are the app's native families
        raise ValueError(f"{source}: expert_parallel.autoep_size={ep}: deepshard.compat.deepspeed trains your model "
                         "as it is and does not replace its MoE blocks; expert parallelism runs in the app "
                         "(python apps/finetune/main.py model=hf parallel.ep=N, or +deepspeed= with this file) or "
                         "with deepspeed.moe.layer.MoE(ep_size=N) in your model")
    train = {"global_batch_size": 0, "micro_batch_size": 1, "grad_accum": 1, **s["train"]}
    try:
        resolve_batch(train, dp, keys=DS_BATCH_KEYS)
    except ValueError as err:
        raise ValueError(f"{source}: {err}{_batch_hint(train, dp)}") from None
    precision = {"precision": {"dtype": s["precision"].get("dtype", "fp32")}}
    fallback = fp16_fallback(precision, cuda)  # prints the one-line notice: fp16 trains in fp32 on CPU
    if fallback:
        tr.set("precision.dtype", "fp32")
    try:
        engine = engine_config(tr.sections(), grad_accum=train["grad_accum"])
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None
    if warn and tr.unsupported:
        refuse_result_changing(tr.unsupported, source)  # only under the provided `deepspeed` (issue 41)
        print(f"warning: {source}: not supported, ignored: {', '.join(tr.unsupported)}", file=sys.stderr)
    global_batch = train["micro_batch_size"] * train["grad_accum"] * dp
    mode = (ds.get("checkpoint") or {}).get("tag_validation") or "WARN"  # translate() checked it
    return CompatConfig(engine=engine, micro_batch_size=train["micro_batch_size"], grad_accum=train["grad_accum"],
                        train_batch_size=global_batch, offload=s["offload"], translation=tr, fp16_on_cpu=fallback,
                        tag_validation=str(mode).upper(),
                        async_save=bool(tr.sections()["app"].get("checkpoint.async_save", False)))


def _batch_hint(train: dict, dp: int) -> str:
    """Which one change makes the ds_config's batch triple consistent at this world size."""
    g, m, a = train.get("global_batch_size", 0), train["micro_batch_size"], train["grad_accum"]
    hints = []
    if m and a:
        hints.append(f"train_batch_size={m * a * dp}")
    if m and g and g % (m * dp) == 0:
        hints.append(f"gradient_accumulation_steps={g // (m * dp)}")
    if a and g and g % (a * dp) == 0:
        hints.append(f"train_micro_batch_size_per_gpu={g // (a * dp)}")
    return f" (at world size {dp}: set {' or '.join(hints)})" if hints else ""


def config_decays(model: Any, model_parameters: list | None, weight_decay: float) -> dict[str, float]:
    """Each parameter's weight decay under the ds_config's optimizer section, as DeepSpeed applies it: one
    AdamW over ``model_parameters`` (default: every parameter), each group's own ``weight_decay`` (default:
    the section's) on every parameter of it, matrices, norms and biases alike.  (deepshard's own rule,
    matrices only, is the app's recipe; a DeepSpeed script gets DeepSpeed's.)  By name, before
    ``initialize`` replaces the parameters."""
    from deepshard.core.checkpoint.state import clean_name

    by_id: dict[int, float] = {}
    for item in model_parameters if model_parameters is not None else model.parameters():
        if isinstance(item, dict):
            wd = float(item.get("weight_decay", weight_decay))
            by_id.update({id(p): wd for p in item["params"]})
        else:
            by_id[id(item)] = float(weight_decay)
    return {clean_name(n): by_id[id(p)] for n, p in model.named_parameters() if id(p) in by_id}
