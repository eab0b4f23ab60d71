"""Issue 41, GRPO and bad keys: TRL's ``GRPOTrainer`` on deepshard's engine, and TrainingArguments' ds_config.

- (``GRPOTrainer``'s world-2 run against DeepSpeed's recording: test_hf_stack.py's ZeRO-3 launch);
- TRL's ZeRO-3 generation unwrap on our engine, call by call, against the plain model's greedy tokens;
- ``TrainingArguments(deepspeed="ds.json")`` under the provider: a result-changing key stops when
  transformers reads the file (before the model loads), one line naming the file and the key.

TRL's ``deepspeed`` uses on GRPO's default path (trl 1.16): ``args.deepspeed_plugin.zero_stage`` (accelerate's
plugin); ``trl.models.prepare_deepspeed`` for the reference model (``deepspeed.initialize`` without an
optimizer; also test_hf_stack_launch's forward-only test); ``unwrap_model_for_generation`` through
``DistributedBackend.is_zero3``: ``deepspeed.zero.GatheredParameters`` plus ``remove_hooks``/``add_hooks``
(the pool test below); ``DistributedBackend.summon_full_params`` (FSDP v1 only: nothing under DeepSpeed).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

HERE = Path(__file__).parent
WHY = ("not supported by deepshard's engine, and ignoring it would change the results; remove it (or train on "
       "DeepSpeed: DEEPSHARD_DEEPSPEED=0)")


def test_trl_generation_unwrap_on_zero3_engine():
    """TRL's remove_hooks/add_hooks inside GatheredParameters: the blocks stay gathered through generation
    (no gather per token), the plain model's greedy tokens come out, and training after it is exact."""
    from tests.compat.hf_stack_grpo_harness import generation_hooks
    from tests.gloo_pool import pool

    for rank, out in enumerate(pool(2).run(generation_hooks)):
        assert out["units"] == 3 and out["backward_hooks"] == 0 and out["module_is_model"], (rank, out)
        assert out["external"] == [] and out["trace_invalid"], (rank, out)
        assert out["hooks_after_remove"] == 0 and out["hooks_after_add"] == 3, (rank, out)
        assert out["gathered_through_generation"] == [True, True], (rank, out)
        assert out["gathered_after"] == [False, False], (rank, out)
        assert out["active_sub_modules"] == [0], (rank, out)
        assert out["same_tokens"], f"rank {rank}: generation differs from the plain model's greedy tokens"
        assert out["loss_gap"] < 1e-6, f"rank {rank}: loss after generation differs by {out['loss_gap']}"


@pytest.fixture
def trainer_ds_check(monkeypatch):
    """The provider's check on transformers' ds_config class, in this process (put back after the test)."""
    import transformers.integrations.deepspeed as hf_ds

    from deepshard.compat.hf_cpu import WATCHED

    monkeypatch.setattr(hf_ds.HfTrainerDeepSpeedConfig, "__init__", hf_ds.HfTrainerDeepSpeedConfig.__init__)
    WATCHED["transformers.integrations.deepspeed"](hf_ds)


@pytest.mark.parametrize(("ds", "named"), [
    ({"optimizer": {"type": "Lamb", "params": {"lr": "auto"}}}, "optimizer.type=Lamb"),
    ({"sequence_parallel_size": 2}, "sequence_parallel_size=2"),
    ({"prescale_gradients": True}, "prescale_gradients=True"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler.type=OneCycle"),
])
def test_training_arguments_ds_config_file_refused(tmp_path, trainer_ds_check, ds, named):
    from transformers import TrainingArguments

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto", **ds}))
    with pytest.raises(ValueError) as err:
        TrainingArguments(output_dir=str(tmp_path), deepspeed=str(path), report_to=[])
    assert str(err.value) == f"{path}: {named}: {WHY}"


def test_training_arguments_stock_and_speed_only_configs_pass_the_check(tmp_path, trainer_ds_check):
    """TRL's/axolotl's stock shape ("auto" everywhere, offload, overlap) and speed-only unsupported keys pass the
    check; a dict is named as the argument."""
    from deepshard.compat.deepspeed.result_keys import check_trainer_ds_config

    stock = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "overlap_comm": True,
                                   "stage3_gather_16bit_weights_on_model_save": True},
             "bf16": {"enabled": "auto"}, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
             "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "steps_per_print": 10,
             "wall_clock_breakdown": False, "comms_logger": {"enabled": True}}
    path = tmp_path / "zero3.json"
    path.write_text(json.dumps(stock))
    check_trainer_ds_config(str(path))
    check_trainer_ds_config(str(tmp_path / "missing.json"))  # transformers' own error, not ours
    with pytest.raises(ValueError) as err:
        check_trainer_ds_config({**stock, "optimizer": {"type": "Lamb"}})
    assert str(err.value) == f"TrainingArguments(deepspeed={{...}}): optimizer.type=Lamb: {WHY}"


# the keys of each stock ds_config deepshard names as ignored (a warning line; none changes the results)
STOCK_IGNORED = {"axolotl/deepspeed_configs/zero2.json": [],
                 "axolotl/deepspeed_configs/zero3_bf16_cpuoffload_all.json": [],
                 "LLaMA-Factory/examples/deepspeed/ds_z2_config.json": ["comms_config", "monitor_config"],
                 "LLaMA-Factory/examples/deepspeed/ds_z3_offload_config.json": ["comms_config", "monitor_config"]}


def test_stock_ds_configs_of_axolotl_and_llama_factory_load():
    """axolotl's and LLaMA-Factory's stock ds_configs (fixtures/stock_ds_configs.json, copied from their
    repositories): TrainingArguments' check refuses none, each keeps its stage and offload, the keys named as
    ignored are the table's, and a ZeRO-3 config asking for 16-bit weights on save gets them, whether it uses
    DeepSpeed's field name (axolotl) or its stage3_ alias (LLaMA-Factory), as DeepSpeed's config reads both."""
    from types import SimpleNamespace

    from deepshard.compat.deepspeed.engine import DeepSpeedEngine
    from deepshard.compat.deepspeed.result_keys import check_trainer_ds_config
    from deepshard.compat.ds_config import translate

    stock = json.loads((HERE / "fixtures" / "stock_ds_configs.json").read_text())["configs"]
    assert set(stock) == set(STOCK_IGNORED)
    for name, entry in stock.items():
        ds = entry["ds_config"]
        check_trainer_ds_config(ds)
        t = translate(ds)
        assert t.unsupported == STOCK_IGNORED[name], name
        stage = ds["zero_optimization"]["stage"]
        assert t.entries["zero"] == ("group", f"stage{stage}"), name
        offload = ds["zero_optimization"].get("offload_optimizer", {}).get("device")
        assert t.entries.get("offload") == (("group", offload) if offload else None), name
        if stage == 3:
            assert "zero_optimization.stage3_gather_16bit_weights_on_model_save" in " ".join(t.notes), name
            assert DeepSpeedEngine.zero_gather_16bit_weights_on_model_save(SimpleNamespace(config=ds)), name
