"""HF checkpoints of the MoE families in: transformers 5's fused layout (``mlp.experts.gate_up_proj``
[E, 2I, H], ``mlp.experts.down_proj`` [E, H, I], our own names) and the per-expert layout that
``save_pretrained`` of transformers 5.25 still writes and checkpoints on disk have (Qwen3-MoE:
``mlp.experts.N.{gate,up,down}_proj.weight``; Mixtral: ``block_sparse_moe.experts.N.{w1,w3,w2}.weight``
and ``block_sparse_moe.gate``), stacked here as they are read.  Out: our names are transformers 5's
fused ones, which ``from_pretrained`` of 5.25 loads as they are (``models/hf.py`` writes them).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from deepshard.finetune.models.hf import check_hf_dir, from_hf_name, load_hf_weights

_PER_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def our_name(hf_name: str) -> tuple[str, int, str] | tuple[str, None, None]:
    """(our parameter name, expert, gate|up|down) of a per-expert HF key; (our name, None, None) else."""
    name = from_hf_name(hf_name).replace(".block_sparse_moe.", ".mlp.")
    m = _PER_EXPERT.match(name)
    if m is None:
        return name, None, None
    part = _PART[m.group(3)]
    return f"{m.group(1)}.experts.{'down_proj' if part == 'down' else 'gate_up_proj'}", int(m.group(2)), part


class _Stacker:
    """Per-expert pieces gathered until a stacked parameter is complete, then handed out once."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self.shapes, self.pieces = shapes, {}

    def add(self, name: str, expert: int, part: str, t: torch.Tensor, where: str) -> torch.Tensor | None:
        shape = self.shapes[name]
        want = (shape[1] // 2, shape[2]) if part != "down" else tuple(shape[1:])
        if expert >= shape[0] or tuple(t.shape) != want:
            raise ValueError(f"{where}: expert {expert} {part} of {name} has shape {list(t.shape)}; our model "
                             f"expects {shape[0]} experts of {list(want)}")
        got = self.pieces.setdefault(name, {})
        got[(expert, part)] = t
        if len(got) < shape[0] * (1 if part == "down" else 2):
            return None
        del self.pieces[name]
        if part == "down":
            return torch.stack([got[(e, "down")] for e in range(shape[0])])
        return torch.cat([torch.stack([got[(e, p)] for e in range(shape[0])]) for p in ("gate", "up")], dim=1)


def _expert_hooks(model: nn.Module) -> dict:
    """``rename``/``assemble`` for :mod:`deepshard.finetune.models.hf`'s reader: per-expert HF tensors
    stacked into our fused expert parameters, any other tensor as it is."""
    stacker = _Stacker({n: tuple(p.shape) for n, p in model.named_parameters()})

    def assemble(hf_name: str, t: torch.Tensor, where: str) -> torch.Tensor | None:
        name, expert, part = our_name(hf_name)
        return t if expert is None else stacker.add(name, expert, part, t, where)

    return {"rename": lambda hf_name: our_name(hf_name)[0], "assemble": assemble}


def load_moe_weights(model: nn.Module, path: str | Path) -> None:
    """Copy a HF MoE checkpoint (fused or per-expert) into ``model`` (plain or ZeRO-3 sharded)."""
    load_hf_weights(model, path, **_expert_hooks(model))


def check_moe_dir(path: str | Path, model: nn.Module) -> None:
    """Before start: a tokenizer is there and the headers name every weight of ``model`` (meta) with its
    shape, fused or per expert (headers only)."""
    check_hf_dir(path, model, **_expert_hooks(model))
