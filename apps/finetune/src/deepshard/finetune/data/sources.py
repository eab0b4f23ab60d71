"""Where documents come from: ``data.name`` selects one. Each yields (token ids, labels) per doc."""

from __future__ import annotations

from collections.abc import Iterator

from deepshard.finetune.data.corpus import generate


def embedded_docs(tokenizer, *, num_docs: int, seed: int) -> Iterator[tuple[list[int], list[int]]]:
    """The generated stories, every token learned."""
    for text in generate(num_docs, seed=seed):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        yield ids, ids


SOURCES = {"embedded": embedded_docs}
