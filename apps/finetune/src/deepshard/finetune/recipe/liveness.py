"""The train loop's side of the hang watchdog: every profiled phase is a heartbeat mark."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from deepshard.launch.heartbeat import Heartbeat


class BeatingProfiler:
    """Wraps the run's StepProfiler: ``phase(name)`` marks the heartbeat, then profiles as before."""

    def __init__(self, prof: Any, beat: Heartbeat) -> None:
        self._prof = prof
        self._beat = beat

    def phase(self, name: str) -> AbstractContextManager[None]:
        self._beat.mark(name, self._beat.step)
        return self._prof.phase(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._prof, name)
