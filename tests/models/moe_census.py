"""What autograd keeps of each sparse MoE layer's forward: a census of the tensors saved for backward
(``saved_tensors_hooks`` around each ``SparseMoe``), each storage once, less the parameters and the
layer's input (the block's part), for the estimator's ``sparse_layer_bytes`` (tests/models/test_moe_ep.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks


def saved_census(model: nn.Module, run: Callable[[], Any]) -> list[dict[str, int]]:
    """Per sparse layer, in forward order: ``{"tokens": T, "saved": bytes}`` while ``run()`` runs a forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    out: list[dict[str, int]] = []
    state: dict[str, Any] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr != state["input"]:
            state["seen"][ptr] = t.untyped_storage().nbytes()
        return t

    def pre(module: nn.Module, args: tuple) -> None:
        state.update(input=args[0].untyped_storage().data_ptr(), seen={}, ctx=saved_tensors_hooks(pack, lambda t: t))
        state["ctx"].__enter__()

    def post(module: nn.Module, args: tuple, y: torch.Tensor) -> None:
        state["ctx"].__exit__(None, None, None)
        out.append({"tokens": args[0].shape[:-1].numel(), "saved": sum(state["seen"].values())})

    layers = [m for m in model.modules() if hasattr(m, "ep_group")]  # models/moe.py's SparseMoe
    handles = [m.register_forward_pre_hook(pre) for m in layers] + [m.register_forward_hook(post) for m in layers]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return out
