"""Retention: which directories of ``checkpoint.dir`` a run may remove or set aside, and which stay.

What a run may remove is only what its saves made: temp dirs named exactly
``step-NNNNNNNN.{tmp,init,old}-XXXXXXXX`` (8 hex digits) holding the ``.owner.json`` marker a save
writes into them, ``step-NNNNNNNN`` checkpoints with a deepshard manifest, and the checkpoints
:func:`set_aside` renamed ``abandoned-step-NNNNNNNN-<time>`` (with their manifest) but the newest of
them, which stays for a look at what went wrong.  Anything else in the
checkpoint dir (a user's folder whose name merely contains ``.tmp-``, a look-alike without the
marker) is never removed; one in the way of a save is named in its error.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from deepshard.core.checkpoint.manifest import (
    TEMP_DIR,
    CheckpointError,
    is_checkpoint,
    step_dirs,
    verify_checkpoint,
)
from deepshard.core.checkpoint.owners import OWNER, owner_alive

log = logging.getLogger("deepshard.checkpoint")

SET_ASIDE = re.compile(r"^abandoned-step-(\d{8,})-(\d{8}T\d{6})(?:-(\d+))?$")  # exactly the names set_aside gives


def _named_like_temp(root: str | os.PathLike) -> list[tuple[Path, bool]]:
    """``(path, marked)`` for each real directory under ``root`` named exactly like a save's temp dir."""
    root = Path(root)
    if not root.is_dir():
        return []
    return [(p, (p / OWNER).is_file() and not (p / OWNER).is_symlink()) for p in sorted(root.iterdir())
            if TEMP_DIR.match(p.name) and p.is_dir() and not p.is_symlink()]


def temp_dirs(root: str | os.PathLike) -> list[tuple[Path, bool, str]]:
    """``(path, owner alive, owner)`` for every temp dir our saves made under ``root`` (exact name and
    the ``.owner.json`` marker): unfinished saves (``.init-``, ``.tmp-``) and replaced ones (``.old-``)."""
    return [(p, *owner_alive(p)) for p, marked in _named_like_temp(root) if marked]


def _what(p: Path) -> str:
    return "a replaced save" if ".old-" in p.name else "an unfinished save"


def remove_dead_temp_dirs(root: str | os.PathLike) -> list[str]:
    """Remove the temp dirs of dead saves (leaving live concurrent ones); one line for each seen, and
    for each look-alike without our marker (left alone: no save of ours made it)."""
    lines = []
    for p, marked in _named_like_temp(root):
        if not marked:
            lines.append(f"{p.name} is named like a save's temp dir but has no {OWNER}, so no deepshard save "
                         f"made it: left in place")
            continue
        alive, owner = owner_alive(p)
        if alive:
            lines.append(f"{p.name} is {_what(p)} still being written ({owner}): skipped, left in place")
        else:
            shutil.rmtree(p, ignore_errors=True)
            lines.append(f"{p.name} is {_what(p)} of a dead run ({owner}): skipped and removed")
    return lines


def set_aside(root: str | os.PathLike, newer_than: int) -> list[tuple[Path, Path]]:
    """Rename every ``step-N`` with ``N > newer_than`` to ``abandoned-step-N-<time>``.

    A run that resumes at an older step abandons the branch those belong to; renamed, they stay
    for inspection but ``resume=auto`` and retention never take them for this run's newest.
    """
    stamp = time.strftime("%Y%m%dT%H%M%S")
    moved = []
    for cand in step_dirs(root):
        if cand.step > newer_than and is_checkpoint(cand.path):  # a user's look-alike folder stays as it is
            dst = cand.path.with_name(f"abandoned-{cand.path.name}-{stamp}")
            n = 1
            while dst.exists():
                dst = cand.path.with_name(f"abandoned-{cand.path.name}-{stamp}-{n}")
                n += 1
            os.replace(cand.path, dst)
            moved.append((cand.path, dst))
    return moved


def set_aside_dirs(root: str | os.PathLike) -> list[Path]:
    """The checkpoints :func:`set_aside` renamed under ``root`` (exact name and a deepshard manifest),
    the most recently set aside first (by the time in the name, then by the rename's ctime)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = SET_ASIDE.match(p.name)
        if m and is_checkpoint(p):  # a user's look-alike folder is never ours
            found.append(((m.group(2), p.stat().st_ctime_ns, int(m.group(3) or 0), int(m.group(1))), p))
    return [p for _, p in sorted(found, reverse=True)]


def _verifies(path: Path) -> bool:
    try:
        verify_checkpoint(path)
    except CheckpointError:
        return False
    return True


def prune(root: str | os.PathLike, keep_last: int, *, keep: Iterable[str | os.PathLike] = (),
          is_good: Callable[[Path], bool] = _verifies) -> list[Path]:
    """Keep the newest ``keep_last`` checkpoints that verify (0 keeps all); remove older ones, the
    checkpoints set aside but the newest one (:func:`set_aside_dirs`) and the temp dirs of dead
    saves, logging each.

    ``keep`` (the checkpoint just written) is never removed and counts as good.  A checkpoint that
    fails ``is_good`` does not count: one newer than the ``keep_last``-th good one stays (for a
    look), so a corrupt newest checkpoint can never push out the last good one.  Only our own
    checkpoints (a deepshard manifest) and temp dirs (see :func:`temp_dirs`) are ever removed.
    """
    root = Path(root)
    kept = {Path(p).resolve() for p in keep}
    removed = []
    if keep_last > 0:
        good = 0
        for cand in step_dirs(root):
            if cand.path.resolve() in kept:
                good += 1
            elif not is_checkpoint(cand.path):
                continue  # not a save of ours (no deepshard manifest): never counted, never removed
            elif good >= keep_last:
                shutil.rmtree(cand.path, ignore_errors=True)
                removed.append(cand.path)
                log.info("checkpoint: removed %s (retention keeps the newest %d good ones)", cand.path, keep_last)
            elif is_good(cand.path):
                good += 1
        for p in set_aside_dirs(root)[1:]:  # each fallback past a corrupt newest adds one: they never piled up
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
            log.info("checkpoint: removed %s (retention keeps only the newest checkpoint set aside)", p)
    for p, alive, owner in temp_dirs(root):
        if not alive:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
            log.warning("checkpoint: removed %s, %s of a dead run (%s)", p, _what(p), owner)
    return removed
