"""data=chat: conversations rendered by the tokenizer's chat template, only assistant turns learned.

The expectations are written out here: the embedded template's pieces (split at its special tokens,
where byte-level BPE always splits) tokenized one by one, and transformers' own
``apply_chat_template`` on a PreTrainedTokenizerFast built from our tokenizer.json + template.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepshard.finetune.config import DataConfig
from deepshard.finetune.data.chat import chat_docs, encode_chat, render_prompt, resolve_template
from deepshard.finetune.data.sources import check_records
from deepshard.finetune.data.tokenizer import embedded_tokenizer_path, load_tokenizer

ASSET = Path(str(embedded_tokenizer_path())).parent / "chat_template.jinja"
TWO_TURNS = [
    {"role": "system", "content": "you count things."},
    {"role": "user", "content": "alice has two apples. bob gives her one more. how many?"},
    {"role": "assistant", "content": "alice has three apples."},
    {"role": "user", "content": "and if she eats one?"},
    {"role": "assistant", "content": " then two apples are left!"},
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _hf_reference_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(embedded_tokenizer_path()), bos_token="<|bos|>",
                                   eos_token="<|eos|>", pad_token="<|pad|>", chat_template=ASSET.read_text())


def test_two_turns_render_exactly_as_apply_chat_template(tok):
    ref = _hf_reference_tokenizer()
    expected = ref.apply_chat_template(TWO_TURNS, tokenize=True, return_dict=False)
    ids, _ = encode_chat(tok, TWO_TURNS, resolve_template(tok))
    assert ids == list(expected)
    text = ref.apply_chat_template(TWO_TURNS, tokenize=False)
    assert text.startswith("<|bos|>system\nyou count things.<|eos|><|bos|>user\n")


def test_only_assistant_tokens_carry_labels(tok):
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    bos, eos = enc("<|bos|>"), enc("<|eos|>")
    want_ids, want_labels = [], []
    for m in TWO_TURNS:  # <|bos|>role\ncontent<|eos|>: the assistant's content and its <|eos|> are learned
        head = bos + enc(f"{m['role']}\n")
        body = enc(m["content"]) + eos
        want_ids += head + body
        want_labels += [-100] * len(head) + (body if m["role"] == "assistant" else [-100] * len(body))
    ids, labels = encode_chat(tok, TWO_TURNS, resolve_template(tok))
    assert ids == want_ids
    for i, (got, want) in enumerate(zip(labels, want_labels, strict=True)):  # token by token
        assert got == want, f"token {i} ({tok.decode([ids[i]])!r}): label {got}, expected {want}"
    learned = tok.decode([t for t in labels if t != -100])
    assert learned == "alice has three apples.<|eos|> then two apples are left!<|eos|>"


def test_hf_tokenizer_dir_uses_its_own_template(tmp_path):
    """A HF tokenizer folder carrying a ChatML template: that template renders, its assistant turns learn."""
    chatml = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    hf = _hf_reference_tokenizer()
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    hf.chat_template = chatml
    hf.save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    ids, labels = encode_chat(tok, TWO_TURNS[1:3], resolve_template(tok))
    assert ids == list(hf.apply_chat_template(TWO_TURNS[1:3], tokenize=True, return_dict=False))
    assert tok.decode([t for t in labels if t != -100]) == "alice has three apples.<|im_end|>\n"
    assert render_prompt(tok, "hi", resolve_template(tok)) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def _write(tmp_path: Path, rows: list) -> str:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_bad_rows_name_file_and_line(tmp_path):
    good = {"messages": TWO_TURNS[1:3]}
    path = _write(tmp_path, [good, "", {"text": "no messages here"}])
    with pytest.raises(ValueError, match=r"chat\.jsonl:3: a chat row needs a non-empty 'messages' list.*'text'"):
        check_records(DataConfig(name="chat", path=path))
    path = _write(tmp_path, [good, {"messages": [{"role": "bot", "content": "hi"}]}])
    with pytest.raises(ValueError, match=r"chat\.jsonl:2: message 0 has role 'bot'; valid roles are"):
        check_records(DataConfig(name="chat", path=path))
    path = _write(tmp_path, [{"messages": [{"role": "user", "content": 3}]}])
    with pytest.raises(ValueError, match=r"chat\.jsonl:1: message 0 \('user'\) content must be a string"):
        check_records(DataConfig(name="chat", path=path))


def test_tokenizer_without_template_says_what_to_pass(tmp_path):
    from transformers import PreTrainedTokenizerFast

    bare = PreTrainedTokenizerFast(tokenizer_file=str(embedded_tokenizer_path()), eos_token="<|eos|>")
    path = _write(tmp_path, [{"messages": TWO_TURNS[1:3]}])
    with pytest.raises(ValueError, match=r"has no chat_template; pass data.chat_template=PATH"):
        list(chat_docs(bare, DataConfig(name="chat", path=path)))
    docs = list(chat_docs(bare, DataConfig(name="chat", path=path, chat_template=str(ASSET))))  # the way out it names works
    assert len(docs) == 1 and any(t != -100 for t in docs[0][1])
    with pytest.raises(ValueError, match=r"data.chat_template='nope.jinja': no such file"):
        list(chat_docs(bare, DataConfig(name="chat", path=path, chat_template="nope.jinja")))


def test_chat_dataset_builds_through_the_app_config(tmp_path):
    from deepshard.finetune.data.build import build_datasets

    path = _write(tmp_path, [{"messages": TWO_TURNS}] * 6)
    data = DataConfig(name="chat", path=path, seq_len=128, pack=False)
    train, _ = build_datasets(data, load_tokenizer(), 2048)
    row = train[0]
    learned = [t for t in row["labels"].tolist() if t != -100]
    assert learned and len(learned) < len(row["labels"])


def test_app_stops_before_any_work_on_a_bad_chat_row_or_template(tmp_path, monkeypatch):
    """The launcher's own checks, in this process (tests/app/prelaunch.py: no worker may start)."""
    from tests.app.prelaunch import prelaunch_error

    bad = _write(tmp_path, [{"messages": TWO_TURNS}, {"messages": [{"role": "robot", "content": "beep"}]}])
    line = prelaunch_error(["data=chat", f"data.path={bad}", "+peft=lora"], tmp_path / "run", monkeypatch)
    assert line == (f"error: {bad}:2: message 0 has role 'robot'; valid roles are "
                    f"['system', 'user', 'assistant', 'tool']")
    good = _write(tmp_path, [{"messages": TWO_TURNS}] * 4)
    line = prelaunch_error(["data=chat", f"data.path={good}", "data.chat_template=missing.jinja"], tmp_path / "run",
                           monkeypatch)
    assert "data.chat_template='missing.jinja': no such file" in line


def test_file_without_assistant_turns_is_refused_and_some_are_skipped_with_a_count(tmp_path, tok, capsys):
    """Only assistant turns are learned: a file with none would train on the separators alone."""
    prompts = _write(tmp_path, [{"messages": TWO_TURNS[:2]}, "", {"messages": TWO_TURNS[1:2]}])
    with pytest.raises(ValueError, match=rf"^{prompts}: no conversation has an assistant turn \(2 row\(s\)\)"):
        check_records(DataConfig(name="chat", path=prompts))
    mixed = _write(tmp_path, [{"messages": TWO_TURNS}, {"messages": TWO_TURNS[:2]}, {"messages": TWO_TURNS[1:3]}])
    assert check_records(DataConfig(name="chat", path=mixed)) == 3
    assert capsys.readouterr().err.strip().splitlines() == [
        f"warning: data.path={mixed!r}: 1 of 3 conversation(s) have no assistant turn and are skipped "
        f"(the first: {mixed}:2)"]
    docs = list(chat_docs(tok, DataConfig(name="chat", path=mixed)))
    assert len(docs) == 2 and all(any(t != -100 for t in labels) for _, labels in docs)


def test_template_refused_by_the_sandbox_is_a_value_error_naming_its_source(tmp_path, tok):
    path = _write(tmp_path, [{"messages": TWO_TURNS}])
    evil = tmp_path / "evil.jinja"
    evil.write_text("{% for m in messages %}{{ m.content.__class__.__mro__ }}{% endfor %}")
    with pytest.raises(ValueError, match=rf"^data.chat_template='{evil}': refused by the Jinja sandbox while "
                                         rf"rendering {path}:1 \(SecurityError: access to attribute '__class__'"):
        list(chat_docs(tok, DataConfig(name="chat", path=path, chat_template=str(evil))))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }}")
    with pytest.raises(ValueError, match=rf"^data.chat_template='{broken}': not a valid Jinja template \(line 1\)"):
        list(chat_docs(tok, DataConfig(name="chat", path=path, chat_template=str(broken))))
