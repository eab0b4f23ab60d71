"""A data position that survives a change of data-parallel world size.

DistributedSampler hands rank ``r`` the positions ``r, r + W, r + 2W, ...`` of the epoch's
permutation, so after ``k`` global batches exactly the prefix ``[0, k * mbs * W)`` is consumed,
whatever ``W`` is.  The position is therefore two numbers, the epoch and the global offset into
its permutation (which depends only on seed and epoch); a run resumed at another world size
continues from that offset, so no sample is seen twice or skipped.  The offset is counted where
batches are consumed, so loader workers that prefetch do not disturb it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader


def check_fits(num_windows: int, *, dp_size: int, micro_batch_size: int) -> None:
    """One global batch must fit in the dataset (ValueError naming the key)."""
    if num_windows < dp_size * micro_batch_size:
        raise ValueError(f"train.micro_batch_size={micro_batch_size}: the dataset has {num_windows} windows, "
                         f"fewer than one batch of {micro_batch_size} for each of {dp_size} data-parallel ranks; "
                         f"lower it or add data")


class OffsetSampler(Sampler[int]):
    """This rank's indices of one epoch, from global position ``start`` of the permutation.

    Same order as ``DistributedSampler(shuffle, seed, drop_last=True)`` for ``start=0``.
    """

    def __init__(self, num_samples: int, *, rank: int, world: int, seed: int, shuffle: bool = True) -> None:
        self.num_samples, self.rank, self.world = num_samples, rank, world
        self.seed, self.shuffle = seed, shuffle
        self.epoch = 0
        self.start = 0

    def set_position(self, epoch: int, start: int) -> None:
        self.epoch, self.start = epoch, start

    def permutation(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=g).tolist()

    def _rank_indices(self) -> list[int]:
        rest = self.permutation()[self.start:]
        per_rank = len(rest) // self.world  # drop the tail that cannot fill every rank
        return rest[self.rank:per_rank * self.world:self.world]

    def __iter__(self) -> Iterator[int]:
        return iter(self._rank_indices())

    def __len__(self) -> int:
        return (self.num_samples - self.start) // self.world


class ResumableStream:
    """Endless micro-batches for one dp rank, with a world-size-independent ``state_dict``."""

    def __init__(self, dataset: Dataset, *, dp_rank: int, dp_size: int, micro_batch_size: int, seed: int,
                 shuffle: bool = True, num_workers: int = 0, collate_fn: Callable[[list], Any] | None = None) -> None:
        check_fits(len(dataset), dp_size=dp_size, micro_batch_size=micro_batch_size)
        self.sampler = OffsetSampler(len(dataset), rank=dp_rank, world=dp_size, seed=seed, shuffle=shuffle)
        self.loader = StatefulDataLoader(dataset, batch_size=micro_batch_size, sampler=self.sampler,
                                         drop_last=True, num_workers=num_workers, collate_fn=collate_fn)
        self.global_batch = micro_batch_size * dp_size
        self.num_samples = len(dataset)
        self.seed = seed
        self.epoch = 0
        self.consumed = 0  # global samples of this epoch's permutation already trained on
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> ResumableStream:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.consumed + self.global_batch > self.num_samples:
            self.epoch, self.consumed, self._it = self.epoch + 1, 0, None
        if self._it is None:
            self.sampler.set_position(self.epoch, self.consumed)
            self._it = iter(self.loader)
        batch = next(self._it)
        self.consumed += self.global_batch
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at the saved global offset; the dataset and seed must be the saved ones."""
        for key in ("seed", "num_samples"):
            if state[key] != getattr(self, key):
                raise ValueError(f"checkpoint data position: {key}={state[key]} but this run has "
                                 f"{getattr(self, key)}; resume with the same data and train.seed")
        self.epoch, self.consumed, self._it = int(state["epoch"]), int(state["consumed"]), None
