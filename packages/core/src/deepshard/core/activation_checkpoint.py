"""Activation checkpointing per block, non-reentrant only (reentrant trains wrongly under FSDP2)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from deepshard.core.config import AC_MODES


def offloaded_checkpoint(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Non-reentrant checkpoint of ``module`` whose saved inputs (the only tensors a checkpointed block
    keeps for backward) go to host memory, pinned when an accelerator exists, and come back for the
    recompute (``ac_offload``, DeepSpeed's ``cpu_checkpointing``).  Inside the block the checkpoint's
    own hooks win, so nothing else moves."""
    with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
        return checkpoint(module, *args, use_reentrant=False, **kwargs)


def apply_ac(blocks: nn.Module, mode: str, *, offload: bool = False) -> None:
    """Wrap blocks in place: ``full`` every block, ``every_2`` every second one, ``none`` nothing.

    ``blocks`` is a ModuleList, or a pipeline stage's ModuleDict keyed by the original layer index
    (so ``every_2`` picks the same layers whatever the split).
    """
    assert mode in AC_MODES, mode  # a user's value was checked where it entered: EngineConfig
    if mode == "none":
        assert not offload, "ac_offload needs checkpointed blocks (ac=full or every_2)"
        return
    every = 1 if mode == "full" else 2
    for key, block in list(blocks.named_children()):
        if int(key) % every == 0:
            blocks.register_module(key, checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                           checkpoint_fn=offloaded_checkpoint if offload else None))
