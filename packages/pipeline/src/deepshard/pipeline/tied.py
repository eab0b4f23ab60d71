"""Parameters tied across pipeline stages (a head tied to the input embedding), Megatron's and
DeepSpeed's way (``TiedLayerSpec``): each stage holding one keeps its own copy, loaded from the same
tensor; before every step the copies' gradients are summed, so both take the same update and stay
equal; each copy counts half in the global grad and param norms; a checkpoint holds the tensor once,
under the name it has in the unsplit model (the first of its pair), so a checkpoint saved at pp=2
loads at pp=1 and the reverse.

Model-agnostic: a list of ``(kept, copy)`` parameter-name pairs in (``("embed_tokens.weight",
"lm_head.weight")``).  The sum runs over a pp group of two (its first and last stages), or locally
where one rank holds both copies (a V-shaped schedule); larger pp groups are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deepshard.core.checkpoint import clean_name
from deepshard.core.optim import StepStats
from deepshard.pipeline.engine import PipelineEngine

__all__ = ["TiedPair", "TiedPipelineEngine", "check_tied_pp", "untie"]

TiedPair = tuple[str, str]  # (the name the unsplit model lists it by, the other stage's copy's name)


def check_tied_pp(pp: int, *, what: str) -> None:
    """ValueError unless the copies of a tied parameter can be summed at ``pp`` (``what``: which model ties
    what, for the message)."""
    if pp > 2:
        raise ValueError(f"parallel.pp={pp}: {what}; the first and last stages sum their two copies' gradients "
                         f"at parallel.pp=2 only; use parallel.pp=2")


def untie(model: nn.Module, tied: Sequence[TiedPair]) -> None:
    """Give each pair's copy its own parameter, a clone of the kept one (on meta: a meta clone; a stage's
    ``init_fn`` fills it by name), so the split can put the two on different stages."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for kept, copy in tied:
        owner, _, leaf = copy.rpartition(".")
        module = model.get_submodule(owner)
        setattr(module, leaf, nn.Parameter(params[kept].detach().clone(), requires_grad=params[kept].requires_grad))


class TiedPipelineEngine(PipelineEngine):
    """The pipeline engine of a model with parameters tied across stages (see the module docstring)."""

    def __init__(self, *args: Any, tied: Sequence[TiedPair], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.pipeline.pp_mesh.size() > 2:
            raise ValueError(f"TiedPipelineEngine: {len(tied)} tied pair(s) over {self.pipeline.pp_mesh.size()} "
                             f"pipeline ranks; the copies' gradients are summed over a pp group of two only")
        index = {clean_name(n): i for i, n in enumerate(self.zero.names)}
        self.tied = [(index.get(kept), index.get(copy)) for kept, copy in tied]
        for (kept, _), (_, i) in zip(tied, self.tied, strict=True):
            if i is not None:  # the copy is saved and loaded as the one tensor it is
                self.zero.names[i] = kept
        held = {i for pair in self.tied for i in pair if i is not None}
        self.optimizer.count_shared(dict.fromkeys(held, 2))  # each of the two copies counts half in the norms
        self.held = sorted(held)

    def step(self) -> StepStats:
        """Sum the tied copies' gradients (both ranks run the same all-reduces, pair by pair), then step."""
        grads = self.zero.local_grads()
        with torch.no_grad():
            for kept, copy in self.tied:
                if kept is not None and copy is not None:  # this rank holds both stages
                    grads[kept].add_(grads[copy])
                    grads[copy].copy_(grads[kept])
                elif kept is not None or copy is not None:  # the other rank of the pp group holds the other
                    dist.all_reduce(grads[kept if kept is not None else copy], group=self.pipeline.pp_mesh.get_group())
        handed = self.zero.handed_over()
        for i in self.held:
            if i in handed:  # ZeRO-2 handed the store this gradient during backward, before the sum
                self.store.grad_ready(i, grads[i])
        return super().step()
