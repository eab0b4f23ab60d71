"""The Llama family's activation memory (its spec's ``activation_memory``): what one micro-batch's
forward keeps for backward through a Llama block, under each ``ac`` mode, as ``models/working_set.py``
adds it to a rank's working set."""

from __future__ import annotations

from deepshard.core.memory import DTYPE_BYTES as BYTES
from deepshard.finetune.models.llama.model import LlamaConfig
from deepshard.finetune.models.working_set import RunShape


def _block(cfg: LlamaConfig, s: RunShape, tokens: int) -> tuple[int, int]:
    """(saved, backward transient) of one block for a rank's ``tokens``.  Saved: the block input and
    norms, the rotated q/k, v, attention's output and log-sum-exp per head (under sp attention runs on
    whole sequences for heads/sp heads: the same bytes per rank, kv heads repeated up to sp), the MLP's
    input and SwiGLU's gate/silu/up/product.  Under ``mlp_tiles`` the MLP keeps only its input, and one
    tile's intermediates exist in backward (the transient); untiled, the MLP's backward adds about one
    [tokens, ffn_hidden] gradient.  Measured on CPU by bench/bench_long_context.py (tests/sp/test_sp_estimate.py).
    Switches: q/k norms (Qwen3) keep their input and normalized heads; a sliding window shorter than the
    sequence (Mistral, Phi-3) keeps a dense [seq, seq] mask per block: SDPA turns the bool band into an
    additive mask of the compute dtype and saves that for backward (the bool one is freed).  Partial
    rotary (Phi-4-mini) and longrope keep nothing more (the pass-through part is concatenated back into
    the one q and k that attention saves); Phi-3's fused qkv/gate_up exist only in its checkpoints."""
    b = BYTES[s.dtype]
    kv = max(cfg.n_kv_heads, s.sp if s.sp > 1 else 1) * cfg.head_dim
    q = cfg.n_heads * cfg.head_dim  # the block input and its norms 4 x dim; q before/after RoPE, out, o's input
    attn = tokens * b * (4 * cfg.dim + 4 * q + 3 * kv) + tokens * 4 * cfg.n_heads
    if cfg.qk_norm:
        attn += 2 * tokens * b * (q + kv)
    seq = s.seq_len * max(s.sp, 1)
    if 0 < cfg.sliding_window < seq:
        attn += seq * seq * b
    tiles = max(1, min(s.mlp_tiles, tokens))
    if tiles == 1:
        return attn + tokens * b * (cfg.dim + 4 * cfg.ffn_hidden), tokens * b * cfg.ffn_hidden
    return attn + tokens * b * cfg.dim, 4 * -(-tokens // tiles) * b * cfg.ffn_hidden


def activation_memory(cfg: LlamaConfig, s: RunShape) -> tuple[int, int, int]:
    """Activations of one micro-batch on one rank (``micro_batch_size x seq_len`` tokens, seq_len being
    the rank's slice under sp) as (device, host, transient): every block's saved tensors (``_block``),
    or with ``ac`` only the checkpointed blocks' inputs (the host's under ``ac_offload``, one streamed
    back at a time), and the final norm's; plus the backward transient (under ``ac`` one block
    recomputed), which the loss's logits block never meets (the loss is done before backward reaches
    the blocks)."""
    b = BYTES[s.dtype]
    tokens = s.micro_batch_size * s.seq_len
    saved, transient = _block(cfg, s, tokens)
    if s.ac == "none":
        return cfg.n_layers * saved + 3 * tokens * b * cfg.dim + transient, 0, transient
    every = int(s.ac.split("_")[1]) if s.ac.startswith("every_") else 1  # full is every_1
    recomputed = cfg.n_layers // every
    inputs = recomputed * tokens * b * cfg.dim  # the embedding's output is the first block's input
    kept = (cfg.n_layers - recomputed) * saved + 2 * tokens * b * cfg.dim + saved + transient
    if s.ac_offload:
        return kept + tokens * b * cfg.dim, inputs, saved + transient
    return kept + inputs, 0, saved + transient
