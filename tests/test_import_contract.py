"""design.md's package boundaries, enforced with import-linter (contracts in pyproject.toml):
kernels imports no other deepshard package; core imports neither offload, pipeline nor the app;
offload and pipeline use core's public API only; nothing imports the app; Hydra/OmegaConf only
in the app."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    proc = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "5 kept, 0 broken" in proc.stdout, proc.stdout[-2000:]
