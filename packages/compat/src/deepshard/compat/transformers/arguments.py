"""``TrainingArguments`` whose ``deepspeed=`` (a ds_config path or dict) runs on deepshard's engine.

transformers' ``__post_init__`` hands ``deepspeed`` to accelerate's DeepSpeed plugin (which imports
the ``deepspeed`` package) and ``fp16``/``bf16`` to accelerate's autocast; ``_setup_devices`` asks
accelerate for a DeepSpeed process state.  Here both run with those three fields hidden, then get
them back: the field keeps the user's value, the ds_config goes to deepshard's translation, and the
engine owns precision (accelerate's ``mixed_precision`` stays ``"no"``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import torch
import transformers

_HIDDEN = ("deepspeed", "fp16", "bf16")


@contextlib.contextmanager
def _hidden(args: transformers.TrainingArguments) -> Iterator[None]:
    """``deepspeed``/``fp16``/``bf16`` read as unset by transformers' own set-up code."""
    saved = {name: getattr(args, name) for name in _HIDDEN}
    for name in saved:
        setattr(args, name, None if name == "deepspeed" else False)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(args, name, value)


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """transformers' ``TrainingArguments``; ``deepspeed=`` selects deepshard's engine (ZeRO 0-3)."""

    def __post_init__(self) -> None:
        if self.deepspeed and not torch.cuda.is_available():
            # accelerate treats torchrun's ranks on a CPU-only host as one process each unless told "cpu";
            # the same script runs here and on GPUs (DeepSpeed's own launch would need GPUs)
            self.use_cpu = True
        with _hidden(self):
            super().__post_init__()
        self.mixed_precision = "no"  # the engine casts (ds_config fp16/bf16), not accelerate's autocast
        self.refuse_unsupported()

    @cached_property
    def _setup_devices(self) -> torch.device:
        with _hidden(self):
            return transformers.TrainingArguments._setup_devices.func(self)

    def refuse_unsupported(self) -> None:
        """Trainer features that do not combine with the deepshard engine: one line naming the argument."""
        if not self.deepspeed:
            return
        if self.torch_compile and self.torch_compile_mode not in (None, "default"):
            raise ValueError(f"TrainingArguments(torch_compile_mode={self.torch_compile_mode!r}) with deepspeed=: "
                             "not supported (blocks compile with inductor's default mode); leave it unset")
        if self.fsdp:
            raise ValueError(f"TrainingArguments(fsdp={self.fsdp!r}) with deepspeed=: give one of them")
        if self.fp16 and self.bf16:
            raise ValueError("TrainingArguments(fp16=True, bf16=True): at most one of fp16 and bf16")
        if self.load_best_model_at_end:
            raise ValueError("TrainingArguments(load_best_model_at_end=True) with deepspeed=: not supported; "
                             "resume_from_checkpoint= the best checkpoint-N instead")
        ac_kwargs = self.activation_checkpointing_kwargs
        if isinstance(ac_kwargs, dict) and ac_kwargs.get("use_reentrant"):
            raise ValueError("TrainingArguments(activation_checkpointing_kwargs={'use_reentrant': True}) with "
                             "deepspeed=: not supported (reentrant checkpointing under ZeRO-3 trains wrong "
                             "silently); leave it False, transformers' default")
        if self.save_on_each_node:
            raise ValueError("TrainingArguments(save_on_each_node=True) with deepspeed=: not supported (global rank 0 "
                             "writes save_model()'s files and the checkpoints' trainer state)")
        if self.auto_find_batch_size:
            raise ValueError("TrainingArguments(auto_find_batch_size=True) with deepspeed=: not supported")
