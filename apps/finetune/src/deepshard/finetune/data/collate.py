"""``data.pad_to_multiple_of``: each padded batch cut to its longest row, rounded up to a multiple.

``PaddedDataset`` (``data.pack=false``) pads every row to ``data.seq_len``; chat rows are mostly padding
there.  The collator keeps each batch's positions up to its last learned label (labels != -100), rounded
up to the next multiple of ``multiple`` and capped at ``seq_len``.  The positions cut carry no loss, and
causal attention never lets an earlier position see them, so the loss and every gradient are those of
the full-length batch (an MoE router's load-balancing statistics, which count every position, are the
one thing that sees fewer pad positions).  Under ``compile=true`` the sequence lengths a block sees are at
most ``ceil(seq_len / multiple)`` (dynamo: the first static, every later one through one symbolic graph).
"""

from __future__ import annotations

import torch
from torch.utils.data import default_collate

from deepshard.core.parallelize import IGNORE_INDEX


class PadToMultiple:
    """``default_collate``, then every ``[rows, seq_len]`` tensor of the batch cut to the smallest multiple
    of ``multiple`` that holds its last learned label (at most ``seq_len``).  A class, not a closure: the
    loader's worker processes pickle it."""

    def __init__(self, multiple: int, seq_len: int) -> None:
        assert multiple > 0 and seq_len > 0, (multiple, seq_len)
        self.multiple, self.seq_len = multiple, seq_len

    def length(self, labels: torch.Tensor) -> int:
        """The batch's length: its last learned position + 1, rounded up to ``multiple``, capped at seq_len."""
        learned = (labels != IGNORE_INDEX).any(0).nonzero()
        longest = int(learned[-1]) + 1 if len(learned) else 1
        return min(self.seq_len, -(-longest // self.multiple) * self.multiple)

    def __call__(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = default_collate(rows)
        n = self.length(batch["labels"])
        return {k: v[:, :n] if v.dim() >= 2 and v.shape[1] == self.seq_len else v for k, v in batch.items()}


def batch_collator(data) -> PadToMultiple | None:
    """The training batches' collator for ``data`` (the app's DataConfig): None (torch's default, every row
    ``data.seq_len`` long) unless ``data.pad_to_multiple_of`` is set."""
    return PadToMultiple(data.pad_to_multiple_of, data.seq_len) if data.pad_to_multiple_of else None
