"""Where documents come from: ``data.name`` selects one. Each yields (token ids, labels) per doc."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice

from deepshard.core.parallelize import IGNORE_INDEX
from deepshard.finetune.data.chat import chat_docs
from deepshard.finetune.data.corpus import generate
from deepshard.finetune.data.records import READERS, Record


def embedded_docs(tokenizer, *, num_docs: int, seed: int, **_: object) -> Iterator[tuple[list[int], list[int]]]:
    """The generated stories, every token learned (tokenized as one batch: the fast tokenizer's quick path)."""
    for ids in _encode(tokenizer, list(generate(num_docs, seed=seed))):
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


def _reader_source(name: str):
    def docs(tokenizer, **options: object) -> Iterator[tuple[list[int], list[int]]]:
        return tokenize_records(tokenizer, READERS[name](**options))

    docs.__doc__ = f"Records of the {name!r} reader, tokenized."
    return docs


SOURCES = {"embedded": embedded_docs, **{name: _reader_source(name) for name in READERS}, "chat": chat_docs}
