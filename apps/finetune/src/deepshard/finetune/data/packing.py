"""Token streams packed into fixed windows: ``input_ids`` and ``labels`` already aligned.

Documents are joined with the eos token; labels that must not be learned (prompt tokens, say)
arrive as -100 and stay -100 after packing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils.data import Dataset


class PackedDataset(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens over the concatenated documents."""

    def __init__(self, docs: Iterable[tuple[list[int], list[int]]], seq_len: int, eos_id: int) -> None:
        ids: list[int] = []
        labels: list[int] = []
        for doc_ids, doc_labels in docs:
            ids.extend(doc_ids)
            labels.extend(doc_labels)
            ids.append(eos_id)
            labels.append(eos_id)
        n = (len(ids) - 1) // seq_len
        if n < 1:
            raise ValueError(f"data.seq_len={seq_len}: the dataset holds only {len(ids)} tokens, fewer than one "
                             f"window; lower data.seq_len or add data")
        self.seq_len = seq_len
        self.ids = torch.tensor(ids[: n * seq_len + 1], dtype=torch.long)
        self.labels = torch.tensor(labels[: n * seq_len + 1], dtype=torch.long)
        self.num_windows = n

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = i * self.seq_len
        return {"input_ids": self.ids[s:s + self.seq_len], "labels": self.labels[s + 1:s + self.seq_len + 1]}

    @property
    def num_tokens(self) -> int:
        return self.num_windows * self.seq_len
