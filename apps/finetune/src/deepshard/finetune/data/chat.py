"""Chat data (``data=chat data.path=FILE.jsonl``): conversations rendered with the tokenizer's template.

A row is ``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}, ...]}``
(the OpenAI / ShareGPT shape).  It is rendered by ``tokenizer.apply_chat_template`` with the
tokenizer's own ``chat_template`` (a HF checkpoint's ``tokenizer_config.json`` or
``chat_template.jinja``; when it has none, its model family's default: ``assets/chat_template_<name>.jinja``,
set by ``load_tokenizer``; the embedded tokenizer ships ``assets/chat_template.jinja``;
``data.chat_template=PATH`` overrides any), and only the assistant turns are learned: every other
token's label is -100.

Which characters belong to an assistant turn is read from the template itself: the turn spans
from the end of ``messages[:i]`` rendered with the generation prompt to the end of
``messages[:i+1]`` (its content and its end-of-turn marker).  The whole conversation is then
tokenized once, exactly as ``apply_chat_template(tokenize=True)`` does, and a token is learned
when it starts inside such a span (character offsets of the fast tokenizer).

A file none of whose conversations has an assistant turn is refused (it would teach nothing but the
separator); conversations without one in a file that has others are skipped, counted in one warning.
A template that fails (a Jinja syntax error, or refused by transformers' sandbox) is a ValueError
naming where the template came from and the row.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from jinja2 import TemplateError

from deepshard.core.parallelize import IGNORE_INDEX
from deepshard.finetune.data.records import json_lines

ROLES = ("system", "user", "assistant", "tool")
Message = dict[str, str]


def embedded_chat_template() -> str:
    """The small Jinja template shipped for the embedded tokenizer (``<|bos|>role\\ncontent<|eos|>``)."""
    return (resources.files("deepshard.finetune") / "assets" / "chat_template.jinja").read_text(encoding="utf-8")


def family_chat_template(model_path: str | Path) -> tuple[str, str] | None:
    """(name, Jinja text) of the default chat template of the family that reads the HF folder
    ``model_path`` (Llama 3, ChatML for Qwen, Gemma, Phi-3, Mistral), for a checkpoint whose tokenizer
    carries none (base models often ship without); None for a family without one (the transformers path)."""
    from deepshard.finetune.models import registry

    try:
        name = registry.for_hf(model_path).hf.chat_template
    except ValueError:  # no family reads it: the model's own checks say why, elsewhere
        return None
    if not name:
        return None
    return name, (resources.files("deepshard.finetune") / "assets" / f"chat_template_{name}.jinja").read_text(
        encoding="utf-8")


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


def chat_rows(path: str | None) -> Iterator[tuple[str, list[Message]]]:
    """(``FILE:LINE``, messages) for each non-blank line of each JSON-lines file (ValueError naming both)."""
    for where, obj in json_lines(path):
        yield where, _messages(obj, where)


def _has_reply(messages: list[Message]) -> bool:
    return any(m["role"] == "assistant" for m in messages)


def check_chat_rows(path: str | None) -> int:
    """Every row read and checked (ValueError naming file and line); a file with no assistant turn in
    any row is refused; rows without one are counted in one warning.  Returns the number of rows."""
    rows, silent, first = Counter(), Counter(), {}
    for where, messages in chat_rows(path):
        file = where.rsplit(":", 1)[0]
        rows[file] += 1
        if not _has_reply(messages):
            silent[file] += 1
            first.setdefault(file, where)
    for file, n in rows.items():
        if silent[file] == n:
            raise ValueError(f"{file}: no conversation has an assistant turn ({n} row(s)), and only assistant "
                             f"turns are learned: nothing to train on (rows are {{\"messages\": [{{\"role\": "
                             f"\"user\", ...}}, {{\"role\": \"assistant\", ...}}]}})")
    if silent:
        total = sum(silent.values())
        print(f"warning: data.path={path!r}: {total} of {sum(rows.values())} conversation(s) have no assistant "
              f"turn and are skipped (the first: {min(first.values())})", file=sys.stderr)
    return sum(rows.values())


def template_source(chat_template: str | None, model_path: str | None) -> str:
    """Where the chat template comes from, as the user names it."""
    if chat_template:
        return f"data.chat_template={chat_template!r}"
    if model_path:
        return f"model.path={model_path!r}: its tokenizer's chat_template (or its family's default)"
    return "the embedded tokenizer's chat_template (assets/chat_template.jinja)"


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
    labels = [tok if any(s <= start < e for s, e in spans) else IGNORE_INDEX
              for tok, (start, _) in zip(ids, enc["offset_mapping"])]
    return ids, labels


def chat_docs(tokenizer, data) -> Iterator[tuple[list[int], list[int]]]:
    """``data=chat``: each conversation of ``data.path`` as one document, assistant tokens learned
    (``data.chat_template``: a Jinja file, default the tokenizer's)."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("data=chat needs a fast (tokenizers-backed) tokenizer for its character offsets")
    template = resolve_template(tokenizer, data.chat_template)
    for where, messages in chat_rows(data.path):
        if not _has_reply(messages):  # nothing to learn but the separator (check_chat_rows warned)
            continue
        try:
            doc = encode_chat(tokenizer, messages, template, where)
        except TemplateError as e:  # a syntax error, or an attribute the sandbox refuses
            what = {"TemplateSyntaxError": f"not a valid Jinja template (line {getattr(e, 'lineno', '?')})",
                    "SecurityError": f"refused by the Jinja sandbox while rendering {where}"}.get(
                        type(e).__name__, f"fails on {where}")
            raise ValueError(f"{template_source(data.chat_template, None)}: {what} ({type(e).__name__}: "
                             f"{' '.join(str(e).split())})") from None
        yield doc


def render_prompt(tokenizer, prompt: str, template: str) -> str:
    """A user prompt as the start of an assistant turn (what ``train.sample_prompt`` generates from)."""
    return _render(tokenizer, [{"role": "user", "content": prompt}], template, generation_prompt=True)
