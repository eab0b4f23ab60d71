"""Activation checkpointing per block, non-reentrant only (reentrant trains wrongly under FSDP2)."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from deepshard.core.config import AC_MODES


def apply_ac(blocks: nn.Module, mode: str) -> None:
    """Wrap blocks in place: ``full`` every block, ``every_2`` every second one, ``none`` nothing.

    ``blocks`` is a ModuleList, or a pipeline stage's ModuleDict keyed by the original layer index
    (so ``every_2`` picks the same layers whatever the split).
    """
    assert mode in AC_MODES, mode  # a user's value was checked where it entered: EngineConfig
    if mode == "none":
        return
    every = 1 if mode == "full" else 2
    for key, block in list(blocks.named_children()):
        if int(key) % every == 0:
            blocks.register_module(key, checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT))
