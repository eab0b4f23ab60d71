"""The real app (world 2, tiny model) with a checkpoint dir that also holds the user's own folders,
then resumed with another architecture.

Folders whose names merely contain ``.tmp-``, ``.init-`` or ``.old-`` (and a look-alike of a save's
temp dir without its marker) survive a run and its retention; resuming a 3-layer checkpoint with
``model.n_layers=2`` ends with one ``error:`` line naming the first key the run's model lacks.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deepshard.core.checkpoint.manifest import step_dirs, verify_checkpoint
from tests.app_runner import run_main
from tests.finetune_app.app_harness import TINY

pytestmark = pytest.mark.slow
USER_DIRS = ("project.tmp-notes", "photos.old-2023", "build.init-cache", "plain", "step-00000009.tmp-0123abcd")


def _run(cwd: Path, *overrides: str, timeout: int = 240) -> tuple[int, str, str]:
    proc = run_main([*TINY, "+zero=stage3", *overrides, f"hydra.run.dir={cwd / 'run'}"], cwd=cwd, timeout=timeout,
                    env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return proc.returncode, proc.stdout + proc.stderr, proc.stderr


def test_user_folders_survive_and_another_architecture_is_refused_in_one_line(tmp_path):
    root = tmp_path / "X"
    for name in USER_DIRS:
        (root / name).mkdir(parents=True)
        (root / name / "keep.txt").write_text(name)
    code, out, _ = _run(tmp_path, "model.n_layers=3", "train.max_steps=2", "checkpoint.every_steps=1",
                        "checkpoint.keep_last=1", f"checkpoint.dir={root}")
    assert code == 0, out[-3000:]
    for name in USER_DIRS:
        assert (root / name / "keep.txt").read_text() == name, (name, out[-3000:])
    assert [c.step for c in step_dirs(root)] == [2]  # retention removed this run's step 1, and only it
    verify_checkpoint(root / "step-00000002")
    assert sorted(p.name for p in root.iterdir()) == sorted([*USER_DIRS, "step-00000002"])

    code, out, err = _run(tmp_path, "model.n_layers=2", "train.max_steps=3", f"checkpoint.dir={root}")
    assert code != 0
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and err.rstrip().splitlines()[-1] == errors[0], err[-3000:]
    assert f"checkpoint {str(root / 'step-00000002')!r} holds model.layers.2." in errors[0], errors[0]
    assert "which this run's model does not have" in errors[0]
    for name in USER_DIRS:
        assert (root / name / "keep.txt").read_text() == name
