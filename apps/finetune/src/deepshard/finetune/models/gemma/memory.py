"""Gemma's activation memory (its spec's ``activation_memory``): the Llama block's count (the same
projections, a gated MLP of the same shape, q/k norms on Gemma 3) with what Gemma keeps beyond it."""

from __future__ import annotations

from deepshard.core.memory import DTYPE_BYTES as BYTES
from deepshard.finetune.models.gemma.model import FULL, GemmaConfig
from deepshard.finetune.models.llama.memory import activation_memory as llama_activation_memory
from deepshard.finetune.models.working_set import RunShape


def extra_per_block(cfg: GemmaConfig, s: RunShape) -> int:
    """Saved beyond a Llama block: the post-attention and post-MLP norms' inputs and outputs (4 x dim
    per token), and with soft-capped scores the math path's scores, capped scores and fp32
    probabilities ([heads, seq, seq] each, heads / sp under Ulysses) for the rank's rows."""
    tokens = s.micro_batch_size * s.seq_len
    extra = 4 * tokens * BYTES[s.dtype] * cfg.dim
    if cfg.attn_softcap:
        seq = s.seq_len * max(s.sp, 1)
        extra += (2 * BYTES[s.dtype] + 4) * s.micro_batch_size * (cfg.n_heads // max(s.sp, 1)) * seq * seq
    return extra


def activation_memory(cfg: GemmaConfig, s: RunShape) -> tuple[int, int, int]:
    """Llama's (device, host, transient) for ``cfg`` (its window's dense band counted on every block;
    without ``ac`` the global layers' taken off again), plus :func:`extra_per_block` for every block
    whose activations are kept and for the one recomputed block under ``ac``."""
    device, host, transient = llama_activation_memory(cfg, s)
    seq = s.seq_len * max(s.sp, 1)
    extra = extra_per_block(cfg, s)
    if s.ac == "none":
        band = seq * seq * BYTES[s.dtype] if 0 < cfg.sliding_window < seq else 0
        return device - band * cfg.layer_types.count(FULL) + cfg.n_layers * extra, host, transient
    every = int(s.ac.split("_")[1]) if s.ac.startswith("every_") else 1
    kept = cfg.n_layers - cfg.n_layers // every + 1  # blocks never recomputed, and the one being recomputed
    return device + kept * extra, host, transient + extra
