"""LoRA as a model transform: ``apply_lora(model, r=..., ...)`` before TP, AC and ZeRO.

Each targeted ``nn.Linear`` becomes a :class:`LoraLinear` computing
``x W^T + (alpha / r) * B(A(dropout(x)))``: ``W`` is the frozen base weight (its name is unchanged,
``layers.0.self_attn.q_proj.weight``, so HF loading, checkpoints and the TP plan see the same
model), ``A`` (``r x in``) and ``B`` (``out x r``) are the trainable adapters, named as PEFT names
them for a HF causal LM (``...q_proj.lora_A.weight``): an adapter's PEFT key is
``base_model.model.`` + its HF name (:func:`peft_key`).  ``modules_to_save`` (the embedding, the
head, the norms) stay fully trainable, as PEFT's ``modules_to_save`` do.  Every other parameter
gets ``requires_grad=False``: the ZeRO stages, the optimizer and its state cover adapters only,
while the frozen base is still cast, sharded (ZeRO-3) and gathered as today.

Init follows PEFT: ``A`` Kaiming-uniform (``a=sqrt(5)``, i.e. U(-1/sqrt(in), 1/sqrt(in))), ``B``
zeros, so the model starts exactly as the base.  The init writes through ``copy_global``, so it
also fills ZeRO-3 shards of a model built on the meta device (seeded: every layout gets the same
adapters).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard

from deepshard.core.dtensor_utils import copy_global

__all__ = ["LORA_COLWISE", "LORA_ROWWISE", "LORA_TARGETS", "SAVABLE_MODULES", "LoraLinear", "LoraConfig",
           "adapter_names", "apply_lora", "check_lora_parallel", "init_adapters", "is_adapter", "peft_key"]

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SAVABLE_MODULES = ("embed_tokens", "lm_head", "norm", "input_layernorm", "post_attention_layernorm")
ADAPTER_MARK = (".lora_A.", ".lora_B.")
# Tensor parallel: where the adapters of a column-parallel base (weight Shard(0), output features) and of a
# row-parallel base (weight Shard(1), input features) go, so that x A^T B^T is split like x W^T (the rank
# r is never split).  Column: A replicated, B by output features.  Row: A by input features (a partial
# sum, reduced with the base's output in the layer's one all-reduce), B replicated.
LORA_COLWISE: dict[str, Placement] = {"lora_A": Replicate(), "lora_B": Shard(0)}
LORA_ROWWISE: dict[str, Placement] = {"lora_A": Shard(1), "lora_B": Replicate()}


@dataclass(frozen=True)
class LoraConfig:
    """``peft.*`` validated: rank, scale, dropout, which projections get adapters, what stays trainable."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = LORA_TARGETS
    modules_to_save: tuple[str, ...] = ()
    init_from: str | None = None  # a PEFT adapter folder to continue from
    base_quant: str = "none"  # nf4: QLoRA, the frozen block Linear weights stored as NF4 (models/qlora.py)

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"peft.r={self.r}: the LoRA rank must be a positive integer (8, 16, 64 are common)")
        if not self.alpha > 0:
            raise ValueError(f"peft.alpha={self.alpha}: must be > 0 (the adapters are scaled by alpha / r)")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"peft.dropout={self.dropout}: must be in [0, 1)")
        if not self.target_modules:
            raise ValueError(f"peft.target_modules=[]: name at least one of {list(LORA_TARGETS)}")
        for key, names, valid in (("peft.target_modules", self.target_modules, LORA_TARGETS),
                                  ("peft.modules_to_save", self.modules_to_save, SAVABLE_MODULES)):
            bad = [n for n in names if n not in valid]
            if bad:
                raise ValueError(f"{key}={list(names)}: unknown module name {bad[0]!r}; valid names are "
                                 f"{list(valid)}")
        if self.base_quant not in ("none", "nf4"):
            raise ValueError(f"peft.base_quant={self.base_quant!r}: valid values are ['none', 'nf4'] (nf4: QLoRA's "
                             f"4-bit NormalFloat base)")
        overlap = set(self.target_modules) & set(self.modules_to_save)
        if overlap:
            raise ValueError(f"peft.modules_to_save={list(self.modules_to_save)}: {sorted(overlap)[0]!r} is "
                             f"also in peft.target_modules; a module gets adapters or is trained whole")

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


class LoraLinear(nn.Linear):
    """A frozen ``nn.Linear`` plus a trainable low-rank update (PEFT's ``lora.Linear``, one adapter).

    It stays an ``nn.Linear`` (same ``weight``/``bias`` parameters, moved over from the base), so
    code that reads ``module.weight`` or checks ``isinstance(m, nn.Linear)`` sees the base layer.
    """

    def __init__(self, base: nn.Linear, *, r: int, alpha: float, dropout: float) -> None:
        nn.Module.__init__(self)  # nn.Linear.__init__ would allocate a second weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(self.in_features, r, bias=False, **factory)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, **factory)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.r, self.scaling = r, alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def base(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen layer's output (QLoRA's subclass dequantizes its NF4 weight here: models/qlora.py)."""
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.r}, scaling={self.scaling:g}"


def is_adapter(name: str) -> bool:
    """Whether a parameter name (ours or HF's) is a LoRA adapter matrix."""
    return any(mark in name for mark in ADAPTER_MARK)


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _targets(model: nn.Module, names: Iterable[str]) -> Iterator[tuple[nn.Module, str, nn.Linear]]:
    wanted = set(names)
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if child_name in wanted and type(child) is nn.Linear:
                yield parent, f"{parent_name}.{child_name}".lstrip("."), child


def apply_lora(model: nn.Module, *, r: int, alpha: float, dropout: float = 0.0,
               target_modules: Iterable[str] = LORA_TARGETS, modules_to_save: Iterable[str] = (),
               seed: int | None = 0) -> list[str]:
    """Freeze ``model`` and add adapters to its ``target_modules`` projections, in place.

    Apply it to a plain model, before tensor parallelism, activation checkpointing and ZeRO.
    ``seed``: the adapters are initialized now (PEFT's init) unless the model is on the meta device
    (then call :func:`init_adapters` after materializing); None leaves them uninitialized.
    Returns the names of the trainable parameters.
    """
    settings = LoraConfig(r=r, alpha=alpha, dropout=dropout, target_modules=tuple(target_modules),
                            modules_to_save=tuple(modules_to_save))
    replaced = 0
    for parent, _, child in _targets(model, settings.target_modules):
        child.weight.requires_grad_(False)
        lora = LoraLinear(child, r=settings.r, alpha=settings.alpha, dropout=settings.dropout)
        setattr(parent, _name_in(parent, child), lora)
        replaced += 1
    if not replaced:
        raise ValueError(f"peft.target_modules={list(settings.target_modules)}: no nn.Linear of that name in "
                         f"the model")
    keep = set(settings.modules_to_save)
    trainable_modules = {m for n, m in model.named_modules() if _leaf(n) in keep}
    adapters = _adapter_linears(model)
    for module in model.modules():  # a module to save trains whole, its submodules included
        if module in trainable_modules:
            continue
        for p in module.parameters(recurse=False):
            p.requires_grad_(module in adapters)
    for module in trainable_modules:
        module.requires_grad_(True)
    on_meta = any(p.is_meta for p in model.parameters())
    if seed is not None and not on_meta:
        init_adapters(model, seed=seed)
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _name_in(parent: nn.Module, child: nn.Module) -> str:
    return next(n for n, c in parent.named_children() if c is child)


def _adapter_linears(model: nn.Module) -> set[nn.Module]:
    return {m for lora in model.modules() if isinstance(lora, LoraLinear) for m in (lora.lora_A, lora.lora_B)}


def adapter_names(model: nn.Module) -> list[str]:
    """Names of the LoRA matrices of ``model`` (``...lora_A.weight``, ``...lora_B.weight``)."""
    return [n for n, _ in model.named_parameters() if is_adapter(n)]


@torch.no_grad()
def init_adapters(model: nn.Module, *, seed: int = 0) -> None:
    """PEFT's init, seeded: ``A`` ~ U(-1/sqrt(in), 1/sqrt(in)), ``B`` = 0 (works on ZeRO-3 shards)."""
    g = torch.Generator().manual_seed(seed + 7919)  # apart from the base init's stream
    for name, p in model.named_parameters():
        if ".lora_A." in name:
            bound = 1.0 / math.sqrt(p.shape[1])
            copy_global(p, (torch.rand(p.shape, generator=g) * 2 - 1) * bound)
        elif ".lora_B." in name:
            copy_global(p, torch.zeros(p.shape))


def peft_key(name: str) -> str:
    """Our parameter name -> its key in PEFT's ``adapter_model.safetensors`` for a HF causal LM."""
    name = name.replace("_checkpoint_wrapped_module.", "")
    hf = name if name.startswith("lm_head.") else "model." + name
    return "base_model.model." + hf


def check_lora_parallel(lora: LoraConfig, *, tp: int) -> None:
    """Before start: the LoRA settings a pipeline / tensor-parallel layout cannot run (ValueError naming
    the key).  Adapters split with their base layer (``LORA_COLWISE``/``LORA_ROWWISE``), so every rank,
    target and module to save works wherever the base model's layout does; what is left is dropout
    under tp: a replicated activation would need one dropout mask drawn alike on every tp rank (and a
    sharded one slices of one mask), which DTensor's RNG tracker gives on CUDA only, not on this path."""
    if tp > 1 and lora.dropout > 0:
        raise ValueError(f"peft.dropout={lora.dropout} with parallel.tp={tp}: LoRA dropout on tensor-parallel "
                         f"activations needs one mask drawn alike on every tp rank, which is not built; set "
                         f"peft.dropout=0 (or parallel.tp=1; pipeline stages, parallel.pp, take any dropout)")


def lora_settings(c: dict | None) -> LoraConfig | None:
    """``peft.*`` of a composed config -> LoraConfig (None without ``+peft=lora``)."""
    if not c or c["name"] == "none":
        return None
    if c["name"] != "lora":
        raise ValueError(f"peft.name={c['name']!r}: valid values are ['lora'] (or leave +peft out)")
    lora = LoraConfig(r=c["r"], alpha=float(c["alpha"]), dropout=float(c["dropout"]),
                        target_modules=tuple(c["target_modules"]), modules_to_save=tuple(c["modules_to_save"]),
                        init_from=c["init_from"], base_quant=c.get("base_quant", "none"))
    return lora


def count_lora_params(model: nn.Module, lora: LoraConfig) -> int:
    """Trainable parameters of ``model`` (a plain, e.g. meta-device, model of any family) under ``lora``: r x (in + out)
    per targeted projection, plus every parameter of the modules to save."""
    n = 0
    for _, _, child in _targets(model, lora.target_modules):
        n += lora.r * (child.in_features + child.out_features)
    keep = set(lora.modules_to_save)
    seen: set[int] = set()
    for name, module in model.named_modules():
        if _leaf(name) in keep:
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    n += p.numel()
    return n
