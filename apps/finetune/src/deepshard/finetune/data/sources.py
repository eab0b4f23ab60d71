"""Where documents come from: ``data.name`` selects one. Each yields (token ids, labels) per doc."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from itertools import islice

from deepshard.core.parallelize import IGNORE_INDEX
from deepshard.finetune.data.chat import chat_docs, check_chat_rows
from deepshard.finetune.data.corpus import generate
from deepshard.finetune.data.records import READERS, Record, read_records


def embedded_docs(tokenizer, data) -> Iterator[tuple[list[int], list[int]]]:
    """``data.num_docs`` generated stories, every token learned (tokenized as one batch: the fast
    tokenizer's quick path)."""
    for ids in _encode(tokenizer, list(generate(data.num_docs, seed=data.seed))):
        yield ids, ids


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def tokenize_records(tokenizer, records: Iterable[Record], chunk: int = 512) -> Iterator[tuple[list[int], list[int]]]:
    """Text records learn every token; prompt/response records learn only the response (prompt: -100).

    Records are tokenized in chunks, since the fast tokenizers are much quicker on batches.
    """
    it = iter(records)
    while batch := list(islice(it, chunk)):
        texts = [r["text"] for r in batch if "text" in r]
        prompts = [r["prompt"] for r in batch if "text" not in r]
        responses = [r["response"] for r in batch if "text" not in r]
        t_ids, p_ids, r_ids = iter(_encode(tokenizer, texts)), iter(_encode(tokenizer, prompts)), \
            iter(_encode(tokenizer, responses))
        for r in batch:
            if "text" in r:
                ids = next(t_ids)
                yield ids, ids
            else:
                p, resp = next(p_ids), next(r_ids)
                yield p + resp, [IGNORE_INDEX] * len(p) + resp


def record_docs(tokenizer, data) -> Iterator[tuple[list[int], list[int]]]:
    """The records of a file-backed source (jsonl, text, hf_disk), tokenized."""
    return tokenize_records(tokenizer, read_records(data))


# data.name -> docs(tokenizer, data): (token ids, labels) per document, from the typed data config
SOURCES = {"embedded": embedded_docs, **dict.fromkeys(READERS, record_docs), "chat": chat_docs}


def eval_data(data):
    """``data`` reading ``data.eval_path`` (the eval set's own file) in place of ``data.path``."""
    return dataclasses.replace(data, path=data.eval_path, eval_path=None, eval_fraction=0.0)


def check_records(data) -> int:
    """Read every record of a user data source now (ValueError naming file and line; ``data.eval_path``'s
    too, read the same way, so it has the same format); returns the training records' count."""
    if data.eval_path is not None:
        try:
            check_records(eval_data(data))
        except ValueError as e:
            raise ValueError(f"data.eval_path={data.eval_path!r}: {e}".replace("data.path=", "data.eval_path=")) \
                from None
    if data.name == "chat":  # conversations: the rows' shape, roles, assistant turns (the template needs the tokenizer)
        return check_chat_rows(data.path)
    return sum(1 for _ in read_records(data)) if data.name in READERS else 0
