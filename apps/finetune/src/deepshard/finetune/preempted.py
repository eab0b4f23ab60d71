"""What a preemption left on disk, as the one line the app prints when its launcher was signalled.

On SIGTERM/SIGINT to the launcher, torchelastic passes the signal on to the workers (they finish the
step and save it: ``recipe.checkpointing.Preemption``) and SIGKILLs them ``launcher.shutdown_grace_s``
later; their results never come back.  So the line is read from what is there: the step the workers
had reached and whether they ended by themselves (their heartbeat files: phase ``done``), against the
newest sealed checkpoint (its manifest present, every file at its recorded size: what
``checkpoint.resume=auto`` takes, which then also checks the checksums).  "saved step N" is said only
when step N is sealed; otherwise the line says what a rerun resumes from.  Exit 1 when the grace cut the
save short (workers killed before their run ended: the work since that checkpoint is lost); exit 0 when
the workers ended by themselves, as when only they were signalled: saved, or not saved on purpose (a
non-finite state is never saved) or by a failed save they reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from deepshard.core.checkpoint.manifest import TEMP_DIR, latest_good, step_dirs
from deepshard.core.checkpoint.retention import temp_dirs


@dataclass(frozen=True)
class Preempted:
    """The preemption's line; ``cut_short``: the workers were killed before their run ended (exit 1)."""

    line: str
    cut_short: bool
    checkpoint: Path | None  # what a rerun with checkpoint.resume=auto starts from


def _newest_sealed(root: Path) -> tuple[Path | None, int]:
    path, _ = latest_good(root, checksums=False)
    step = next((c.step for c in step_dirs(root) if c.path == path), 0) if path is not None else 0
    return path, step


def preemption_outcome(root: Path, beats: list[dict], *, signal_name: str, grace_s: int) -> Preempted:
    """The line for a launcher that was signalled (``signal_name``), from the checkpoint dir ``root`` and
    the workers' last heartbeats ``beats``; ``grace_s`` is ``launcher.shutdown_grace_s``."""
    path, sealed_step = _newest_sealed(root)
    rerun = (f"a rerun with checkpoint.resume=auto resumes from step {sealed_step} ({path})" if path is not None
             else f"a rerun starts at step 0 (no sealed checkpoint under {root})")
    started = [b for b in beats if b["phase"] != "startup"]
    if not started:  # no step begun: nothing of this run to lose
        return Preempted(f"preempted ({signal_name}) before the first step; {rerun}", False, path)
    step = max(int(b["step"]) for b in started)
    if path is not None and sealed_step == step:
        return Preempted(f"preempted ({signal_name}): saved step {step} ({path}, sealed): rerun with "
                         f"checkpoint.resume=auto to continue from it", False, path)
    cut = [p for p, _, _ in temp_dirs(root) if ".tmp-" in p.name and int(TEMP_DIR.match(p.name)[1]) > sealed_step]
    killed = any(b["phase"] != "done" for b in beats)  # they never ended their run
    if killed:
        left = f" (the partial {cut[-1].name} is left)" if cut else ""
        why = (f"its save was cut short: the workers were killed launcher.shutdown_grace_s={grace_s} s after the "
               f"signal, with a save unfinished{left}")
    else:
        why = "the workers ended without saving it (their log says why)"
    return Preempted(f"preempted ({signal_name}) at step {step}: step {step} was not saved: {why}; {rerun}",
                     killed, path)
