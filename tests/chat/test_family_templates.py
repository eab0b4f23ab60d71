"""Each family's chat template: a checkpoint's own template when its tokenizer carries one, else the
family's default (Llama 3, ChatML for Qwen2/3, Gemma, Phi-3, Mistral); the loss on assistant turns only.

The oracle is transformers' ``apply_chat_template(tokenize=True, return_assistant_tokens_mask=True)``
(the defaults mark their assistant turns with ``{% generation %}``): the app's token ids equal its
``input_ids`` and the app's learned tokens are exactly its ``assistant_masks``.  The tokenizers are
tiny and made offline: the embedded byte-level BPE with each family's special tokens added, saved
beside a config.json of the family (transformers' own config class).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from deepshard.finetune.data.chat import encode_chat, resolve_template
from deepshard.finetune.data.tokenizer import embedded_tokenizer_path, load_tokenizer
from tests.models.hf_refs import hf_config

ASSETS = Path(str(embedded_tokenizer_path())).parent
# family (hf_refs' config) -> (default template, bos, eos, its end of turn, the template's other special tokens)
FAMILIES = {
    "llama": ("llama3", "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>"]),
    "qwen2": ("chatml", None, "<|im_end|>", "<|im_end|>", ["<|im_start|>"]),
    "qwen3": ("chatml", None, "<|im_end|>", "<|im_end|>", ["<|im_start|>"]),
    "mistral": ("mistral", "<s>", "</s>", "</s>", ["[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                                                   "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]),
    "gemma3": ("gemma", "<bos>", "<eos>", "<end_of_turn>", ["<start_of_turn>"]),
    "phi3": ("phi3", None, "<|endoftext|>", "<|end|>", ["<|assistant|>", "<|user|>", "<|system|>", "<|tool|>"]),
}
CONVERSATIONS = [
    [{"role": "system", "content": "Answer in one line."},
     {"role": "user", "content": "What colour is the sky?"},
     {"role": "assistant", "content": "Blue, on a clear day."},
     {"role": "user", "content": "And at night?"},
     {"role": "assistant", "content": " Black, with stars. "}],
    [{"role": "user", "content": "Count to three."},
     {"role": "assistant", "content": "One, two, three."},
     {"role": "tool", "content": "{\"ok\": true}"},
     {"role": "assistant", "content": "Done."},
     {"role": "user", "content": "Thanks"}],  # ends on a user turn: nothing of it is learned
]


def _checkpoint(root: Path, family: str, template: str | None = None) -> Path:
    """A HF folder of ``family``: its config.json and a tiny tokenizer with the family's special tokens."""
    from transformers import PreTrainedTokenizerFast

    _, bos, eos, end, specials = FAMILIES[family]
    tok = PreTrainedTokenizerFast(tokenizer_file=str(embedded_tokenizer_path()), bos_token=bos or "<|bos|>",
                                  eos_token=eos, pad_token="<|pad|>")
    tok.add_special_tokens({"additional_special_tokens": sorted({end, *specials} - {eos})})
    if template is not None:
        tok.chat_template = template
    path = root / family
    tok.save_pretrained(path)
    hf_config(family).to_json_file(path / "config.json")
    return path


def _check_against_transformers(tok, messages: list[dict], template: str) -> None:
    """The app's (ids, labels) against transformers' rendering and assistant mask of ``template``."""
    ids, labels = encode_chat(tok, messages, template, "row")
    ref = tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    assert ids == list(ref["input_ids"])
    learned = [int(label != -100) for label in labels]
    assert learned == list(ref["assistant_masks"]), tok.convert_ids_to_tokens(ids)
    assert all(label in (-100, i) for label, i in zip(labels, ids))
    assert sum(learned) > 0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_checkpoint_without_a_template_gets_its_familys_and_learns_only_assistant_turns(tmp_path, family):
    tok = load_tokenizer(str(_checkpoint(tmp_path, family)))
    expected = (ASSETS / f"chat_template_{FAMILIES[family][0]}.jinja").read_text()
    template = resolve_template(tok)
    assert template == expected
    assert "{% generation %}" in template.replace("{%- generation %}", "{% generation %}")
    for messages in CONVERSATIONS:
        _check_against_transformers(tok, messages, template)
    # the assistant turn's end-of-turn marker is learned: the model learns to stop
    _, labels = encode_chat(tok, CONVERSATIONS[1][:2], template)
    assert tok.convert_tokens_to_ids(FAMILIES[family][3]) in labels


@pytest.mark.parametrize("stored", ["chat_template.jinja", "tokenizer_config.json"])
def test_the_checkpoints_own_template_wins_over_the_familys(tmp_path, stored):
    """Stored as transformers 5 saves it, or inside tokenizer_config.json as older checkpoints carry it."""
    import json

    own = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + ':' + m['content'] + '<|im_end|>' }}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant:' }}{% endif %}")
    path = _checkpoint(tmp_path, "qwen2", template=own)
    if stored == "tokenizer_config.json":
        (path / "chat_template.jinja").unlink()
        config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": own}))
    tok = load_tokenizer(str(path))
    assert resolve_template(tok) == own
    ids, labels = encode_chat(tok, CONVERSATIONS[0][1:3], own)
    text = tok.decode([i for i, label in zip(ids, labels) if label != -100])
    assert text == "Blue, on a clear day.<|im_end|>"


def test_a_family_without_a_default_still_asks_for_a_template(tmp_path):
    """The transformers path (GPT-2 here) has no family template: the error names data.chat_template."""
    from transformers import GPT2Config, PreTrainedTokenizerFast

    path = tmp_path / "gpt2"
    PreTrainedTokenizerFast(tokenizer_file=str(embedded_tokenizer_path()), eos_token="<|eos|>").save_pretrained(path)
    GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=64).to_json_file(path / "config.json")
    tok = load_tokenizer(str(path))
    assert not tok.chat_template
    with pytest.raises(ValueError, match="has no chat_template; pass data.chat_template=PATH"):
        resolve_template(tok)
