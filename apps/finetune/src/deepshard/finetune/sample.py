"""A greedy sample from the trained model at the end of a run, shown in the log.

Every rank runs the same forward passes (under ZeRO-3 each forward all-gathers parameters, a
collective), and rank 0's token is broadcast each step so all ranks extend the same text.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


@torch.no_grad()
def greedy_sample(model: torch.nn.Module, tokenizer, prompt: str, *, num_tokens: int, max_seq_len: int,
                  device: torch.device) -> str:
    """``num_tokens`` greedy tokens after ``prompt`` (stops early at eos); returns the continuation."""
    ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"]) or [tokenizer.eos_token_id]
    start = len(ids)
    was_training = model.training
    model.eval()
    for _ in range(num_tokens):
        logits = model(torch.tensor([ids[-max_seq_len:]], device=device))
        if hasattr(logits, "full_tensor"):  # a DTensor (tensor-parallel head)
            logits = logits.full_tensor()
        token = logits[0, -1].float().argmax().reshape(1)
        if dist.is_initialized():
            dist.broadcast(token, src=0)
        ids.append(int(token))
        if ids[-1] == tokenizer.eos_token_id:
            break
    model.train(was_training)
    return tokenizer.decode(ids[start:], skip_special_tokens=True)
