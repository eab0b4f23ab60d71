"""The tiny model, data and ds_config of the DeepSpeed checkpoint fixtures (bench/make_ds_checkpoints.py),
shared by the script that made them and the tests that resume them."""

from __future__ import annotations

import torch

MICRO = 2  # rows per rank per step at world 2; the global batch is 4 rows
SEQ = 12
VOCAB = 64
SAVE_STEP = 3
TOTAL_STEPS = 6


def tiny_model(seed: int = 0, tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      tie_word_embeddings=tied, attn_implementation="eager")
    return LlamaForCausalLM(cfg)


def global_batch(step: int, rows: int = 2 * MICRO) -> torch.Tensor:
    """Step ``step``'s global batch; rank r of a world-W run takes rows [r*rows/W, (r+1)*rows/W)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(VOCAB, (rows, SEQ), generator=g)


def param_groups(model) -> list[dict]:
    """Weight decay on matrices only, as deepshard's AdamW does (two groups for DeepSpeed)."""
    return [{"params": [p for p in model.parameters() if p.dim() >= 2]},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def ds_config(stage: int, world: int = 2) -> dict:
    return {
        "train_batch_size": 2 * MICRO, "train_micro_batch_size_per_gpu": 2 * MICRO // world,
        "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                          "warmup_num_steps": 2, "warmup_type": "linear",
                                                          "total_num_steps": 10}},
        "zero_optimization": {"stage": stage},
    }


def train_steps(engine, steps: range, rank: int, world: int) -> list[float]:
    """DeepSpeed's loop (ours through the compat layer, or DeepSpeed's own engine) over this rank's rows
    of each global batch; the global mean loss per step."""
    rows = 2 * MICRO // world
    out = []
    for step in steps:
        tokens = global_batch(step)[rank * rows:(rank + 1) * rows].to(engine.device)
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        out.append(mean.item() / world)
    return out
