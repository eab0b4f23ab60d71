"""torchelastic stops the survivors of a failed worker group (a worker died or raised) with a fixed
30-s grace: SIGTERM, then SIGKILL to those still alive 30 s later.  Its process contexts do it in
``_poll`` as soon as they see the failure: for functions (``launch_local``'s workers) torch's
``ProcessContext.join`` without a ``grace_period``, for scripts (the ``deepshard`` command's nodes)
``PContext.close()`` with its default; neither the agent's ``shutdown_timeout`` nor a launcher
setting reaches them.

A survivor of a failed group has nothing left to finish: every collective it could enter has a dead
peer, and a checkpoint it began cannot be sealed without the dead rank's part.  A survivor that saw
its peer go exits within about a second (``local._PEER_GRACE_S``); one that waits on something of its
own (a stalled writer, a hung filesystem) held the whole job, or the node's restart, for 30 s.

:func:`stop_failed_groups_within` makes both defaults ``seconds`` in all (``join`` waits half of it
for the survivors to leave by themselves, then SIGTERMs them and waits the other half).  Every other
stop names its own grace and keeps it: a signalled launcher's (``shutdown_timeout``: the grace a
preemption's save gets), and the agent's stop of a healthy group for a membership change (torch's
30 s).  Only the defaults of torch 2.13's ``PContext.close`` and ``ProcessContext.join`` change; if
torch renames or reshapes them, nothing does (tests/launch/test_failed_group_stop.py then fails).
"""

from __future__ import annotations

import inspect
from typing import Any

FAILED_GROUP_GRACE_S = 5  # a survivor's own exit after a lost peer takes ~1 s
replaced: dict[str, Any] = {}  # torch's own methods, once replaced


def _torchs(owner: type, name: str, params: list[str]) -> Any:
    """torch's own ``owner.name`` (also after it was replaced), or None where its signature changed."""
    method = replaced.get(name, getattr(owner, name, None))
    return method if callable(method) and list(inspect.signature(method).parameters) == params else None


def stop_failed_groups_within(seconds: float = FAILED_GROUP_GRACE_S) -> bool:
    """Make torchelastic SIGKILL a failed group's survivors at most ``seconds`` after the failure; True
    where it could."""
    from torch.distributed.elastic.multiprocessing.api import PContext
    from torch.multiprocessing.spawn import ProcessContext

    close = _torchs(PContext, "close", ["self", "death_sig", "timeout"])
    join = _torchs(ProcessContext, "join", ["self", "timeout", "grace_period"])
    if close is None or join is None:
        return False
    replaced.update(close=close, join=join)

    def close_failed(self: PContext, death_sig: Any = None, timeout: float = seconds) -> None:
        close(self, death_sig, timeout)

    def join_failed(self: ProcessContext, timeout: float | None = None, grace_period: float | None = seconds / 2) -> bool:
        return join(self, timeout, grace_period)

    close_failed.__doc__, join_failed.__doc__ = close.__doc__, join.__doc__
    PContext.close, ProcessContext.join = close_failed, join_failed
    return True
