"""One world-2 launch serves every test that needs a real multi-rank checkpoint."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def world2(tmp_path_factory):
    """``(results, root)``: resume runs for stages 0-3 at world 2 and the checkpoints they left."""
    from deepshard.launch.local import launch_local
    from tests.checkpoint.ckpt_harness import resume_worker

    root = tmp_path_factory.mktemp("ckpt")
    return launch_local(resume_worker, 2, str(root))[0], root
