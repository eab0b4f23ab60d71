"""The distributed, resumable loader: torchdata's StatefulDataLoader over a DistributedSampler."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader


def build_loader(dataset: Dataset, *, dp_rank: int, dp_size: int, micro_batch_size: int, seed: int,
                 shuffle: bool = True) -> StatefulDataLoader:
    """Each dp rank sees its own slice; ``state_dict()`` records the position for resumption."""
    if len(dataset) < dp_size * micro_batch_size:
        raise ValueError(f"train.micro_batch_size={micro_batch_size}: the dataset has {len(dataset)} windows, "
                         f"fewer than one batch for {dp_size} data-parallel ranks; lower it or add data")
    sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed,
                                 drop_last=True)
    return StatefulDataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, drop_last=True)


def forever(loader: StatefulDataLoader) -> Iterator[dict[str, torch.Tensor]]:
    """Cycle through epochs, reshuffling each one (the epoch lives in the sampler's state)."""
    sampler = loader.sampler
    epoch = getattr(sampler, "epoch", 0)
    while True:
        yield from loader
        epoch += 1
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)
