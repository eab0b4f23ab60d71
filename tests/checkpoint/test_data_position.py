"""The data position is global: a run resumed at another dp world size neither repeats nor skips."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler

from deepshard.finetune.data.resumable import OffsetSampler, ResumableStream

N = 103  # not a multiple of any global batch: exercises the dropped tail


class Ids(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor([i])}


def _streams(world: int, mbs: int, state=None) -> list[ResumableStream]:
    out = []
    for r in range(world):
        s = ResumableStream(Ids(), dp_rank=r, dp_size=world, micro_batch_size=mbs, seed=7)
        if state is not None:
            s.load_state_dict(state)
        out.append(s)
    return out


def _step(streams) -> list[int]:
    return [int(i) for s in streams for i in next(s)["input_ids"].flatten()]


def test_matches_distributed_sampler_from_the_start():
    for r in range(3):
        ours = OffsetSampler(N, rank=r, world=3, seed=7)
        ref = DistributedSampler(Ids(), num_replicas=3, rank=r, shuffle=True, seed=7, drop_last=True)
        assert list(ours) == list(ref)


@pytest.mark.parametrize("new_world,new_mbs", [(1, 8), (4, 2), (3, 3)])
def test_resume_at_another_world_size_neither_repeats_nor_skips(new_world, new_mbs):
    before = _streams(2, 4)
    seen = []
    for _ in range(5):
        seen += _step(before)
    state = before[0].state_dict()
    assert state == before[1].state_dict() == {"epoch": 0, "consumed": 40, "seed": 7, "num_samples": N}
    after = _streams(new_world, new_mbs, state)
    while after[0].epoch == 0:
        step = _step(after)
        if after[0].epoch == 0:
            seen += step
    assert len(seen) == len(set(seen))  # nothing twice
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(7)).tolist()
    gb = new_world * new_mbs
    expected = perm[: 40 + (N - 40) // gb * gb]
    assert sorted(seen) == sorted(expected)  # exactly the permutation's prefix: nothing skipped


def test_epochs_roll_over_and_reshuffle():
    (s,) = _streams(1, 10)
    first = [_step([s]) for _ in range(10)]
    assert s.state_dict()["epoch"] == 0
    second = _step([s])
    assert s.state_dict() == {"epoch": 1, "consumed": 10, "seed": 7, "num_samples": N}
    assert second != first[0]


def test_other_data_is_refused():
    (s,) = _streams(1, 4)
    with pytest.raises(ValueError, match="num_samples=50"):
        s.load_state_dict({"epoch": 0, "consumed": 8, "seed": 7, "num_samples": 50})
