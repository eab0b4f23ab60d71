"""Resume equality (stages 0-3, world 2, fp32) and resharding: a checkpoint saved at (world 2,
stage 2, activation checkpointing on) resumes at (world 1, stage 3) and (world 4, stage 1)."""

from __future__ import annotations

import pytest

from tests.checkpoint.ckpt_harness import SPLIT, STEPS, reshard_worker


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_gives_identical_losses(world2, stage):
    out, _ = world2
    r = out[stage]
    assert len(r["resumed"]) == STEPS
    assert r["resumed"] == r["straight"]  # bit-identical: same world size, same order of operations
    assert r["app"] == {"step": SPLIT}
    assert r["num_updates"] == STEPS  # the LR schedule position came back


def test_bf16_checkpoint_holds_fp32_masters_that_an_fp32_run_resumes(world2):
    out, _ = world2
    assert out["bf16_keys_match"]
    assert out["bf16_to_fp32_max_diff"] == 0.0


def test_offloaded_stores_checkpoint_like_device_ones(world2):
    out, _ = world2
    diffs = [abs(a - b) for a, b in zip(out["offload"], out[2]["straight"])]
    assert len(out["offload"]) == STEPS and max(diffs) < 1e-5, diffs


@pytest.mark.parametrize("world,stage", [(1, 3), (4, 1)])
def test_reshard_to_other_world_size_and_stage(world2, world, stage, gloo_pool):
    out, root = world2
    path = root / "stage2" / f"step-{SPLIT:08d}"
    loss, num_updates = gloo_pool(world).run(reshard_worker, str(path), stage)[0]
    assert num_updates == SPLIT + 1
    assert abs(loss - out[2]["straight"][SPLIT]) < 1e-5, (loss, out[2]["straight"][SPLIT])
