"""Which ``checkpoint-N/`` directories a Trainer run keeps, and which one it resumes from.

transformers' rotation keeps the newest ``save_total_limit`` directories named ``checkpoint-*``,
whatever is in them: a save that died half-way, or one whose shards rotted, counts as kept and
pushes out the last good one; a user's folder that happens to be named ``checkpoint-7`` is deleted.
Here, with deepshard's retention rules (``deepshard.core.checkpoint.retention``): a checkpoint
counts only when it verifies (transformers' ``trainer_state.json``, written last, reads back with
its step, and the engine's sharded state passes its manifest's sizes and crc32s); one that does
not verify and is newer than the last kept good one stays for a look; only our own
``checkpoint-N`` directories (holding a deepshard engine checkpoint) are ever removed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

from deepshard.core.checkpoint.manifest import CheckpointError, is_checkpoint, step_dirs, verify_checkpoint

log = logging.getLogger("deepshard.compat.transformers")

CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
LATEST, TRAINER_STATE = "latest", "trainer_state.json"


def checkpoint_dirs(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(N, path)`` of every real directory named exactly ``checkpoint-N``, newest first."""
    root = Path(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := CHECKPOINT_DIR.match(p.name)) and p.is_dir() and not p.is_symlink()]
    return sorted(found, reverse=True)


def _engine_dir(path: Path) -> Path | None:
    """The engine's tag directory that ``latest`` names inside ``path`` (None when there is none)."""
    latest = path / LATEST
    if latest.is_symlink() or not latest.is_file():
        return None
    try:
        tag = latest.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not tag or "/" in tag or tag in (".", ".."):
        return None
    tag_dir = path / tag
    return tag_dir if tag_dir.is_dir() and not tag_dir.is_symlink() else None


def is_ours(path: Path) -> bool:
    """A ``checkpoint-N`` that deepshard's Trainer wrote: its ``latest`` names an engine checkpoint
    with a deepshard manifest (sound or not).  Nothing else is ever removed."""
    tag_dir = _engine_dir(path)
    return tag_dir is not None and any(is_checkpoint(c.path) for c in step_dirs(tag_dir))


def problem(path: Path, step: int) -> str | None:
    """Why ``checkpoint-N`` cannot be resumed from (None when it verifies)."""
    try:
        state = json.loads((path / TRAINER_STATE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"{TRAINER_STATE} unreadable, so the save never finished ({err})"
    if not isinstance(state, dict) or state.get("global_step") != step:
        return f"{TRAINER_STATE} is not step {step}'s"
    tag_dir = _engine_dir(path)
    if tag_dir is None:
        return f"no engine state ({LATEST} names no global_stepN/ inside)"
    steps = step_dirs(tag_dir)
    if not steps:
        return f"{tag_dir.name}/ holds no engine checkpoint"
    try:
        verify_checkpoint(steps[0].path)
    except CheckpointError as err:
        return str(err)
    return None


def rotate(run_dir: str | os.PathLike, limit: int, *, keep: str | os.PathLike,
           protect: Iterable[str | os.PathLike | None] = ()) -> list[Path]:
    """Keep the newest ``limit`` checkpoints that verify (``keep``, the one just written, counts as
    good); remove our older ones; leave anything newer than the ``limit``-th good one, and every
    directory that is not ours, in place.  Returns what was removed."""
    if not limit or limit <= 0:
        return []
    kept = {Path(keep).resolve()} | {Path(p).resolve() for p in protect if p}
    good, removed = 0, []
    for step, path in checkpoint_dirs(run_dir):
        if path.resolve() in kept:
            good += path.resolve() == Path(keep).resolve() or problem(path, step) is None
        elif not is_ours(path):
            continue  # a user's folder (or a save of another tool): never counted, never removed
        elif good >= limit:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            log.info("checkpoint: removed %s (save_total_limit=%d keeps the newest good ones)", path, limit)
        elif (why := problem(path, step)) is None:
            good += 1
        else:
            log.warning("checkpoint: %s does not verify (%s): not counted by save_total_limit, left in place",
                        path, why)
    return removed


def newest_good(run_dir: str | os.PathLike) -> Path | None:
    """The newest ``checkpoint-N`` that verifies (``resume_from_checkpoint=True``), logging each newer
    one that was passed over and why."""
    for step, path in checkpoint_dirs(run_dir):
        why = problem(path, step) if is_ours(path) else "not a deepshard checkpoint"
        if why is None:
            return path
        log.warning("resume_from_checkpoint=True: %s skipped: %s", path, why)
    return None
