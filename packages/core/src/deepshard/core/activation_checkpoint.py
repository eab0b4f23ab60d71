"""Activation checkpointing per block, non-reentrant only (reentrant trains wrongly under FSDP2)."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper


def apply_ac(blocks: nn.ModuleList, mode: str) -> None:
    """Wrap blocks in place: ``full`` every block, ``every_2`` every second one, ``none`` nothing."""
    if mode == "none":
        return
    every = {"full": 1, "every_2": 2}.get(mode)
    if every is None:
        raise ValueError(f"ac={mode!r}: valid values are ['none', 'full', 'every_2']")
    for i, block in enumerate(blocks):
        if i % every == 0:
            blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
