"""Issue 45: what ``.deepshard.lock`` (and the launcher's other files in a run dir) may be.  A planted
symlink, directory or FIFO is refused with one line and left alone (a link was followed: its target
overwritten).  Single process: real links, a real FIFO."""

from __future__ import annotations

import logging
import os
import re

import pytest

from deepshard.launch.heartbeat import Heartbeat
from deepshard.launch.local import _elastic_logs_to
from deepshard.launch.run_lock import LOCK_NAME, acquire


def _refusal(path, kind: str) -> str:
    return rf"^{re.escape(str(path))}: is {kind}, not a regular file; "


def test_a_lock_path_that_is_a_link_a_directory_or_a_fifo_is_refused_and_left_alone(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).symlink_to(target)
    with pytest.raises(ValueError, match=_refusal(run / LOCK_NAME, "a symlink")) as err:
        acquire(run, key="hydra.run.dir")
    assert "\n" not in str(err.value)
    assert target.read_text() == "keep me\n" and (run / LOCK_NAME).is_symlink()  # not written, not removed
    (tmp_path / "d" / LOCK_NAME).mkdir(parents=True)
    with pytest.raises(ValueError, match=_refusal(tmp_path / "d" / LOCK_NAME, "a directory")):
        acquire(tmp_path / "d", key="checkpoint.dir")
    (tmp_path / "f").mkdir()
    os.mkfifo(tmp_path / "f" / LOCK_NAME)
    with pytest.raises(ValueError, match=_refusal(tmp_path / "f" / LOCK_NAME, "a FIFO")):
        acquire(tmp_path / "f", key="checkpoint.dir")


def test_launcher_log_and_heartbeats_are_never_written_through_a_link(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    (tmp_path / "launcher.log").symlink_to(target)
    with pytest.raises(ValueError, match=_refusal(tmp_path / "launcher.log", "a symlink")), \
            _elastic_logs_to(str(tmp_path / "launcher.log")):
        logging.getLogger("torch.distributed.elastic").error("a worker failed")
    (tmp_path / "rank0.json").symlink_to(target)
    with pytest.raises(ValueError, match=_refusal(tmp_path / "rank0.json", "a symlink")):
        Heartbeat(str(tmp_path), 0)
    os.mkfifo(tmp_path / "rank1.json")  # opened for writing, a FIFO without a reader would block forever
    with pytest.raises(ValueError, match=_refusal(tmp_path / "rank1.json", "a FIFO")):
        Heartbeat(str(tmp_path), 1)
    assert target.read_text() == "keep me\n"
