"""From ``data.*`` settings to the train and held-out datasets (the split is by document)."""

from __future__ import annotations

import math
import random

from torch.utils.data import Dataset

from deepshard.finetune.data.packing import PackedDataset, PaddedDataset
from deepshard.finetune.data.sources import SOURCES


def split_docs(docs: list, eval_fraction: float, seed: int, source: str = "the data") -> tuple[list, list]:
    """A seeded, document-level held-out split: no eval document is ever seen in training."""
    if eval_fraction <= 0:
        return docs, []
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, math.ceil(len(docs) * eval_fraction))
    if n_eval >= len(docs):
        raise ValueError(f"data.eval_fraction={eval_fraction}: {source} holds {len(docs)} document(s), so "
                         f"{n_eval} held out leave(s) none to train on; add documents, lower data.eval_fraction "
                         f"or split finer (data.text_unit=paragraph|line)")
    held = set(order[:n_eval])
    return [d for i, d in enumerate(docs) if i not in held], [d for i, d in enumerate(docs) if i in held]


def make_dataset(docs: list, data, tokenizer, *, what: str = "train") -> Dataset:
    """Packed windows (``data.pack=true``) or one padded document per row."""
    try:
        if data.pack:
            return PackedDataset(docs, data.seq_len, tokenizer.eos_token_id, with_doc_ids=data.doc_mask)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return PaddedDataset(docs, data.seq_len, tokenizer.eos_token_id, pad)
    except ValueError as e:
        raise ValueError(f"{e} (the {what} split)") from None


def build_datasets(data, tokenizer, vocab_size: int) -> tuple[Dataset, Dataset | None]:
    """Tokenized train and eval datasets: eval from ``data.eval_path``'s rows, or the held-out
    ``data.eval_fraction`` of data.path's documents (None when neither)."""
    if len(tokenizer) > vocab_size:
        raise ValueError(f"model.vocab_size={vocab_size}: the tokenizer has {len(tokenizer)} tokens")
    docs = list(SOURCES[data.name](tokenizer, data))
    source = f"data.path={data.path!r}" if data.path else f"data={data.name}"
    if data.name == "text":
        source += f" (data.text_unit={data.text_unit})"
    if data.eval_path is not None:  # the eval set is its own file's: data.path trains whole
        from deepshard.finetune.data.sources import eval_data

        train, held = docs, list(SOURCES[data.name](tokenizer, eval_data(data)))
    else:
        train, held = split_docs(docs, data.eval_fraction, data.seed, source)
    train_set = make_dataset(train, data, tokenizer)
    eval_set = make_dataset(held, data, tokenizer, what="eval") if held else None
    return train_set, eval_set
