"""design.md's package boundaries, enforced with import-linter (contracts in pyproject.toml): kernels
imports no other deepshard package; core imports neither offload, pipeline, launch, compat nor the
app; offload and pipeline use core's public API only; nothing (compat and launch included) imports
the app; launch imports no training package; Hydra/OmegaConf only in the app."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*sorted((ROOT / "packages").glob("*/src")), ROOT / "apps/finetune/src"]
CONTRACTS = 6


def _lint(env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    return subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env=env)


def test_import_contracts_are_kept():
    proc = _lint()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"{CONTRACTS} kept, 0 broken" in proc.stdout, proc.stdout[-2000:]


def test_a_planted_violation_breaks_its_contract(tmp_path):
    """A copy of the sources where compat imports the app and core imports launch: both are caught."""
    roots = []
    for i, src in enumerate(SOURCES):
        dst = tmp_path / f"src{i}"
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
        roots.append(str(dst))
    planted = {"deepshard/compat/planted.py": "from deepshard.finetune import faults  # noqa\n",
               "deepshard/core/planted.py": "import deepshard.launch.heartbeat  # noqa\n"}
    for rel, text in planted.items():
        target = next(Path(r) / rel for r in roots if (Path(r) / rel).parent.is_dir())
        target.write_text(text)
    proc = _lint({**os.environ, "PYTHONPATH": os.pathsep.join(roots)})
    assert proc.returncode != 0, proc.stdout[-3000:]
    out = proc.stdout
    assert f"{CONTRACTS - 2} kept, 2 broken" in out, out[-3000:]
    assert "deepshard.compat.planted -> deepshard.finetune" in out and "deepshard.core.planted -> deepshard.launch" in out
