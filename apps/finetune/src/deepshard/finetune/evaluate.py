"""Held-out loss and perplexity: each dp rank evaluates its slice, the token-weighted mean is reduced."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, default_collate

IGNORE = -100


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device) -> tuple[tuple, dict]:
    """Positional (input_ids, labels) and, for packed rows, ``doc_ids`` (attention within documents)."""
    args = (batch["input_ids"].to(device), batch["labels"].to(device))
    return args, ({"doc_ids": batch["doc_ids"].to(device)} if "doc_ids" in batch else {})


@torch.no_grad()
def evaluate(engine, dataset: Dataset, *, dp_rank: int, dp_size: int, group, micro_batch_size: int,
             device: torch.device) -> dict[str, float]:
    """``eval/loss`` and ``eval/perplexity`` over the whole held-out set.

    Every rank runs the same number of forward passes (ZeRO-3 all-gathers are collective); a rank
    whose slice has run out repeats a window with weight zero.
    """
    mine = list(range(dp_rank, len(dataset), dp_size))
    num_batches = math.ceil(math.ceil(len(dataset) / dp_size) / micro_batch_size)
    model = engine.model
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for b in range(num_batches):
        chunk = mine[b * micro_batch_size:(b + 1) * micro_batch_size]
        batch = default_collate([dataset[i] for i in (chunk or [0])])
        args, kwargs = model_inputs(batch, device)
        loss = engine(*args, **kwargs)
        n = int((batch["labels"] != IGNORE).sum())
        if chunk and n:
            sums += torch.stack([loss.detach().double() * n, torch.tensor(float(n), dtype=torch.float64,
                                                                           device=device)])
    model.train(was_training)
    dist.all_reduce(sums, group=group)
    loss = (sums[0] / sums[1]).item() if sums[1] > 0 else float("nan")
    return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}
