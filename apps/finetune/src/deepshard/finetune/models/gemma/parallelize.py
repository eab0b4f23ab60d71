"""Gemma's layouts: Llama's recipe (TP -> AC -> precision -> ZeRO) with Gemma's TP plan, and what
it refuses before start.

TP plan: Llama's (q/k/v and gate/up column-parallel, o/down row-parallel with LoRA split alike,
norms replicated, Gemma 3's q/k norms on each rank's heads, the embedding vocabulary-sharded) plus
Gemma's two more norms per block.  The head is the tied embedding's vocabulary shard: each rank
computes its columns of the logits, soft-caps them and all-gathers them (``Gemma._logits``), so the
tie holds under TP.  PP is refused (the tied embedding and head would sit on different stages); sp
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
    """Before start: pipeline parallelism is refused, with the reason."""
    if pp > 1:
        raise ValueError(f"parallel.pp={pp}: Gemma's head is its embedding (tied), which would sit on the first and "
                         "the last stage at once; use parallel.pp=1 (ZeRO, tp and sp run Gemma)")


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
