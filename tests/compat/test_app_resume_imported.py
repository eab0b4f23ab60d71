"""``checkpoint.resume=OUT_DIR`` in the app, of a real DeepSpeed 0.19.8 checkpoint imported by
compat's ``ds_import`` (an ordinary checkpoint of ours, with HF parameter names and no data position of
the app's): the app's own engine, data stream and RunCheckpoints map the names through the model
family's HF adapter, start the data at the checkpoint's step, say in one log line what was resumed,
and the next steps' losses equal DeepSpeed's recorded continuation (fixtures' continuation.json) to
1e-5, at world 2 (the saved stages) and world 1 (other stages)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepshard.compat.deepspeed.ds_import import import_checkpoint
from deepshard.core.schedules import LRSchedule, SchedulerConfig
from tests.compat.app_resume_harness import app_resume_worker
from tests.compat.ds_fixture_model import MICRO, SAVE_STEP, SEQ, TOTAL_STEPS
from tests.gloo_pool import pool

FIXTURES = Path(__file__).parent / "fixtures"
OUR_STAGE = {2: {1: 1, 2: 2, 3: 3}, 1: {1: 0, 2: 3, 3: 2}}  # world -> DeepSpeed's stage -> ours


def _record(ds_stage: int) -> dict:
    return json.loads((FIXTURES / f"ds_zero{ds_stage}" / "continuation.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 1])
def test_app_resumes_an_imported_deepspeed_checkpoint(tmp_path, world):
    runs = []
    for ds_stage, ours in OUR_STAGE[world].items():
        imported = import_checkpoint(FIXTURES / f"ds_zero{ds_stage}" / "checkpoint", tmp_path / f"imported{ds_stage}")
        runs.append((ours, str(imported.parent), str(tmp_path / f"run{ds_stage}")))  # resume= the folder
    outs = pool(world).run(app_resume_worker, runs)
    params = _record(1)["config"]["scheduler"]["params"]
    rates = [LRSchedule(SchedulerConfig(name="WarmupDecayLR", **params), 1e-2).lr_at(k)
             for k in range(SAVE_STEP, TOTAL_STEPS)]
    for rank, out in enumerate(outs):
        for (ds_stage, ours), r in zip(OUR_STAGE[world].items(), out):
            where = f"DeepSpeed ZeRO-{ds_stage} -> ours ZeRO-{ours} at world {world}, rank {rank}"
            assert r["start"] == SAVE_STEP, where
            assert r["position"]["epoch"] == 0 and r["position"]["consumed"] == SAVE_STEP * 2 * MICRO, where
            assert r["tokens_seen"] == SAVE_STEP * 2 * MICRO * (SEQ - 1), where  # as if this run had trained them
            assert r["losses"] == pytest.approx(_record(ds_stage)["losses_after_resume"], abs=1e-5), where
            assert r["lrs"] == pytest.approx(rates, rel=1e-12), where
            if rank == 0:
                assert len(r["log"]) == 1 and r["log"][0] == (
                    f"checkpoint: imported from DeepSpeed 0.19.8 (ZeRO-{ds_stage}, dp 2, tag global_step3): fp32 "
                    f"weights and Adam moments, Adam and the LR schedule at update 3, loss scale 1 (DeepSpeed "
                    f"saves no data position or RNG); HF parameter names mapped to ours (the model family's); "
                    f"this run's data starts at step 3, and its optim/scheduler settings apply"), r


def test_resume_of_a_checkpoint_the_app_did_not_write_maps_names_and_places_data(tmp_path):
    """DeepSpeed-free: the pieces of the app's resume of a checkpoint another front door wrote (here the
    ZeRO-2 fixture, imported): HF names mapped by the family, the data placed after its step; the app's
    own checkpoints and another model's get no mapping (load_checkpoint then names the missing tensor)."""
    from deepshard.finetune.recipe.foreign import hf_rename, placed_after

    path = import_checkpoint(FIXTURES / "ds_zero2" / "checkpoint", tmp_path / "imported")
    ours = ["embed_tokens.weight", "norm.weight", "lm_head.weight"] + [
        f"layers.{i}.{m}.weight" for i in range(2) for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                              "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                              "mlp.down_proj", "input_layernorm", "post_attention_layernorm")]
    rename = hf_rename(path, ours, {"family": "llama"})
    assert rename is not None
    assert rename("model.layers.1.mlp.up_proj.weight") == "model.model.layers.1.mlp.up_proj.weight"
    assert rename("optim.exp_avg_sq.lm_head.weight") == "optim.exp_avg_sq.lm_head.weight"
    assert rename("optim.exp_avg.norm.weight") == "optim.exp_avg.model.norm.weight"
    assert hf_rename(path, ours + ["layers.2.mlp.up_proj.weight"], {"family": "llama"}) is None  # another model

    class Stream:  # what RunCheckpoints hands over: ResumableStream's state and global batch
        global_batch = 4

        def state_dict(self):
            return {"epoch": 0, "consumed": 0, "seed": 7, "num_samples": 10}

    state = placed_after(path, Stream(), SAVE_STEP, micro_batches_per_step=2, tokens_per_step=88, names_mapped=True)
    # 3 steps x 2 micro-batches of 4 rows over epochs of 10 // 4 = 2 batches: epoch 3, none consumed
    assert state == {"step": 3, "tokens_seen": 264, "data": {"epoch": 3, "consumed": 0, "seed": 7, "num_samples": 10}}
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["meta"]["family"] = "llama"  # what the app's own saves record: its names are ours, never mapped
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert hf_rename(path, ours, {"family": "llama"}) is None
