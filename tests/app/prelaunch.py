"""The app's pre-launch checks, run in this process: what ``python apps/finetune/main.py OVERRIDES``
does before it starts a worker (compose, prepare, validate, model files, data fit), without paying a
fresh interpreter per bad input.  main.py turns the ValueError into ``error: ...`` and exit 2; a few
CLI cases (tests/app/test_bad_inputs.py, tests/app/test_config.py) prove that part for real.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

CONF = Path(__file__).resolve().parents[2] / "conf"


def prelaunch_error(overrides: list[str], run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The one line main.py would print for ``overrides``; fails the test if a worker would start."""
    from deepshard.finetune import app
    from deepshard.finetune.config import register

    def no_worker(*args, **kwargs):
        raise AssertionError(f"the checks passed and a worker would start for {overrides}")

    monkeypatch.setattr(app, "launch_local", no_worker)
    monkeypatch.setattr(app, "train_worker", no_worker)
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    with pytest.raises(ValueError) as err:
        app.run(cfg, str(run_dir))
    line = f"error: {err.value}"
    assert "\n" not in line, line  # one line
    assert not (run_dir / "heartbeat").exists() and not (run_dir / "tensorboard").exists()  # nothing started
    return line
