"""A tiny Llama written by transformers' own save_pretrained, with our embedded tokenizer beside it."""

from __future__ import annotations

from pathlib import Path

import torch


def save_tiny_hf_llama(path: Path, *, vocab_size: int = 2048, tie: bool = False) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from deepshard.finetune.data.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tie,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # HF initializes norms to 1; perturb them so a name mix-up would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
