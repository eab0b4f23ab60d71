"""The transformers path's recipe: Ulysses (ulysses.py) when sp > 1, then core's one order (TP -> AC ->
precision -> ZeRO) on the blocks that the model's ``_no_split_modules`` names, and a TP plan
translated from the config's own ``base_model_tp_plan`` (transformers' style names -> DTensor styles).

Translated styles: ``colwise``, ``rowwise``, ``colwise_gather_output`` (its output all-gathered),
``rowwise_split_input`` (a replicated input sliced), ``embedding_rowwise`` (the vocabulary split, the
output summed); the head is column-parallel with its logits gathered, so the plain cross-entropy is
exact.  Every other module with parameters is replicated (a Replicate DTensor: clipping counts it
once).  LoRA's adapters split with their base layer as on the native families.  A plan with another
style, tied embeddings, or heads that tp does not split evenly are refused before start.
"""

from __future__ import annotations

from fnmatch import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

from deepshard.core.config import ZeroConfig
from deepshard.core.mesh import axis_size
from deepshard.core.parallelize import ShardedPart, parallelize_model
from deepshard.core.tensor_parallel import ColwiseWithChildren, ReplicateParallel, RowwiseWithChildren
from deepshard.core.zero import ParamOffload
from deepshard.finetune.models.lora import LORA_COLWISE, LORA_ROWWISE
from deepshard.finetune.models.transformers_path.model import TransformersConfig, TransformersLM
from deepshard.finetune.models.transformers_path.ulysses import apply_sequence_parallel

STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "embedding_rowwise")


def _style(name: str) -> ParallelStyle:
    if name == "colwise":
        return ColwiseWithChildren(children=LORA_COLWISE)
    if name == "colwise_gather_output":
        return ColwiseWithChildren(children=LORA_COLWISE, output_layouts=Replicate())
    if name == "rowwise":
        return RowwiseWithChildren(children=LORA_ROWWISE)
    if name == "rowwise_split_input":
        return RowwiseWithChildren(children=LORA_ROWWISE, input_layouts=Replicate())
    assert name == "embedding_rowwise", name
    return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())


def _plan_of(cfg: TransformersConfig) -> dict[str, str]:
    return dict(cfg.hf_dict.get("base_model_tp_plan") or _class_plan(cfg))


def _class_plan(cfg: TransformersConfig) -> dict[str, str]:
    from deepshard.finetune.models.transformers_path.model import hf_config_object

    return dict(getattr(hf_config_object(cfg), "base_model_tp_plan", None) or {})


def check_tp(cfg: TransformersConfig, tp: int) -> None:
    """ValueError, before start, unless ``tp`` can split this model by its config's own plan."""
    if tp <= 1:
        return
    plan = _plan_of(cfg)
    if not plan:
        raise ValueError(f"parallel.tp={tp}: {cfg.arch} (the transformers path) has no base_model_tp_plan in "
                         f"its config, so there is no tensor-parallel layout for it; use parallel.tp=1")
    bad = sorted({s for s in plan.values() if s not in STYLES})
    if bad:
        raise ValueError(f"parallel.tp={tp}: {cfg.arch}'s base_model_tp_plan uses {bad}, which the transformers "
                         f"path does not translate (it takes {list(STYLES)}); use parallel.tp=1")
    if cfg.tie_embeddings:
        raise ValueError(f"parallel.tp={tp}: {cfg.arch} ties its head to its embedding (tie_word_embeddings), "
                         f"which split on different axes; use parallel.tp=1")
    c = cfg.hf_dict
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = c.get(key)
        if isinstance(value, int) and value % tp:
            raise ValueError(f"parallel.tp={tp} does not divide {key}={value} of {cfg.arch}; choose tp among "
                             f"its divisors")


def tp_plan(model: TransformersLM) -> dict[str, ParallelStyle]:
    """FQN pattern -> style: the config's plan under the base model, the head gathered, the rest replicated."""
    base = f"hf.{model.hf.base_model_prefix}."
    plan: dict[str, ParallelStyle] = {base + k: _style(v) for k, v in _plan_of(model.cfg).items()}
    head = model.hf.get_output_embeddings()
    head_name = next(n for n, m in model.named_modules() if m is head)
    plan[head_name] = _style("colwise_gather_output")
    covered = list(plan)
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if own and not any(fnmatch(name, p) or name.startswith(_prefix(p)) for p in covered):
            plan[name] = ReplicateParallel()
    return plan


def _prefix(pattern: str) -> str:
    return pattern + "." if "*" not in pattern else "\0"  # a styled module's children (LoRA's) are its own


def check_layout(cfg: TransformersConfig, *, pp: int = 1, sp: int = 1, tp: int = 1) -> None:
    """The layouts this path does not build, refused with the reason (before any worker starts)."""
    from deepshard.finetune.models.transformers_path.model import causal_lm_class
    from deepshard.finetune.models.transformers_path.pipeline import check_pipeline
    from deepshard.finetune.models.transformers_path.ulysses import check_sp

    check_pipeline(cfg, pp=pp, tp=tp)
    check_sp(cfg, causal_lm_class(cfg.arch), sp=sp, tp=tp)


def parallelize_transformers(model: nn.Module, mesh: DeviceMesh, *, zero: ZeroConfig, dtype: str = "fp32",
                             ac: str = "none", offload_params: ParamOffload | None = None,
                             ac_offload: bool = False, compile: bool = False) -> ShardedPart:
    """Core's recipe on a :class:`TransformersLM`: TP by its config's plan, AC, compile and ZeRO-3 units on
    its ``_no_split_modules`` blocks, then the root; in place."""
    assert isinstance(model, TransformersLM), type(model)
    tp = axis_size(mesh, "tp")
    check_layout(model.cfg, sp=axis_size(mesh, "sp"), tp=tp)  # pp: its stages take pipeline.py's recipe
    check_tp(model.cfg, tp)
    if axis_size(mesh, "sp") > 1:  # Ulysses through transformers' attention interface, before ZeRO wraps
        apply_sequence_parallel(model, mesh["sp"])
    return parallelize_model(model, mesh, zero=zero, dtype=dtype, ac=ac, blocks=model.blocks,
                             tp_plan=tp_plan(model) if tp > 1 else None, offload_params=offload_params,
                             ac_offload=ac_offload, compile=compile)

