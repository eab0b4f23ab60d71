"""Materializing a model built on the meta device, its tied parameters kept one (the app's assembly and a
pipeline stage's init both need it)."""

from __future__ import annotations

import torch
from torch import nn


def to_empty_tied(model: nn.Module, device: torch.device) -> None:
    """``model.to_empty(device)`` with its tied parameters still one: from the meta device each module
    gets a new parameter, which unties a shared one (the embedding and head of Llama 3.2 and SmolLM2,
    whose checkpoints then hold no ``lm_head.weight`` to load)."""
    owner: dict[int, str] = {}
    ties = [(name, owner.setdefault(id(p), name)) for name, p in model.named_parameters(remove_duplicate=False)]
    model.to_empty(device=device)
    for name, first in ties:
        if name != first:
            module, _, attr = name.rpartition(".")
            setattr(model.get_submodule(module), attr, model.get_parameter(first))
