"""Shared by the model-family tests: tiny random configs made by transformers' own config classes
(fp32), the reference models built by transformers' own classes, and chat-like masked rows.

Each family's case turns on what random small inputs would hide: Qwen2's q/k/v biases (made
non-zero), Qwen3's q/k norms (weights away from 1) with a head_dim that is not hidden/heads, Mistral
with rows longer than its sliding window, Llama 3.1's rope_type=llama3 with tied embeddings, Phi-3
with fused qkv/gate_up, Phi-4-mini's partial rotary and longrope (every row longer than
original_max_position_embeddings: the long factors) and a sliding window, Gemma 3
(see ``GEMMA3``).
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB, SEQ, ROWS = 128, 24, 4
WINDOW = 6  # Mistral's sliding window: every row is longer
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
FAMILIES = ("qwen2", "qwen3", "mistral", "llama", "phi3", "gemma3")
PHI3_ORIGINAL = 16  # Phi-3's original_max_position_embeddings: SEQ rows use the long factors, shorter ones the short
# Gemma 3: a sliding and a global layer (rows longer than the window), their own RoPE bases (the global
# one linearly scaled), q/k norms, query_pre_attn_scalar != head_dim, the final logits soft-capped
GEMMA3 = dict(head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
              query_pre_attn_scalar=12, final_logit_softcapping=5.0,
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}})


GEMMA2 = dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=12, attn_logit_softcapping=3.0,
              final_logit_softcapping=2.0)


def hf_config(family: str, **overrides):
    """transformers' own config class for ``family``'s tiny case."""
    import transformers as tf

    kw = {**COMMON, **overrides}
    if family == "qwen2":
        return tf.Qwen2Config(**kw, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if family == "qwen3":
        return tf.Qwen3Config(**{"head_dim": 16, **kw})  # 16 != 32 / 4: its own head_dim
    if family == "mistral":
        return tf.MistralConfig(**{"sliding_window": WINDOW, **kw})
    if family == "phi3":  # head_dim 8, rotary 6 (0.75, as Phi-4-mini): 3 factors per set
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.5, 2.5], "long_factor": [1.3, 4.0, 9.0],
                "original_max_position_embeddings": PHI3_ORIGINAL}
        return tf.Phi3Config(**{"sliding_window": 2 * WINDOW, **kw}, rope_parameters=rope,
                             original_max_position_embeddings=PHI3_ORIGINAL)
    if family == "gemma3":
        return tf.Gemma3TextConfig(**{**GEMMA3, **kw})
    if family == "gemma2":  # sliding every other layer, attention scores and final logits soft-capped
        return tf.Gemma2Config(**{**GEMMA2, **kw})
    assert family == "llama"
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    return tf.LlamaConfig(**{"tie_word_embeddings": True, **kw}, rope_parameters=rope)


def hf_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """transformers' own model of the case, seeded, fp32, with every bias and norm weight moved off
    its init (zero / one) so that a missing or misplaced one shows."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, **overrides), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def save_hf(family: str, path: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    """The case saved by transformers' own ``save_pretrained`` (safetensors); returns the model."""
    model = hf_model(family, seed, **overrides)
    model.save_pretrained(str(path))
    return model


def chat_rows(num_steps: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[steps, ROWS, SEQ] input ids and aligned labels (labels[t]: the token after t) shaped like chat
    data: a prompt whose labels are -100, an answer, then padding (-100); one row fully masked."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (num_steps, ROWS, SEQ + 1), generator=g)
    labels = ids[..., 1:].clone()
    for step in range(num_steps):
        for row in range(ROWS):
            prompt = int(torch.randint(2, 8, (), generator=g))
            length = int(torch.randint(prompt + 4, SEQ + 1, (), generator=g))
            ids[step, row, length:] = 0
            labels[step, row, :prompt] = -100
            labels[step, row, length - 1:] = -100
    labels[0, ROWS - 1] = -100  # a row with nothing to learn
    return ids[..., :-1].contiguous(), labels


def reference_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed token loss over labels != -100 divided by their count, in plain torch."""
    valid = labels != -100
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -(picked * valid).sum() / valid.sum()
