"""The Llama decoder with sparse MoE blocks (``models/moe.py``) in place of its MLPs: Qwen3-MoE,
Qwen2-MoE and Mixtral (``models/qwen3_moe``, ``models/qwen2_moe``, ``models/mixtral``) are this model
with their config's switches.

A layer is sparse unless it is in ``mlp_only_layers`` or ``(layer + 1) % decoder_sparse_step`` is not
0 (transformers' rule); a dense layer keeps the Llama MLP with ``ffn_hidden``.  At ``parallel.ep=1``
every rank holds every expert and ZeRO shards the stacked expert weights over dp like any other
parameter; with ``parallel.ep=N`` each rank keeps ``num_experts / N`` of them, tokens reach them by
all-to-all (``models/moe_ep.py``) and ZeRO shards them over the dp ranks left after ep.  What the
layouts cannot run yet is refused before start (:func:`check_parallel`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deepshard.finetune.models.llama.model import Llama, LlamaConfig
from deepshard.finetune.models.moe import IMPLS, ROUTINGS, CapacityConfig, RouterStats, SparseMoe
from deepshard.finetune.models.moe_ep import apply_ep
from deepshard.finetune.models.moe_hf import check_moe_dir, load_moe_weights
from deepshard.finetune.models.registry import HFAdapter, ModelSpec, register

MLP_PROJS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class MoeConfig(LlamaConfig):
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_hidden: int = 256  # each expert's FFN width (HF's moe_intermediate_size / Mixtral's intermediate_size)
    norm_topk_prob: bool = True
    routing: str = "softmax_topk"  # softmax_topk (Qwen3-MoE) | topk_softmax (Mixtral)
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    moe_impl: str = "grouped"  # grouped (one torch._grouped_mm per projection) | loop (per-expert reference)
    # DeepSpeed's token dropping (models/moe.py's CapacityConfig): off (dropless) unless drop_tokens
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    drop_tokens: bool = False
    router_z_loss_coef: float = 0.0  # ST-MoE's router z-loss, added to the step's loss (0: off)
    shared_expert_hidden: int = 0  # Qwen2-MoE's shared expert width (0: none)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if self.routing not in ROUTINGS:
            raise ValueError(f"model.routing={self.routing!r}: valid values are {list(ROUTINGS)}")
        if self.moe_impl not in IMPLS:
            raise ValueError(f"model.moe_impl={self.moe_impl!r}: valid values are {list(IMPLS)}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"model.num_experts_per_tok={self.num_experts_per_tok}: must be in 1.."
                             f"model.num_experts={self.num_experts}")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"model.decoder_sparse_step={self.decoder_sparse_step}: must be >= 1")
        if self.router_z_loss_coef < 0:
            raise ValueError(f"model.router_z_loss_coef={self.router_z_loss_coef}: must be >= 0")
        self.capacity_config()  # its own checks, by key
        if self.mlp_tiles > 1:
            raise ValueError(f"model.mlp_tiles={self.mlp_tiles}: tiling the MoE blocks is not built; use 1")

    def capacity_config(self) -> CapacityConfig:
        return CapacityConfig(capacity_factor=self.capacity_factor, eval_capacity_factor=self.eval_capacity_factor,
                              min_capacity=self.min_capacity, drop_tokens=self.drop_tokens)

    def sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


class MoeDecoder(Llama):
    """:class:`Llama` whose sparse layers' ``mlp`` is a :class:`SparseMoe`; ``forward`` takes an optional
    ``attention_mask`` [batch, seq] (1 = real token) that only narrows the load-balancing statistics."""

    def __init__(self, cfg: MoeConfig) -> None:
        super().__init__(cfg)
        sparse = [i for i in range(cfg.n_layers) if cfg.sparse(i)]
        self.router_stats = RouterStats(coef=cfg.router_aux_loss_coef, z_coef=cfg.router_z_loss_coef,
                                        last_layer=sparse[-1] if sparse else -1)
        for i in sparse:
            self.layers[i].mlp = SparseMoe(cfg.dim, cfg.moe_hidden, cfg.num_experts, cfg.num_experts_per_tok,
                                           routing=cfg.routing, norm_topk_prob=cfg.norm_topk_prob,
                                           impl=cfg.moe_impl, layer_id=i, stats=self.router_stats,
                                           capacity=cfg.capacity_config(), shared_hidden=cfg.shared_expert_hidden)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,  # type: ignore[override]
                doc_ids: torch.Tensor | None = None, reduction: str = "mean",
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        self.router_stats.mask = None if attention_mask is None else attention_mask.reshape(-1).float()
        return super().forward(input_ids, labels, doc_ids=doc_ids, reduction=reduction)


def check_parallel(cfg: MoeConfig, *, pp: int = 1, tp: int = 1, sp: int = 1, lora: Any = None,
                   ep: int = 1) -> None:
    """Before start: the layouts the MoE families do not run yet, each refused naming its key."""
    if ep > 1 and cfg.num_experts % ep:
        raise ValueError(f"parallel.ep={ep} does not divide model.num_experts={cfg.num_experts}: each rank holds "
                         f"num_experts / ep experts; choose ep among its divisors")
    for key, value in (("parallel.tp", tp), ("parallel.pp", pp), ("parallel.sp", sp)):
        if value > 1:
            raise ValueError(f"{key}={value}: not built for MoE models yet (the experts are neither split nor "
                             f"staged, issue 40); use {key}=1 and parallel.dp/ZeRO")
    targets = set(getattr(lora, "target_modules", ()) or ())
    if lora is not None and targets & set(MLP_PROJS):
        raise ValueError(f"peft.target_modules={sorted(targets)}: LoRA on MoE experts is not built; target the "
                         f"attention (q_proj, k_proj, v_proj, o_proj) only")


def _check_tp(cfg: MoeConfig, tp: int) -> None:
    check_parallel(cfg, tp=tp)


def _parallelize(model: nn.Module, mesh: Any, **kwargs: Any) -> Any:
    from deepshard.core.mesh import axis_size
    from deepshard.finetune.models.llama.parallelize import parallelize_llama

    ep = axis_size(mesh, "ep")
    check_parallel(model.cfg, tp=axis_size(mesh, "tp"), sp=axis_size(mesh, "sp"), pp=axis_size(mesh, "pp"), ep=ep)
    experts = apply_ep(model, mesh["ep"]) if ep > 1 else []
    return parallelize_llama(model, mesh, experts=experts, **kwargs)


_NO_PP = "parallel.pp: pipeline stages are not built for MoE models yet (issue 40); use parallel.pp=1"


def _pipeline(model: nn.Module, mesh: Any, config: Any, **kwargs: Any) -> Any:
    raise ValueError(_NO_PP)


def _stage_init(seed: int = 0, **kwargs: Any) -> Any:
    raise ValueError(_NO_PP)


def moe_spec(name: str, config: type, hf: HFAdapter) -> ModelSpec:
    """Register the MoE family ``name``: :class:`MoeDecoder` built from ``config``, Llama's recipe at
    tp=sp=pp=1 (refused otherwise), read and written by ``hf`` (its loaders: ``models/moe_hf.py``)."""
    from deepshard.finetune.models.moe_memory import activation_memory

    hf = dataclasses.replace(hf, load_weights=load_moe_weights, check_dir=check_moe_dir)
    return register(ModelSpec(name=name, config=config, build=MoeDecoder, parallelize=_parallelize,
                              pipeline=_pipeline, stage_init=_stage_init, check_tp=_check_tp, hf=hf,
                              activation_memory=activation_memory, check_parallel=check_parallel))
