"""What the HF-stack scripts of issue 41 run on: a local tiny Llama with a tokenizer and chat template
(no download), chat rows in TRL's conversational prompt-completion form, and the ds_configs (the
tutorial's all-"auto" shape of hf_trainer_harness.py, at ZeRO-2 and at ZeRO-3 with optimizer offload)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.compat.hf_trainer_harness import ds_config

# the app's embedded byte-level BPE and chat template, by path (the DeepSpeed recorder's venv lacks our packages)
ASSETS = Path(__file__).resolve().parents[2] / "apps" / "finetune" / "src" / "deepshard" / "finetune" / "assets"
THINGS = ["apples", "pears", "cups", "books", "stones", "boats", "keys", "birds"]
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven"]


def write_ds_config(path: Path, stage: int, *, optimizer: bool = True) -> str:
    """ZeRO-2, or ZeRO-3 with the optimizer offloaded to the CPU and the weights gathered on save (the
    layouts of the issue and of bench/record_hf_trainer_ds.py).  ``optimizer=False``: no optimizer section,
    as TRL's and accelerate's stock configs have none (Trainer's own AdamW and decay groups then go to
    ``deepspeed.initialize``, and its scheduler is built over the optimizer that returns)."""
    config = ds_config(stage, offload=stage == 3)
    if not optimizer:
        del config["optimizer"]
    if stage == 3:
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    path.write_text(json.dumps(config))
    return str(path)


def chat_rows(n: int = 32) -> list[dict[str, Any]]:
    """Prompt-completion conversations of uneven length: the loss is on the assistant's completion only."""
    rows = []
    for i in range(n):
        a, b = i % 7 + 1, (3 * i) % 5
        thing = THINGS[i % len(THINGS)]
        prompt = [{"role": "user", "content": f"alice has {WORDS[a]} {thing}. bob gives her {WORDS[b]}. "
                                              f"how many {thing} now?"}]
        if i % 3 == 0:
            prompt.insert(0, {"role": "system", "content": "you count things."})
        rows.append({"prompt": prompt,
                     "completion": [{"role": "assistant", "content": f"{WORDS[a + b]} {thing}."}]})
    return rows


def make_model_dir(path: Path) -> str:
    """A tiny LlamaForCausalLM (seed 0) saved with the app's embedded byte-level tokenizer and chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    asset = ASSETS / "tokenizer.json"
    tok = PreTrainedTokenizerFast(tokenizer_file=str(asset), bos_token="<|bos|>", eos_token="<|eos|>",
                                  pad_token="<|pad|>", chat_template=(asset.parent / "chat_template.jinja").read_text())
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
