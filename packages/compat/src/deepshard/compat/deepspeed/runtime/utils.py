"""``deepspeed.runtime.utils``: ``set_random_seed`` (DeepSpeed 0.19's, verbatim in meaning)."""

from __future__ import annotations

import random

import torch

from ..utils import RepeatingLoader

__all__ = ["RepeatingLoader", "set_random_seed"]


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, numpy's global generator and torch (DeepSpeed's three)."""
    import numpy

    random.seed(seed)
    numpy.random.seed(seed % (2**32))
    torch.manual_seed(seed % (2**63))
