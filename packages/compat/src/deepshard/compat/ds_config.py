"""A DeepSpeed config (ds_config.json, as users write it) as deepshard's typed settings.

:func:`translate` turns the dict into a :class:`Translation`: values under deepshard's keys
(``optim.lr``, ``zero.reduce_bucket_size``...) and config-group picks (``zero=stage3``,
``precision=fp16``...), with the ds_config key each came from, the keys deepshard does not support
and those it has built in.  ``Translation.sections()`` gives them per section for a typed config
(``deepshard.compat.deepspeed``); ``Translation.overrides`` renders them as the app's Hydra
overrides (``python apps/finetune/main.py +deepspeed=ds_config.json``).

Values ``"auto"`` (the HF Trainer convention) leave the caller's value in place.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepshard.compat.ds_autoep import translate_autoep, translate_expert_data_order
from deepshard.compat.ds_compile import translate_compile

AUTO = "auto"
GROUPS = ("zero", "precision", "scheduler", "optim", "offload")  # config groups a translation may pick
SCHEDULERS = {"WarmupLR": "warmup", "WarmupDecayLR": "warmup_decay", "WarmupCosineLR": "warmup_cosine"}
SCHEDULER_PARAMS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupDecayLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"),
    "WarmupCosineLR": ("warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type", "total_num_steps"),
}
# DeepSpeed's defaults for the keys a file leaves out (deepspeed/runtime/lr_schedules.py), where the app's
# scheduler group files differ; WarmupLR's warmup_max_lr defaults to the optimizer's lr, as ours does
SCHEDULER_DEFAULTS = {
    "WarmupLR": {"warmup_min_lr": 0, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupDecayLR": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupCosineLR": {"warmup_min_ratio": 0, "warmup_num_steps": 1000, "cos_min_ratio": 0.0001, "warmup_type": "log"},
}
FP16_KEYS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale",
             "consecutive_hysteresis")
COMM_DTYPES = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "bf16": "bf16", "bfloat16": "bf16"}
AIO_KEYS = ("block_size", "queue_depth", "thread_count", "single_submit", "overlap_events")
# keys whose DeepSpeed meaning our implementation already has, so they need no override (why, for the notes)
BUILT_IN = {
    "zero_optimization.contiguous_gradients": "buckets are always contiguous",
    "zero_optimization.reduce_scatter": "stage 2 always reduce-scatters",
    "zero_optimization.allgather_partitions": "stages 1-2 always all-gather updated partitions",
    "zero_optimization.stage3_max_live_parameters": "at most 1 + zero.prefetch blocks are gathered at once",
    "zero_optimization.stage3_max_reuse_distance": "FSDP2 frees gathered blocks after use",
    "zero_optimization.stage3_param_persistence_threshold": "FSDP2 gathers small params with their block",
    "zero_optimization.round_robin_gradients": "gradient partitions are per-parameter Shard(0)",
    "zero_optimization.offload_optimizer.pin_memory": "host buffers are pinned whenever an accelerator exists",
    "zero_optimization.offload_param.pin_memory": "host params are pinned whenever an accelerator exists",
    "zero_optimization.offload_optimizer.fast_init": "no effect here",
    "zero_allow_untested_optimizer": "no effect here",
    "zero_force_ds_cpu_optimizer": "offloaded state uses torch's fused CPU AdamW",
    "optimizer.params.adam_w_mode": "Adam is AdamW (DeepSpeed's default adam_w_mode=true)",
    "optimizer.params.torch_adam": "always torch's AdamW kernels",
    "tensorboard.enabled": "TensorBoard is always written",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "saves gather one tensor at a time; "
                                                                   "transformers/accelerate read the key",
    "zero_optimization.parameter_alignment": "a layout of DeepSpeed's flat buffers (the checkpoints of "
                                             "to_deepspeed --parameter-alignment have it)",
}


GROUPS_PLUS = {"zero", "offload"}  # groups absent from the app's defaults list: picked with a leading +


@dataclass
class Translation:
    """deepshard's values and config-group picks for a ds_config, in the file's order; unsupported keys
    (to warn about) and built-in ones (for the record).

    ``origin`` maps one of our keys to the ds_config key and value it came from, so an error about
    it can name them as the file does; ``source`` is where the config came from."""

    entries: dict[str, tuple[str, Any]] = field(default_factory=dict)  # our key -> ("group"|"value", value)
    unsupported: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    origin: dict[str, tuple[str, object]] = field(default_factory=dict)
    source: str = "ds_config"

    def set(self, key: str, value: object, ds_key: str | None = None) -> None:
        """Our ``key`` takes ``value`` (``"auto"`` and None leave the caller's)."""
        if value != AUTO and value is not None:
            self.entries[key] = ("value", value)
            if ds_key:
                self.origin[key] = (ds_key, value)

    def pick(self, group: str, choice: str) -> None:
        """A config-group choice (``zero`` -> ``stage3``)."""
        self.entries[group] = ("group", choice)

    def drop(self, keys: set[str]) -> None:
        """Forget the entries the caller sets itself (the command line wins)."""
        self.entries = {k: v for k, v in self.entries.items() if k not in keys}

    @property
    def overrides(self) -> list[str]:
        """The entries as the app's Hydra overrides (``+zero=stage3``, ``optim.lr=0.001``...)."""
        out = []
        for key, (kind, value) in self.entries.items():
            if kind == "group":
                out.append(f"{'+' if key in GROUPS_PLUS else ''}{key}={value}")
            else:
                out.append(f"{key}={_value(value)}")
        return out

    def sections(self) -> dict[str, dict[str, Any]]:
        """The entries per section (``zero``, ``precision``, ``optim``, ``scheduler``, ``offload``,
        ``train``), typed as the file gave them; everything else under ``app``."""
        out: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        out["app"] = {}
        for key, (kind, value) in self.entries.items():
            if kind == "group":
                section, field_name, value = GROUP_FIELDS[key](value)
                out[section][field_name] = value
            elif "." in key and key.split(".", 1)[0] in SECTIONS:
                section, rest = key.split(".", 1)
                out[section][rest] = value
            else:  # ac, logging, profiling, tensorboard: the app's concerns, not the engine's
                out["app"][key] = value
        return out


SECTIONS = ("zero", "precision", "optim", "scheduler", "offload", "train")
GROUP_FIELDS = {  # a group pick as the field it sets
    "zero": lambda choice: ("zero", "stage", int(choice.removeprefix("stage"))),
    "precision": lambda choice: ("precision", "dtype", choice),
    "scheduler": lambda choice: ("scheduler", "name", {v: k for k, v in SCHEDULERS.items()}[choice]),
    "offload": lambda choice: ("offload", "device", choice),
}


def _value(v: object) -> str:
    """A JSON value as a Hydra override value (``5e8`` -> ``500000000``, strings quoted when needed)."""
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v.is_integer() and abs(v) >= 1:
        return str(int(v))
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v)
    return s if re.fullmatch(r"[\w./\-:]+", s) else "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


# DeepSpeed's integer sizes and counts: its config (pydantic) takes a JSON number such as 1e9 for them, and so
# do we (as an int); anything that is not a whole number is left for the settings' checks to refuse, named
DS_INTEGER_KEYS = frozenset({
    "sub_group_size", "buffer_count", "buffer_size", "max_in_cpu", "reduce_bucket_size", "allgather_bucket_size",
    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
    "stage3_max_reuse_distance", "zero_hpz_partition_size", "block_size", "queue_depth", "thread_count",
})


# DeepSpeed's switches: its config (pydantic, lax) takes 1/0 for true/false in them, and so do we; any
# other value is left for the checks below or the settings' to refuse, named
DS_BOOLEAN_KEYS = frozenset({
    "enabled", "overlap_comm", "contiguous_gradients", "reduce_scatter", "round_robin_gradients",
    "cpu_checkpointing", "partition_activations", "contiguous_memory_optimization", "synchronize_checkpoint_boundary",
    "profile", "zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights",
    "single_submit", "overlap_events", "pipeline_read", "pipeline_write", "decoupled", "pin_memory",
    "elastic_checkpoint", "load_from_fp32_weights", "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save", "ignore_unused_parameters", "consecutive_hysteresis",
    "raise_error_at_min_scale", "wall_clock_breakdown", "memory_breakdown", "prescale_gradients",
    "zero_allow_untested_optimizer", "adam_w_mode", "fp32_allreduce",
})


def _ds_values(value: object) -> object:
    """The ds_config as DeepSpeed's config reads it (a copy): its switches written as 1/0 are true/false,
    its integer sizes written as a whole float (``1e9``) are ints."""
    if isinstance(value, dict):
        return {k: _ds_value(k, v) for k, v in value.items()}
    if isinstance(value, list):
        return [_ds_values(v) for v in value]
    return value


def _ds_value(key: str, value: object) -> object:
    if key in DS_BOOLEAN_KEYS and type(value) is int and value in (0, 1):
        return bool(value)
    if key in DS_INTEGER_KEYS and isinstance(value, float) and value.is_integer():
        return int(value)
    return _ds_values(value)


class _Translator:
    def __init__(self) -> None:
        self.t = Translation()

    def set(self, key: str, value: object, ds_key: str | None = None) -> None:
        self.t.set(key, value, ds_key)

    def copy(self, section: dict, path: str, mapping: dict[str, str]) -> None:
        """Map known keys of ``section`` to our keys; the rest are unsupported or built in."""
        for key, value in section.items():
            dotted = f"{path}.{key}"
            if key in mapping:
                self.set(mapping[key], value, dotted)
            elif dotted in BUILT_IN:
                self.t.notes.append(f"{dotted}: {BUILT_IN[dotted]}" if BUILT_IN[dotted] else dotted)
            else:
                self.t.unsupported.append(dotted)


def _enabled(section: object) -> bool:
    return isinstance(section, dict) and section.get("enabled") is True


def _section(value: object, key: str) -> dict:
    """A section that must be a JSON object (ValueError naming the ds_config key)."""
    if not isinstance(value, dict):
        raise ValueError(f"{key}={value!r:.60}: expected a JSON object {{...}}")
    return value


def _positive_int(value: object, key: str) -> None:
    """DeepSpeed's counts (batch sizes, accumulation steps) are positive integers, or "auto"."""
    if value == AUTO or value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1 or int(value) != value:
        raise ValueError(f"{key}={value!r}: expected a positive integer or \"auto\"")


# DeepSpeed's Muon (runtime/zero/muon/original_muon.py MuonWithAuxAdam, engine._muon_param_groups):
# lr for both halves unless muon_lr / adam_lr say otherwise; these defaults where the file says nothing
MUON_DEFAULTS = {"muon_lr": 0.02, "adam_lr": 3e-4, "eps": 1e-10, "betas": [0.9, 0.95], "weight_decay": 0,
                 "momentum": 0.95}


def _muon(params: dict, tr: _Translator) -> None:
    """optimizer.type=Muon: DeepSpeed's keys onto optim.* (params is consumed)."""
    t = tr.t
    t.set("optim.name", "muon", "optimizer.type")
    shared = params.pop("lr", None)
    for ds_key, ours in (("muon_lr", "optim.muon_lr"), ("adam_lr", "optim.lr")):
        value = params.pop(ds_key, shared if shared is not None else MUON_DEFAULTS[ds_key])
        t.set(ours, value, f"optimizer.params.{ds_key}")
    for key in ("eps", "betas", "weight_decay", "momentum"):
        t.set(f"optim.{key}", params.pop(key, MUON_DEFAULTS[key]), f"optimizer.params.{key}")
    if "ns_steps" in params:
        t.set("optim.ns_steps", params.pop("ns_steps"), "optimizer.params.ns_steps")
    method = params.pop("ns_method", "gram")
    if method not in ("gram", "standard"):
        raise ValueError(f"optimizer.params.ns_method={method!r}: valid values are ['gram', 'standard']")
    t.notes.append(f"optimizer.params.ns_method={method}: the standard quintic Newton-Schulz (the Gram form is "
                   "the same iteration rearranged), in optim.ns_dtype")
    if params.pop("per_head_muon", False):
        t.unsupported.append("optimizer.params.per_head_muon=true")


def _bf16_states(section: dict, name: str, tr: _Translator) -> None:
    """bf16.bf16_master_weights_and_grads / bf16_optimizer_states (section is consumed): DeepSpeed's rule
    that bf16 states need bf16 master weights is kept; gradients still accumulate in fp32 here."""
    masters = bool(section.pop("bf16_master_weights_and_grads", False))
    states = bool(section.pop("bf16_optimizer_states", False))
    if states and not masters:
        raise ValueError(f"{name}.bf16_optimizer_states=true needs {name}.bf16_master_weights_and_grads=true "
                         "(DeepSpeed's rule: bf16 optimizer states require bf16 master weights)")
    if states:
        tr.set("optim.state_dtype", "bf16", f"{name}.bf16_optimizer_states")
    elif masters:
        tr.t.unsupported.append(f"{name}.bf16_master_weights_and_grads=true without bf16_optimizer_states "
                                "(bf16 masters with fp32 states)")


def translate(ds: dict) -> Translation:
    """deepshard's settings for a DeepSpeed config dict (see the module docstring)."""
    ds = _ds_values(ds)
    tr = _Translator()
    t = tr.t
    handled = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}
    _batch(ds, tr)

    if "optimizer" in ds:
        handled.add("optimizer")
        opt = _section(ds["optimizer"], "optimizer")
        kind = str(opt.get("type", "AdamW"))
        params = dict(_section(opt.get("params", {}), "optimizer.params"))
        if kind.lower() == "muon":
            _muon(params, tr)
        elif kind.lower() not in ("adamw", "adam"):
            t.unsupported.append(f"optimizer.type={kind}")
        if params.get("adam_w_mode") is False:
            t.unsupported.append("optimizer.params.adam_w_mode=false")
            params.pop("adam_w_mode")
        if isinstance(params.get("betas"), list):
            t.set("optim.betas", params.pop("betas"), "optimizer.params.betas")
        tr.copy(params, "optimizer.params", {"lr": "optim.lr", "eps": "optim.eps", "weight_decay": "optim.weight_decay"})
        t.unsupported += [f"optimizer.{k}" for k in opt if k not in ("type", "params")]

    if "scheduler" in ds:
        handled.add("scheduler")
        kind = _section(ds["scheduler"], "scheduler").get("type")
        if kind in SCHEDULERS:
            t.pick("scheduler", SCHEDULERS[kind])
            params = _section(ds["scheduler"].get("params", {}), "scheduler.params")
            tr.copy(params, "scheduler.params", {k: f"scheduler.{k}" for k in SCHEDULER_PARAMS[kind]})
            for k, v in SCHEDULER_DEFAULTS[kind].items():
                if k not in params:
                    t.set(f"scheduler.{k}", v)
        else:
            t.unsupported.append(f"scheduler.type={kind}")

    if _enabled(ds.get("fp16")) and (_enabled(ds.get("bf16")) or _enabled(ds.get("bfloat16"))):
        raise ValueError("fp16.enabled=true and bf16.enabled=true: enable at most one of them")
    for name in ("fp16", "bf16", "bfloat16"):
        if name in ds:
            handled.add(name)
            section = _section(ds[name], name)
            if _enabled(section):
                t.pick("precision", "fp16" if name == "fp16" else "bf16")
            # false-valued switches ask for nothing we lack
            extra = {k: v for k, v in section.items() if k != "enabled" and not (
                k in ("auto_cast", "immediate_grad_update") and not v)}
            if name != "fp16":
                _bf16_states(extra, name, tr)
            tr.copy(extra, name, {k: f"precision.{k}" for k in FP16_KEYS} if name == "fp16" else {})
    if not any(_enabled(ds.get(name)) for name in ("fp16", "bf16", "bfloat16")):
        t.pick("precision", "fp32")  # DeepSpeed trains such a config in fp32 (our default is auto)

    if "zero_optimization" in ds:
        handled.add("zero_optimization")
        z = ds["zero_optimization"]
        if isinstance(z, bool):  # the legacy switch: true meant stage 1
            z = {"stage": 1} if z else {}
        _zero(_section(z, "zero_optimization"), tr)
    if "aio" in ds:
        handled.add("aio")
        tr.copy(_section(ds["aio"], "aio"), "aio", {k: f"offload.aio.{k}" for k in AIO_KEYS})

    if "communication_data_type" in ds:  # the dtype gradients are reduced in: one key for every stage
        handled.add("communication_data_type")
        comm = ds["communication_data_type"]
        if comm is None or comm == AUTO:
            pass
        elif str(comm).lower() in COMM_DTYPES:
            t.set("zero.reduce_dtype", COMM_DTYPES[str(comm).lower()])
        else:
            raise ValueError(f"communication_data_type={comm!r}: valid values are {sorted(COMM_DTYPES)}")
    if "data_types" in ds:  # gradients always accumulate in fp32 here
        handled.add("data_types")
        for key, v in _section(ds["data_types"], "data_types").items():
            if not (key == "grad_accum_dtype" and str(v).lower() in ("fp32", "float32", "auto")):
                t.unsupported.append(f"data_types.{key}={v}")
    simple = {"gradient_clipping": "optim.grad_clip", "steps_per_print": "train.log_every"}
    for key, target in simple.items():
        if key in ds:
            handled.add(key)
            tr.set(target, ds[key], key)
    if "wall_clock_breakdown" in ds:
        handled.add("wall_clock_breakdown")
        if ds["wall_clock_breakdown"] is True:
            t.set("profile.enabled", True)
    if "activation_checkpointing" in ds:
        handled.add("activation_checkpointing")
        ac = _section(ds["activation_checkpointing"], "activation_checkpointing")
        t.set("ac", "full")  # the section asks for checkpointing: every block, non-reentrant
        if ac.get("cpu_checkpointing"):  # the checkpointed inputs in host memory: our ac_offload
            tr.set("ac_offload", True, "activation_checkpointing.cpu_checkpointing")
        for key in ("partition_activations", "contiguous_memory_optimization",
                    "synchronize_checkpoint_boundary", "profile"):
            if ac.get(key):
                t.unsupported.append(f"activation_checkpointing.{key}")
    if "flops_profiler" in ds:
        handled.add("flops_profiler")
        fp = dict(_section(ds["flops_profiler"], "flops_profiler"))
        if fp.pop("enabled", False) is True:
            t.set("profile.enabled", True)
        if "profile_step" in fp:
            t.set("profile.trace_steps", [int(fp.pop("profile_step"))])
        tr.copy(fp, "flops_profiler", {})
    if "tensorboard" in ds:
        handled.add("tensorboard")
        tb = dict(_section(ds["tensorboard"], "tensorboard"))
        path, job = tb.pop("output_path", None), tb.pop("job_name", None)
        if path or job:
            tr.set("train.tensorboard_dir", str(Path(path or ".") / (job or "")).rstrip("/"), "tensorboard.output_path")
        tr.copy({k: v for k, v in tb.items() if k != "enabled" or v is not False}, "tensorboard", {})
        if tb.get("enabled") is False:
            t.unsupported.append("tensorboard.enabled=false")
    if "checkpoint" in ds:
        handled.add("checkpoint")
        _checkpoint(_section(ds["checkpoint"], "checkpoint"), tr)
    if "sequence_parallel_size" in ds:  # DeepSpeed's Ulysses (ALST; HF's parallelism_config sp_size too)
        handled.add("sequence_parallel_size")
        _positive_int(ds["sequence_parallel_size"], "sequence_parallel_size")
        sp = ds["sequence_parallel_size"]
        tr.set("parallel.sp", sp if sp in (AUTO, None) else int(sp), "sequence_parallel_size")
    if "compile" in ds:  # torch.compile / DeepCompile: ds_compile.py
        handled.add("compile")
        translate_compile(_section(ds["compile"], "compile"), tr)
    if "expert_parallel" in ds:  # AutoEP (HF MoE models): ds_autoep.py
        handled.add("expert_parallel")
        translate_autoep(_section(ds["expert_parallel"], "expert_parallel"), tr)
    if "use_data_before_expert_parallelism" in ds:
        handled.add("use_data_before_expert_parallelism")
        translate_expert_data_order(ds["use_data_before_expert_parallelism"], tr)
    t.notes += [f"{k}: {BUILT_IN[k]}" for k in ds if k not in handled and k in BUILT_IN]
    t.unsupported += [k for k in ds if k not in handled and k not in BUILT_IN]
    return t


def _batch(ds: dict, tr: _Translator) -> None:
    """DeepSpeed's batch triple; a value that is absent or "auto" is derived (0 marks it for the app)."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    for key in keys:
        _positive_int(ds.get(key), key)
    g, m, a = (ds.get(k, AUTO) for k in keys)
    given = [v != AUTO and v is not None for v in (g, m, a)]
    if not any(given):
        return
    if given[0]:
        tr.set("train.global_batch_size", g, keys[0])
        tr.set("train.micro_batch_size", m if given[1] else 0, keys[1])
        tr.set("train.grad_accum", a if given[2] else (0 if given[1] else 1), keys[2])
    else:  # no global batch: DeepSpeed defaults a missing accumulation to 1
        tr.set("train.micro_batch_size", m, keys[1])
        tr.set("train.grad_accum", a if given[2] else 1, keys[2])


# DeepSpeed's ZeRO config (pydantic, populate_by_name) takes its field names beside their stage3_ aliases: axolotl's
# zero3_bf16_cpuoffload_all.json says gather_16bit_weights_on_model_save, max_live_parameters, max_reuse_distance
STAGE3_ALIASES = {name: f"stage3_{name}" for name in (
    "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold", "max_live_parameters",
    "max_reuse_distance", "gather_16bit_weights_on_model_save", "module_granularity_threshold",
    "use_all_reduce_for_fetch_params", "allgather_sequential")}


def _zero(z: dict, tr: _Translator) -> None:
    t = tr.t
    stage = z.get("stage", 0)
    if stage != AUTO:
        if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_optimization.stage={stage!r}: valid values are 0, 1, 2, 3 (or \"auto\")")
        t.pick("zero", f"stage{int(stage)}")
    z = {STAGE3_ALIASES.get(k, k): v for k, v in z.items() if k != "stage"}
    prefetch = z.pop("stage3_prefetch_bucket_size", AUTO)
    if prefetch != AUTO:  # a bucket of elements ahead: 0 turns prefetching off, anything else is one block
        tr.set("zero.prefetch", 0 if prefetch == 0 else 1, "zero_optimization.stage3_prefetch_bucket_size")
    if "sub_group_size" in z:
        tr.set("offload.sub_group_size", z.pop("sub_group_size"), "zero_optimization.sub_group_size")
    for which, target in (("offload_optimizer", None), ("offload_param", "offload.params")):
        path = f"zero_optimization.{which}"
        section = dict(_section(z.pop(which, None) or {}, path))
        device = section.pop("device", "none")
        if target is None:
            if device in ("cpu", "nvme"):
                t.pick("offload", device)
            elif device not in ("none", None):
                t.unsupported.append(f"{path}.device={device}")
            overlap = [section.pop(k) for k in ("pipeline_read", "pipeline_write") if k in section]
            if overlap:  # DeepSpeed's swap pipelining is our aio overlap_events
                tr.set("offload.aio.overlap_events", any(overlap), f"{path}.pipeline_read")
            tr.copy(section, path, {"nvme_path": "offload.nvme_path", "buffer_count": "offload.buffer_count"})
        else:
            if device in ("cpu", "nvme"):
                t.set("offload.params", device)
            elif device not in ("none", None):
                t.unsupported.append(f"{path}.device={device}")
            if device == "cpu":  # the swap knobs only matter for parameter swapping to NVMe
                section = {k: v for k, v in section.items() if k not in ("buffer_count", "buffer_size", "max_in_cpu")}
            if section.get("nvme_path") is not None and t.entries.get("offload.nvme_path") == ("value", section["nvme_path"]):
                section.pop("nvme_path")  # one swap directory for both: the optimizer's already set it
            tr.copy(section, path, {"nvme_path": "offload.nvme_path", "buffer_count": "offload.param_buffer_count",
                                    "buffer_size": "offload.param_buffer_size", "max_in_cpu": "offload.max_in_cpu"}
                    if device == "nvme" else {})
    keys = ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm")
    # ZeRO++ (deepshard.core.zero.quantized, hsdp, replica_reduce; an hpZ partition that cannot work is refused
    # by the app's checks, naming why); zeropp_loco_param is LoCo's error feedback (deepshard.core.zero.loco)
    zeropp = {f"zero_{k}": f"zero.{k}" for k in ("quantized_weights", "quantized_gradients", "hpz_partition_size")}
    if z.get("zero_quantized_gradients") is True:  # DeepSpeed's qgZ sends int4 blocks
        tr.set("zero.quantized_gradients_bits", 4, "zero_optimization.zero_quantized_gradients")
    loco = z.pop("zeropp_loco_param", None)
    if loco is not None:  # {"err_beta": 0.8, "reset_T": 1024}: DeepSpeed's defaults are ZeroConfig's
        path = "zero_optimization.zeropp_loco_param"
        tr.set("zero.loco", True, path)
        tr.copy(_section(loco, path), path, {"err_beta": "zero.loco_err_beta", "reset_T": "zero.loco_reset_t"})
    tr.copy(z, "zero_optimization", {**{k: f"zero.{k}" for k in keys}, **zeropp})


TAG_VALIDATION = ("WARN", "IGNORE", "FAIL")  # DeepSpeed's checkpoint.tag_validation modes (any case)


def _checkpoint(c: dict, tr: _Translator) -> None:
    """DeepSpeed's ``checkpoint`` section.  ``tag_validation`` (Warn | Ignore | Fail) is checked here and
    read by deepshard.compat.deepspeed's save_checkpoint (the app names its own checkpoints: a note);
    ``writer.decoupled=true`` (DeepSpeed's writer in its own process while training goes on) is our
    asynchronous save, ``checkpoint.async_save``; the writer's I/O tuning keys are not ours."""
    mode = c.get("tag_validation")
    if mode is not None:
        if not isinstance(mode, str) or mode.upper() not in TAG_VALIDATION:
            raise ValueError(f"checkpoint.tag_validation={mode!r}: valid values are Warn, Ignore, Fail")
        tr.t.notes.append(f"checkpoint.tag_validation={mode}: used by deepshard.compat.deepspeed's save_checkpoint")
    writer = c.get("writer")
    if writer is not None:
        writer = dict(_section(writer, "checkpoint.writer"))
        decoupled = writer.pop("decoupled", False)
        if not isinstance(decoupled, bool):
            raise ValueError(f"checkpoint.writer.decoupled={decoupled!r}: expected true or false")
        if decoupled:
            tr.set("checkpoint.async_save", True, "checkpoint.writer.decoupled")
        tr.copy(writer, "checkpoint.writer", {})
    tr.copy({k: v for k, v in c.items() if k not in ("tag_validation", "writer")}, "checkpoint", {})


def load(path: str) -> dict:
    """The JSON file, with a ValueError naming it when it cannot be read."""
    try:
        ds = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"deepspeed={path!r}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"deepspeed={path!r}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(ds, dict):
        raise ValueError(f"deepspeed={path!r}: expected a JSON object at the top level")
    return ds


def read(path: str) -> Translation:
    """The file's translation; a ValueError about one of its values names the file, then the key."""
    ds = load(path)
    try:
        tr = translate(ds)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    tr.source = path
    return tr
