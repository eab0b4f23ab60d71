"""Faults at events, for the chaos soak (``bench/bench_chaos.py``): test and bench use only.

Active only when ``DEEPSHARD_CHAOS_PLAN`` names a plan file (JSON: ``{"faults": [...], "fill": PATH,
"pause_s": S}``); unset, every function here is a no-op.  The workers report three events: the start
of a step (``step``), the first bytes a save writes (``save``: the save is under way) and the load of
a checkpoint (``load``).  A fault whose event, step and rank match fires once in the whole run (a
marker file claimed with O_EXCL, so replayed steps after a resume do not fire it again) and appends
its line, phase included, to ``events.jsonl`` beside the plan; then the worker does its part:

- ``sigkill``, ``load_kill``: SIGKILL itself;  ``sigstop``: SIGSTOP itself (a hang for the watchdog);
- ``corrupt``: hold the next resume, then SIGKILL itself (the harness corrupts the newest checkpoint
  while the job is down, then releases the hold);
- ``enospc``: hold the next resume and fill the checkpoint disk mid-save (the harness frees it);
- ``sigterm_async``, ``launcher_kill``: pause ``pause_s`` while the harness signals the job.

A ``load`` fault fires at the first load on its rank after the fault it names (``after``) fired: a
failure during the recovery from another one.  Each resume also notes the step it resumed from.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

PLAN_ENV = "DEEPSHARD_CHAOS_PLAN"
KINDS = ("sigkill", "sigstop", "enospc", "corrupt", "sigterm_async", "launcher_kill", "load_kill")
HOLD = "hold"  # while this file exists beside the plan, a resume waits (the harness is fixing the disk)
HOLD_LIMIT_S = 300.0


class Chaos:
    """One worker's view of the plan."""

    def __init__(self, plan_path: str, rank: int) -> None:
        self.dir = Path(plan_path).parent
        plan = json.loads(Path(plan_path).read_text())
        self.faults: list[dict[str, Any]] = plan["faults"]
        self.fill = plan.get("fill")
        self.pause_s = float(plan.get("pause_s", 5.0))
        self.rank = rank
        self.saving: int | None = None  # the step whose save is under way, until its first bytes

    def event(self, phase: str, step: int) -> None:
        for fault in self.faults:
            if fault["phase"] != phase or fault["rank"] != self.rank:
                continue
            if phase == "load":
                if not (self.dir / f"fired-{fault['after']}").exists():
                    continue
            elif fault["step"] != step:
                continue
            if self._claim(fault["id"]):
                self.note("fault", step, id=fault["id"], kind=fault["kind"], phase=phase, rank=self.rank)
                self._act(fault["kind"])

    def _claim(self, fault_id: int) -> bool:
        try:
            os.close(os.open(self.dir / f"fired-{fault_id}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False

    def note(self, what: str, step: int, **fields: Any) -> None:
        """One line in ``events.jsonl`` (one O_APPEND write: lines of several processes never mix)."""
        line = json.dumps({"event": what, "step": step, "pid": os.getpid(), "time": time.time(), **fields})
        fd = os.open(self.dir / "events.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            os.write(fd, (line + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def _act(self, kind: str) -> None:
        if kind in ("sigkill", "load_kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "corrupt":
            (self.dir / HOLD).touch()
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "enospc":
            (self.dir / HOLD).touch()
            fill_disk(self.fill)
        else:  # sigterm_async, launcher_kill: the harness signals the job meanwhile
            time.sleep(self.pause_s)

    def wait_hold(self) -> None:
        deadline = time.monotonic() + HOLD_LIMIT_S
        while (self.dir / HOLD).exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def fill_disk(path: str | None) -> None:
    """Write zeros to ``path`` until its file system is full (ENOSPC), as another job's files would."""
    assert path, "an enospc fault needs the plan's 'fill' path"
    chunk = bytes(1 << 20)
    with open(path, "ab", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise


_lock = threading.Lock()
_state: dict[str, Chaos | None] = {}


def active(env: Mapping[str, str] | None = None) -> Chaos | None:
    """This process's hooks (None unless ``DEEPSHARD_CHAOS_PLAN`` is set)."""
    with _lock:
        if "chaos" not in _state:
            plan = (env if env is not None else os.environ).get(PLAN_ENV, "")
            _state["chaos"] = Chaos(plan, int(os.environ.get("RANK", "0"))) if plan else None
        return _state["chaos"]


def step_hooks(env: Mapping[str, str]) -> list[Callable[[int, Any], None]]:
    """The training loop's step hook for ``step`` faults (none unless the plan is set)."""
    chaos = active(env)
    return [] if chaos is None else [lambda step, model: chaos.event("step", step)]


def listener(inner: Callable[[int], None]) -> Callable[[int], None]:
    """Wrap a save-progress listener: the first bytes of an armed save are the ``save`` event."""
    chaos = active()
    if chaos is None:
        return inner

    def listen(nbytes: int) -> None:
        inner(nbytes)
        step, chaos.saving = chaos.saving, None
        if step is not None:
            chaos.event("save", step)

    return listen


def saving(step: int) -> None:
    """A save of ``step`` starts: its first written bytes will fire the ``save`` faults."""
    if (chaos := active()) is not None:
        chaos.saving = step


def before_resume() -> None:
    """Wait while the harness holds resumes (a disk being freed, a checkpoint being corrupted)."""
    if (chaos := active()) is not None:
        chaos.wait_hold()


def loading(path: Path) -> None:
    """About to load the checkpoint at ``path``: the ``load`` event."""
    if (chaos := active()) is not None:
        name = path.name
        step = int(name.split("-")[-1]) if name.startswith("step-") and name.split("-")[-1].isdigit() else -1
        chaos.event("load", step)


def resumed(step: int) -> None:
    """Rank 0 notes the step a launch or restart resumed from (0: fresh)."""
    if (chaos := active()) is not None and chaos.rank == 0:
        chaos.note("resumed", step)
