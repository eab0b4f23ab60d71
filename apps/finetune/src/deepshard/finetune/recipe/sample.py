"""A greedy sample from the trained model at the end of a run, shown in the log.

Every rank runs the same forward passes (under ZeRO-3 each forward all-gathers parameters, a
collective; under pp the stages pass activations), and rank 0's token is broadcast each step so all
ranks extend the same text.
With ``chat_template`` (``data=chat``) the prompt is a user turn rendered by the template with
its generation prompt, so the model continues as the assistant it was trained to be, and stops
at the end of its turn (eos, or the template's end-of-turn token such as ``<|im_end|>``).
"""

from __future__ import annotations


def greedy_sample(stepper, tokenizer, prompt: str, *, num_tokens: int, max_seq_len: int,
                  chat_template: str | None = None) -> str:
    """``num_tokens`` greedy tokens after ``prompt`` (stops early at eos), decoded by the run's
    stepper (``stepper.next_token``: the engine's model, or the pipeline's stages); returns the
    continuation."""
    stop = {tokenizer.eos_token_id}
    if chat_template is not None:
        from deepshard.finetune.data.chat import render_prompt

        prompt = render_prompt(tokenizer, prompt, chat_template)
        stop |= end_of_turn_ids(tokenizer)
    ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"]) or [tokenizer.eos_token_id]
    start = len(ids)
    for _ in range(num_tokens):
        ids.append(stepper.next_token(ids, max_seq_len=max_seq_len))
        if ids[-1] in stop:
            break
    return tokenizer.decode(ids[start:], skip_special_tokens=True)


END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def end_of_turn_ids(tokenizer) -> set[int]:
    """Ids of the common chat end-of-turn tokens this tokenizer defines as single tokens."""
    vocab = tokenizer.get_vocab()
    return {vocab[t] for t in END_OF_TURN if t in vocab}
