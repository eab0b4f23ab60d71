"""Chat data (``data=chat data.path=FILE.jsonl``): conversations rendered with the tokenizer's template.

A row is ``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}, ...]}``
(the OpenAI / ShareGPT shape).  It is rendered by ``tokenizer.apply_chat_template`` with the
tokenizer's own ``chat_template`` (HF tokenizers carry one; the embedded tokenizer ships
``assets/chat_template.jinja``; ``data.chat_template=PATH`` overrides either), and only the
assistant turns are learned: every other token's label is -100.

Which characters belong to an assistant turn is read from the template itself: the turn spans
from the end of ``messages[:i]`` rendered with the generation prompt to the end of
``messages[:i+1]`` (its content and its end-of-turn marker).  The whole conversation is then
tokenized once, exactly as ``apply_chat_template(tokenize=True)`` does, and a token is learned
when it starts inside such a span (character offsets of the fast tokenizer).
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from deepshard.finetune.data.records import json_lines

IGNORE = -100
ROLES = ("system", "user", "assistant", "tool")
Message = dict[str, str]


def embedded_chat_template() -> str:
    """The small Jinja template shipped for the embedded tokenizer (``<|bos|>role\\ncontent<|eos|>``)."""
    return (resources.files("deepshard.finetune") / "assets" / "chat_template.jinja").read_text(encoding="utf-8")


def _messages(obj: object, where: str) -> list[Message]:
    """One validated row: a non-empty list of {role, content} with known roles and string contents."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with 'messages', got {type(obj).__name__}")
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        found = f"'messages' is {messages!r:.60}" if "messages" in obj else f"found keys {sorted(obj)}"
        raise ValueError(f"{where}: a chat row needs a non-empty 'messages' list of {{\"role\": ..., "
                         f"\"content\": ...}} objects; {found}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"{where}: message {i} must be an object with 'role' and 'content', got {m!r:.80}")
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: message {i} has role {m['role']!r}; valid roles are {list(ROLES)}")
        if not isinstance(m["content"], str):
            raise ValueError(f"{where}: message {i} ('{m['role']}') content must be a string, got "
                             f"{type(m['content']).__name__}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def chat_rows(path: str | None, **_: object) -> Iterator[tuple[str, list[Message]]]:
    """(``FILE:LINE``, messages) for each non-blank line of each JSON-lines file (ValueError naming both)."""
    for where, obj in json_lines(path):
        yield where, _messages(obj, where)


def resolve_template(tokenizer, path: str | None = None, *, model_path: str | None = None) -> str:
    """``data.chat_template=PATH`` if given, else the tokenizer's own; a ValueError saying what to pass."""
    if path:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ValueError(f"data.chat_template={path!r}: no such file (expected a Jinja chat template)")
        return p.read_text(encoding="utf-8")
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    if not template:
        model_path = model_path or getattr(tokenizer, "name_or_path", None)
        where = f"model.path={model_path!r}: its tokenizer" if model_path else "the tokenizer"
        raise ValueError(f"data=chat: {where} has no chat_template; pass data.chat_template=PATH (a Jinja file, "
                         f"e.g. the embedded one: {resources.files('deepshard.finetune') / 'assets'}"
                         f"/chat_template.jinja)")
    return template


def _render(tokenizer, messages: list[Message], template: str, *, generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer, messages: list[Message], template: str, where: str = "") -> tuple[str, list]:
    """The rendered conversation and the [start, end) character spans of its assistant turns."""
    text = _render(tokenizer, messages, template)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        try:
            before = _render(tokenizer, messages[:i], template, generation_prompt=True) if i else ""
        except Exception:  # noqa: BLE001 - a template may refuse an empty list
            before = ""
        upto = _render(tokenizer, messages[:i + 1], template)
        if not (text.startswith(upto) and upto.startswith(before)):
            raise ValueError(f"{where}: the chat template does not render this conversation prefix by prefix "
                             f"(message {i}), so its assistant turns cannot be located; pass "
                             f"data.chat_template=PATH with a template that does")
        spans.append((len(before), len(upto)))
    return text, spans


def encode_chat(tokenizer, messages: list[Message], template: str, where: str = "") -> tuple[list[int], list[int]]:
    """(token ids, labels): ids exactly as ``apply_chat_template(tokenize=True)``, labels -100 outside
    the assistant turns."""
    text, spans = assistant_spans(tokenizer, messages, template, where)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    labels = [tok if any(s <= start < e for s, e in spans) else IGNORE
              for tok, (start, _) in zip(ids, enc["offset_mapping"])]
    return ids, labels


def chat_docs(tokenizer, *, path: str | None, chat_template: str | None = None, model_path: str | None = None,
              **_: object) -> Iterator[tuple[list[int], list[int]]]:
    """``data=chat``: each conversation as one document, assistant tokens learned."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("data=chat needs a fast (tokenizers-backed) tokenizer for its character offsets")
    template = resolve_template(tokenizer, chat_template, model_path=model_path)
    for where, messages in chat_rows(path):
        yield encode_chat(tokenizer, messages, template, where)


def render_prompt(tokenizer, prompt: str, template: str) -> str:
    """A user prompt as the start of an assistant turn (what ``train.sample_prompt`` generates from)."""
    return _render(tokenizer, [{"role": "user", "content": prompt}], template, generation_prompt=True)
