"""Gradient shards that are final while backward still runs, handed to the state store early.

ZeRO-2 knows each reduced shard is final as soon as its bucket lands on the accumulation boundary;
handing it over then lets offload start the device->host copy while backward continues.  A stage
(its reducer) gets a ``GradHandoff`` when it is built; the optimizer binds it to the store once
the store exists (the store is built from the stage's local params, so it comes second).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["GradHandoff"]

GradSink = Callable[[int, torch.Tensor], None]


class GradHandoff:
    """``handoff(index, grad)`` passes a final gradient shard on and records ``index``; until bound,
    nothing is passed (the optimizer then hands every gradient over at step time)."""

    def __init__(self) -> None:
        self._sink: GradSink | None = None
        self._offset = 0
        self.indices: set[int] = set()  # local indices handed over since the last clear()

    def bind(self, sink: GradSink, *, offset: int = 0) -> None:
        """Send to ``sink``, at ``offset + index`` (a pipeline rank's stage modules share one store)."""
        self._sink, self._offset = sink, offset

    def __call__(self, index: int, grad: torch.Tensor) -> None:
        if self._sink is not None:
            self._sink(self._offset + index, grad)
            self.indices.add(index)

    def clear(self) -> None:
        self.indices = set()
