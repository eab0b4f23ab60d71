"""Who owns an import's ``step-N.tmp-import``: from_deepspeed marks it with core's owner record (host, pid)
from the moment it exists, so a rerun tells a killed import's leftover (removed) from a live one (named)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from deepshard.core.checkpoint.owners import owner_alive, write_owner


def claim(tmp: Path) -> None:
    """Make ``tmp`` this import's, marked with its owner (host, pid) from the moment it exists (made
    aside and renamed into place).  A leftover of a dead import (a kill leaves no chance to clean up) is
    removed with a notice; one whose importer still runs is named, never touched: two imports into one
    OUT_DIR would write the same files.  Anything else at ``tmp`` (a symlink, dangling or not; a file) is
    named and left alone."""
    for _ in range(3):
        if tmp.is_symlink() or (tmp.exists() and not tmp.is_dir()):  # not an import's: never followed, removed
            kind = "a symlink" if tmp.is_symlink() else "not a directory"
            raise ValueError(f"{tmp}: is {kind}, not an import's temp dir; it was left alone (move or remove it, "
                             "then run again)")
        if tmp.exists():
            alive, who = owner_alive(tmp)
            if alive:
                raise ValueError(f"{tmp}: another import is writing it ({who}, still running); wait for it "
                                 f"to finish or stop it, then run again")
            print(f"notice: removing the partial import {tmp} (its importer, {who}, is not running)", file=sys.stderr)
            shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        aside = tmp.parent / f".{tmp.name}.{os.getpid()}"
        aside.mkdir()
        try:
            write_owner(aside)
        except BaseException:  # a full disk: nothing of this import stays
            shutil.rmtree(aside, ignore_errors=True)
            raise
        try:
            os.rename(aside, tmp)  # fails if another import made tmp meanwhile: look at its owner again
            return
        except OSError:
            shutil.rmtree(aside, ignore_errors=True)
    raise ValueError(f"{tmp}: another import keeps creating it; run one import into {tmp.parent} at a time")
