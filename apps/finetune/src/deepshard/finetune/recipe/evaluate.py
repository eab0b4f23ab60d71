"""Held-out loss and perplexity: each dp rank evaluates its slice, the token-weighted mean is reduced."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, default_collate

from deepshard.core.parallelize import IGNORE_INDEX


def _unlearned(row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A filler row that weighs nothing (every label ignored)."""
    return {**row, "labels": torch.full_like(row["labels"], IGNORE_INDEX)}


@torch.no_grad()
def evaluate(stepper, dataset: Dataset, *, dp_rank: int, dp_size: int, group, device: torch.device
             ) -> dict[str, float]:
    """``eval/loss`` and ``eval/perplexity`` over the whole held-out set, through the run's stepper
    (the engine's or the pipeline's: ``stepper.loss_sum`` over ``stepper.rows_per_forward`` rows).

    Every rank runs the same number of forward passes (ZeRO-3 all-gathers and pipeline sends are
    collective); a batch short of rows is filled with rows that weigh nothing.
    """
    rows = stepper.rows_per_forward
    mine = list(range(dp_rank, len(dataset), dp_size))
    num_batches = math.ceil(math.ceil(len(dataset) / dp_size) / rows)
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for b in range(num_batches):
        chunk = [dataset[i] for i in mine[b * rows:(b + 1) * rows]]
        chunk += [_unlearned(dataset[0])] * (rows - len(chunk))
        batch = default_collate(chunk)
        n = (batch["labels"] != IGNORE_INDEX).sum().to(device=device, dtype=torch.float64)
        sums += torch.stack([stepper.loss_sum(batch).to(device=device, dtype=torch.float64), n])
    dist.all_reduce(sums, group=group)
    loss = (sums[0] / sums[1]).item() if sums[1] > 0 else float("nan")
    return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}
