"""``checkpoint.resume=OUT_DIR`` in the app, of a real DeepSpeed 0.19.8 checkpoint imported by
from_deepspeed (HF parameter names, no data position of ours): the app's own engine, data stream and
RunCheckpoints map the names, start the data at DeepSpeed's step, say in one log line what was
imported, and the next steps' losses equal DeepSpeed's recorded continuation (fixtures' continuation
.json) to 1e-5, at world 2 (the saved stages) and world 1 (other stages)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepshard.core.schedules import LRSchedule, SchedulerConfig
from deepshard.finetune.tools.from_deepspeed import import_checkpoint
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
                assert len(r["log"]) == 1 and r["log"][0].startswith(
                    f"checkpoint: imported from DeepSpeed 0.19.8 (ZeRO-{ds_stage}, dp 2, tag global_step3): fp32 "
                    f"weights and Adam moments (HF names mapped to ours), Adam and the LR schedule at update 3"), r


def test_imported_run_maps_names_places_data_and_refuses_another_model(tmp_path):
    """DeepSpeed-free: the pieces of the app's resume of an imported checkpoint, on the ZeRO-2 fixture."""
    from deepshard.core.checkpoint.manifest import CheckpointError
    from deepshard.finetune.tools.from_deepspeed import ImportedRun

    path = import_checkpoint(FIXTURES / "ds_zero2" / "checkpoint", tmp_path / "imported")
    run = ImportedRun.of(path)
    assert run is not None and run.step == SAVE_STEP
    ours = ["embed_tokens.weight", "norm.weight", "lm_head.weight"] + [
        f"layers.{i}.{m}.weight" for i in range(2) for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                              "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                              "mlp.down_proj", "input_layernorm", "post_attention_layernorm")]
    run.match_names(ours)
    assert run.rename("model.layers.1.mlp.up_proj.weight") == "model.model.layers.1.mlp.up_proj.weight"
    assert run.rename("optim.exp_avg_sq.lm_head.weight") == "optim.exp_avg_sq.lm_head.weight"
    assert run.rename("optim.exp_avg.norm.weight") == "optim.exp_avg.model.norm.weight"

    class Stream:  # what RunCheckpoints hands over: ResumableStream's state and global batch
        global_batch = 4

        def state_dict(self):
            return {"epoch": 0, "consumed": 0, "seed": 7, "num_samples": 10}

    state = run.app_state(Stream(), micro_batches_per_step=2, tokens_per_step=88)
    # 3 steps x 2 micro-batches of 4 rows over epochs of 10 // 4 = 2 batches: epoch 3, none consumed
    assert state == {"step": 3, "tokens_seen": 264, "data": {"epoch": 3, "consumed": 0, "seed": 7, "num_samples": 10}}
    other = ImportedRun.of(path)
    with pytest.raises(CheckpointError, match=r"imported from DeepSpeed, but it has no tensor "
                                              r"'model.model.layers.2.mlp.up_proj.weight' \(this run's "
                                              r"'model.layers.2.mlp.up_proj.weight'; 1 missing in all\)"):
        other.match_names(ours + ["layers.2.mlp.up_proj.weight"])
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "trainer.json").write_text(json.dumps({"num_updates": 1, "scaler": {}, "app": {
        "step": 1, "data": {}, "tokens_seen": 0}}))
    assert ImportedRun.of(tmp_path / "ours") is None  # one of ours: resumed as usual
