"""Unsupported ds_config keys that would change the numbers: refused before training under the provided
``deepspeed`` (issue 41).

A DeepSpeed script that imports ``deepshard.compat.deepspeed`` itself gets one warning line naming the keys
deepshard ignores.  A script started through transformers/accelerate/TRL with the provided ``deepspeed`` did
not choose deepshard line by line, so a key whose absence changes results (another optimizer, a scheduler
we do not have, gradient pre-scaling, curriculum or compression settings) stops the run before the first
step with one line naming the ds_config and the key; keys that only tune speed or memory keep the warning.
"""

from __future__ import annotations

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
        raise ValueError(f"{name}: {changing[0]}: not supported by deepshard's engine, and ignoring it would change "
                         f"the results; remove it (or train on DeepSpeed: DEEPSHARD_DEEPSPEED=0)")
