"""Unsupported ds_config keys that would change the numbers: refused before training under the provided
``deepspeed`` (issue 41).

A DeepSpeed script that imports ``deepshard.compat.deepspeed`` itself gets one warning line naming the keys
deepshard ignores.  A script started through transformers/accelerate/TRL with the provided ``deepspeed`` did
not choose deepshard line by line, so a key whose absence changes results (another optimizer, a scheduler
we do not have, gradient pre-scaling, curriculum or compression settings) stops the run before the first
step with one line naming the ds_config and the key; keys that only tune speed or memory keep the warning.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

WHY = ("not supported by deepshard's engine, and ignoring it would change the results; remove it "
       "(or train on DeepSpeed: DEEPSHARD_DEEPSPEED=0)")

# DeepSpeed keys (as ds_config.translate names them when unsupported) whose effect is on the numbers
RESULT_CHANGING = ("optimizer.", "scheduler.", "prescale_gradients", "gradient_predivide_factor",
                   "data_types.grad_accum_dtype", "sparse_gradients", "compression_training", "curriculum_learning",
                   "data_efficiency", "progressive_layer_drop", "quantize_training", "eigenvalue",
                   "zero_optimization.zero_quantized_weights", "zero_optimization.zero_quantized_gradients",
                   "fp16.fp16_master_weights_and_grads", "bf16.immediate_grad_update")


def provider_active() -> bool:
    """Whether this config came the HF stack's way: ``import deepspeed`` gave deepshard's engine."""
    from deepshard.compat.deepspeed_provider import serving

    return serving()


def refuse_result_changing(unsupported: list[str], source: str) -> None:
    """One line naming the first result-changing key, when the HF stack reached us through the provider."""
    if not provider_active():
        return
    changing = [k for k in unsupported if k.startswith(RESULT_CHANGING)]
    if changing:
        name = source if source != "ds_config" else "the ds_config (TrainingArguments(deepspeed=...))"
        raise ValueError(f"{name}: {changing[0]}: {WHY}")


def _drop_auto(value: Any) -> Any:
    """The ds_config as the engine will see it, less what transformers/accelerate fill ("auto" values)."""
    if isinstance(value, dict):
        return {k: _drop_auto(v) for k, v in value.items() if v != "auto"}
    return value


def _lookup(ds: dict, dotted: str) -> Any:
    node: Any = ds
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return "..."
        node = node[part]
    return node


def refuse_in(where: str, ds: dict) -> None:
    """One line naming ``where`` (the file) and the first key of a user's ds_config that deepshard's engine
    would ignore and that changes results (sequence parallelism first: the field's complaint)."""
    from deepshard.compat.ds_config import translate

    kept = _drop_auto(ds)
    try:
        unsupported = translate(kept).unsupported
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    changing = [k for k in unsupported if k.startswith(RESULT_CHANGING)]
    if kept.get("sequence_parallel_size", 1) != 1:
        changing.insert(0, "sequence_parallel_size")
    if changing:  # the translation names some as key=value already
        key, _, value = changing[0].partition("=")
        raise ValueError(f"{where}: {key}={value or _lookup(ds, key)}: {WHY}")


def check_trainer_ds_config(config_file_or_dict: Any) -> None:
    """``TrainingArguments(deepspeed=...)`` under the provider, when transformers reads it (before the model
    loads): a file is named by its path, a dict as the argument; what is not a readable JSON file (a base64
    string, a missing path) is left to transformers' own error."""
    if isinstance(config_file_or_dict, dict):
        refuse_in("TrainingArguments(deepspeed={...})", config_file_or_dict)
        return
    if not isinstance(config_file_or_dict, (str, Path)) or not Path(config_file_or_dict).is_file():
        return
    try:
        ds = json.loads(Path(config_file_or_dict).read_text())
    except (OSError, ValueError):
        return
    if isinstance(ds, dict):
        refuse_in(str(config_file_or_dict), ds)
