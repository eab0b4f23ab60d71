"""Token streams as fixed windows: ``input_ids`` and ``labels`` already aligned.

Documents are joined with the eos token; labels that must not be learned (prompt tokens, say)
arrive as -100 and stay -100 after packing.  ``doc_ids`` (per input position, the index of the
document it belongs to) let the model keep attention inside each document.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch.utils.data import Dataset

from deepshard.core.parallelize import IGNORE_INDEX


class _PicklesAsArrays:
    """Pickled with its token tensors as numpy arrays: a launcher hands the datasets to its workers
    through a pipe, where torch's multiprocessing pickler would move tensors into /dev/shm, which
    containers often keep small (64 MB in Docker's default)."""

    def __getstate__(self) -> dict:
        return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in state.items()})


class PackedDataset(_PicklesAsArrays, Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens over the concatenated documents."""

    def __init__(self, docs: Iterable[tuple[list[int], list[int]]], seq_len: int, eos_id: int, *,
                 with_doc_ids: bool = False) -> None:
        ids: list[int] = []
        labels: list[int] = []
        doc: list[int] = []
        for i, (doc_ids, doc_labels) in enumerate(docs):
            ids.extend(doc_ids)
            labels.extend(doc_labels)
            ids.append(eos_id)
            labels.append(eos_id)
            doc.extend([i] * (len(doc_ids) + 1))  # the eos closes its document
        n = (len(ids) - 1) // seq_len
        if n < 1:
            raise ValueError(f"data.seq_len={seq_len}: the dataset holds only {len(ids)} tokens, fewer than one "
                             f"window; lower data.seq_len or add data")
        self.seq_len = seq_len
        self.ids = torch.tensor(ids[: n * seq_len + 1], dtype=torch.long)
        self.labels = torch.tensor(labels[: n * seq_len + 1], dtype=torch.long)
        self.doc = torch.tensor(doc[: n * seq_len + 1], dtype=torch.long) if with_doc_ids else None
        self.num_windows = n

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = i * self.seq_len
        item = {"input_ids": self.ids[s:s + self.seq_len], "labels": self.labels[s + 1:s + self.seq_len + 1]}
        if self.doc is not None:
            item["doc_ids"] = self.doc[s:s + self.seq_len]
        return item

    @property
    def num_tokens(self) -> int:
        return self.num_windows * self.seq_len


class PaddedDataset(_PicklesAsArrays, Dataset):
    """One document per row (``data.pack=false``): truncated to ``seq_len + 1`` tokens, padded with -100 labels.

    Padding sits after the document, so causal attention never lets a real token see it.
    """

    def __init__(self, docs: Iterable[tuple[list[int], list[int]]], seq_len: int, eos_id: int, pad_id: int) -> None:
        rows_ids, rows_labels = [], []
        self.num_truncated = 0
        for doc_ids, doc_labels in docs:
            ids, labels = list(doc_ids) + [eos_id], list(doc_labels) + [eos_id]
            if len(ids) > seq_len + 1:
                self.num_truncated += 1
                ids, labels = ids[:seq_len + 1], labels[:seq_len + 1]
            pad = seq_len + 1 - len(ids)
            rows_ids.append(ids + [pad_id] * pad)
            rows_labels.append(labels + [IGNORE_INDEX] * pad)
        if not rows_ids:
            raise ValueError("data: no documents to train on")
        self.seq_len = seq_len
        self.ids = torch.tensor(rows_ids, dtype=torch.long)
        self.labels = torch.tensor(rows_labels, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1], "labels": self.labels[i, 1:]}

    @property
    def num_tokens(self) -> int:
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())
