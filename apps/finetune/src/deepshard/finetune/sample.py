"""A greedy sample from the trained model at the end of a run, shown in the log.

Every rank runs the same forward passes (under ZeRO-3 each forward all-gathers parameters, a
collective), and rank 0's token is broadcast each step so all ranks extend the same text.
With ``chat_template`` (``data=chat``) the prompt is a user turn rendered by the template with
its generation prompt, so the model continues as the assistant it was trained to be, and stops
at the end of its turn (eos, or the template's end-of-turn token such as ``<|im_end|>``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


@torch.no_grad()
def greedy_sample(model: torch.nn.Module, tokenizer, prompt: str, *, num_tokens: int, max_seq_len: int,
                  device: torch.device, chat_template: str | None = None) -> str:
    """``num_tokens`` greedy tokens after ``prompt`` (stops early at eos); returns the continuation."""
    stop = {tokenizer.eos_token_id}
    if chat_template is not None:
        from deepshard.finetune.data.chat import render_prompt

        prompt = render_prompt(tokenizer, prompt, chat_template)
        stop |= end_of_turn_ids(tokenizer)
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
        if ids[-1] in stop:
            break
    model.train(was_training)
    return tokenizer.decode(ids[start:], skip_special_tokens=True)


END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def end_of_turn_ids(tokenizer) -> set[int]:
    """Ids of the common chat end-of-turn tokens this tokenizer defines as single tokens."""
    vocab = tokenizer.get_vocab()
    return {vocab[t] for t in END_OF_TURN if t in vocab}
