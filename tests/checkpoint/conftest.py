"""One world-2 launch serves every test that needs a real multi-rank checkpoint."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def world2(tmp_path_factory, gloo_pool):
    """``(results, root)``: resume runs for stages 0-3 at world 2 and the checkpoints they left."""
    from tests.checkpoint.ckpt_harness import resume_worker

    root = tmp_path_factory.mktemp("ckpt")
    return gloo_pool(2).run(resume_worker, str(root))[0], root
