"""Ulysses sequence parallelism applied to a model from outside (``parallel.sp``), as TP is.

Each sp rank runs the model on its consecutive slice of every sequence (``input_ids``, ``labels``
and ``doc_ids`` all sliced alike; the labels were aligned on the whole sequence first, so the last
token of slice k predicts the first of slice k+1).  Everything but attention is per token.  Each
``Attention`` gets the sp group: its q/k/v go through core's all-to-all to whole sequences for
``heads / sp`` heads, RoPE and the causal / document mask apply with global positions, and the output
comes back to the rank's tokens.  The document mask needs the whole row's ``doc_ids``: a forward
pre-hook all-gathers them once per forward (ints, a few bytes per token).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from deepshard.core.sequence_parallel import gather_sequence

__all__ = ["apply_ulysses", "check_sp"]


def check_sp(cfg: Any, *, sp: int, tp: int = 1, seq_len: int | None = None) -> None:
    """ValueError unless ``sp`` splits the sequence and each tp rank's heads evenly (``cfg``: a
    family's model config, with ``n_heads``)."""
    if sp == 1:
        return
    heads = cfg.n_heads // tp  # each tp rank's heads are what its sp ranks share
    if heads % sp:
        raise ValueError(f"parallel.sp={sp} does not divide model.n_heads={cfg.n_heads}"
                         + (f" / parallel.tp={tp} = {heads} heads per tp rank" if tp > 1 else "")
                         + ": each sp rank attends over whole sequences for an equal share of the heads; "
                         f"choose sp among the divisors of {heads}")
    # fewer kv heads than sp (or not divisible by it): they are repeated to line up (expand_kv_heads)
    if seq_len is not None and seq_len % sp:
        raise ValueError(f"data.seq_len={seq_len} is not divisible by parallel.sp={sp}: each sp rank holds "
                         f"seq_len/sp tokens; choose a multiple of {sp}")


def _gather_doc_ids(group: Any):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("doc_ids") is not None:
            kwargs = {**kwargs, "doc_ids": gather_sequence(kwargs["doc_ids"], group)}
        elif len(args) > 2 and args[2] is not None:
            args = (*args[:2], gather_sequence(args[2], group), *args[3:])
        return args, kwargs

    return hook


def apply_ulysses(model: nn.Module, sp_mesh: DeviceMesh) -> None:
    """Every attention of ``model`` attends over whole sequences through ``sp_mesh``'s all-to-alls;
    ``doc_ids`` are all-gathered over it.  In place; nothing to do at sp=1.  An attention module is
    one with an ``sp_group`` attribute (None until set here), whatever its family."""
    if sp_mesh.size() == 1:
        return
    group = sp_mesh.get_group()
    attentions = [m for m in model.modules() if hasattr(m, "sp_group")]
    assert attentions, "apply_ulysses: the model has no attention module (none has an sp_group)"
    for attn in attentions:
        attn.sp_group = group
    model.register_forward_pre_hook(_gather_doc_ids(group), with_kwargs=True)
