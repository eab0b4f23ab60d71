"""The ds_config's ``"auto"`` values from ``TrainingArguments``, by transformers' rules.

Same rules and the same error as transformers' ``HfTrainerDeepSpeedConfig`` (its
``trainer_config_process`` at argument time, ``trainer_config_finalize`` once the model and the
number of update steps are known), written without DeepSpeed: an ``"auto"`` takes the argument's
value; a value that is not ``"auto"`` and differs from the argument is a mismatch, and all of them
are reported in one ValueError naming the ds_config key and the argument.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

AUTO = "auto"
HIDDEN_SIZE_KEYS = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                    "zero_optimization.stage3_param_persistence_threshold")


def read(config: dict | str | Path) -> dict:
    """The ds_config as a fresh dict (a path is read as JSON)."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, Path)):
        try:
            ds = json.loads(Path(config).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"TrainingArguments(deepspeed={str(config)!r}): cannot read it as JSON: {err}") from None
        if not isinstance(ds, dict):
            raise ValueError(f"TrainingArguments(deepspeed={str(config)!r}): expected a JSON object")
        return ds
    raise ValueError(f"TrainingArguments(deepspeed={type(config).__name__}): expected a ds_config dict or JSON path")


class AutoFill:
    """A ds_config being filled from ``TrainingArguments``; ``mismatches`` collects the conflicts."""

    def __init__(self, ds: dict) -> None:
        self.ds = ds
        self.mismatches: list[str] = []

    def _node(self, key: str) -> tuple[dict | None, str]:
        *path, leaf = key.split(".")
        node: Any = self.ds
        for name in path:
            node = node.get(name) if isinstance(node, dict) else None
            if node is None:
                return None, leaf
        return (node if isinstance(node, dict) else None), leaf

    def value(self, key: str) -> Any:
        node, leaf = self._node(key)
        return None if node is None else node.get(leaf)

    def fill(self, key: str, hf_value: Any, hf_key: str | None = None, must_match: bool = True) -> None:
        node, leaf = self._node(key)
        if node is None:
            return
        if node.get(leaf) == AUTO:
            node[leaf] = hf_value
        elif must_match and node.get(leaf) is not None and node.get(leaf) != hf_value:
            self.mismatches.append(f"- ds {key}={node.get(leaf)} vs hf {hf_key}={hf_value}")

    def from_args(self, args: Any, *, world_size: int) -> None:
        """What transformers fills when ``TrainingArguments`` is built."""
        micro, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
        self.fill("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
        self.fill("gradient_accumulation_steps", accum, "gradient_accumulation_steps")
        self.fill("train_batch_size", world_size * micro * accum, "train_batch_size (calculated)")
        self.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
        self.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
        self.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
        self.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
        self.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
        self.fill("scheduler.params.warmup_min_lr", 0, must_match=False)
        self.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
        self.fill("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval")
        self.fill("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval")

    def for_run(self, args: Any, *, hidden_size: int | None, num_training_steps: int) -> None:
        """What transformers fills once the model and the number of update steps are known."""
        auto_keys = [k for k in HIDDEN_SIZE_KEYS if self.value(k) == AUTO]
        if auto_keys:
            if hidden_size is None:
                raise ValueError(f"ds_config {auto_keys} = 'auto': the model's config has no hidden_size to fill "
                                 f"them from; give integers")
            self.fill("zero_optimization.reduce_bucket_size", hidden_size * hidden_size, must_match=False)
            if self.value("zero_optimization.stage") == 3:
                self.fill("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size),
                          must_match=False)
                self.fill("zero_optimization.stage3_param_persistence_threshold", 10 * hidden_size,
                          must_match=False)
        self.fill("scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)")
        self.fill("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)),
                  "warmup_steps")

    def check(self) -> None:
        """One ValueError listing every mismatch (transformers' text)."""
        if self.mismatches:
            raise ValueError("Please correct the following DeepSpeed config values that mismatch TrainingArguments "
                             "values:\n" + "\n".join(self.mismatches) +
                             "\nThe easiest method is to set these DeepSpeed config values to 'auto'.")


def hidden_size(model: Any) -> int | None:
    """The model's hidden size as transformers reads it for the bucket sizes (largest of ``hidden_sizes``)."""
    for cfg in (getattr(model, "config", None), getattr(getattr(model, "config", None), "text_config", None)):
        if cfg is None:
            continue
        if getattr(cfg, "hidden_size", None) is not None:
            return int(cfg.hidden_size)
        if getattr(cfg, "hidden_sizes", None):
            return int(max(cfg.hidden_sizes))
    return None


def fill(config: dict | str | Path, args: Any, *, world_size: int, model: Any, num_training_steps: int) -> dict:
    """The ds_config with every ``"auto"`` HF fills replaced; ValueError listing all mismatches."""
    filler = AutoFill(read(config))
    filler.from_args(args, world_size=world_size)
    filler.for_run(args, hidden_size=hidden_size(model), num_training_steps=num_training_steps)
    filler.check()
    return filler.ds
