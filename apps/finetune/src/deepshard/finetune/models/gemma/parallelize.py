"""Gemma's layouts: Llama's recipe (TP -> AC -> precision -> ZeRO) with Gemma's TP plan, and what
it refuses before start.

TP plan: Llama's (q/k/v and gate/up column-parallel, o/down row-parallel with LoRA split alike,
norms replicated, Gemma 3's q/k norms on each rank's heads, the embedding vocabulary-sharded) plus
Gemma's two more norms per block.  The head is the tied embedding's vocabulary shard: each rank
computes its columns of the logits, soft-caps them and all-gathers them (``Gemma._logits``), so the
tie holds under TP.  PP runs at pp=2 as Llama's with a tied head (the last stage holds its own copy of
the embedding as ``lm_head``, their gradients summed each step: ``deepshard.pipeline.tied``); sp
(Ulysses) runs as Llama's does, the attention taking whole sequences for its heads.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from deepshard.finetune.models.gemma.model import GemmaConfig


def check_tp(cfg: GemmaConfig, tp: int) -> None:
    """Llama's checks (whole heads, kv heads, hidden units per rank), and the vocabulary split evenly
    (the tied head's logits are all-gathered in equal shards)."""
    from deepshard.finetune.models.llama.parallelize import check_tp as llama_check_tp

    llama_check_tp(cfg, tp)
    if cfg.vocab_size % tp:
        raise ValueError(f"parallel.tp={tp} does not divide model.vocab_size={cfg.vocab_size}: the tied "
                         f"embedding and head are split by vocabulary rows; choose tp among its divisors")


def check_parallel(cfg: GemmaConfig, *, pp: int = 1, tp: int = 1, sp: int = 1, lora: Any = None) -> None:
    """Before start: pp=2 runs (the tied head a copy on the last stage, ``pipeline_gemma``); larger pp,
    and pp with tp, are refused with the reason."""
    from deepshard.pipeline.tied import check_tied_pp

    check_tied_pp(pp, what="Gemma ties its head to its embedding")
    if pp > 1 and tp > 1:
        raise ValueError(f"parallel.pp={pp} with parallel.tp={tp}: Gemma's stages are not tensor-parallel "
                         f"(untested: the last stage's copy of the tied head would need the embedding's "
                         f"vocabulary split); use parallel.tp=1 with pp")


def gemma_tp_plan(model: nn.Module) -> dict[str, Any]:
    """Llama's plan for what Gemma shares with it, and Gemma's pre/post feed-forward norms."""
    from deepshard.core.tensor_parallel import ReplicateParallel
    from deepshard.finetune.models.llama.parallelize import llama_tp_plan

    return {**llama_tp_plan(model), "layers.*.pre_feedforward_layernorm": ReplicateParallel(),
            "layers.*.post_feedforward_layernorm": ReplicateParallel()}


def parallelize_gemma(model: nn.Module, mesh: Any, **kwargs: Any) -> Any:
    """The family's recipe: Llama's, with :func:`gemma_tp_plan` (vocabulary tiling never applies:
    the head is tied)."""
    from deepshard.finetune.models.llama.parallelize import parallelize_llama

    check_tp(model.cfg, mesh["tp"].size())
    return parallelize_llama(model, mesh, tp_plan=gemma_tp_plan, **kwargs)


def pipeline_gemma(model: nn.Module, mesh: Any, config: Any, **kwargs: Any) -> Any:
    """Llama's pipeline with Gemma's plan: the tied head named ``lm_head`` first, so the split gives the
    last stage its own copy of the embedding (the embedding's scale stays on the first stage, the final
    norm and the soft-capped head on the last: ``Gemma.forward``)."""
    from deepshard.finetune.models.gemma.model import add_head_module
    from deepshard.finetune.models.llama.parallelize import pipeline_llama

    check_parallel(model.cfg, pp=mesh["pp"].size(), tp=mesh["tp"].size())
    add_head_module(model)
    return pipeline_llama(model, mesh, config, tp_plan=gemma_tp_plan, **kwargs)


def gemma_stage_init(seed: int = 0, **kwargs: Any) -> Any:
    """Llama's stage init on Gemma, whose full model names its tied head as ``pipeline_gemma`` did."""
    from deepshard.finetune.models.gemma.model import add_head_module
    from deepshard.finetune.models.llama.parallelize import llama_stage_init

    return llama_stage_init(seed, prepare=add_head_module, **kwargs)
