"""Issue 26: transformers' Trainer recipe with ``from deepshard.compat.transformers import Trainer,
TrainingArguments`` and ``deepspeed=ds_config``.

The reference is transformers' own Trainer without DeepSpeed (plain torch, one process) on the same
tiny Llama, rows and schedule (hf_trainer_harness.py); ours runs at ZeRO 0 and 3 with gradient
accumulation 2 at world 1 and world 2 and must log the same losses, learning rates and gradient norms.
The "auto" filling is held against transformers' own HfTrainerDeepSpeedConfig code (run over
accelerate's config helpers, since transformers only builds that class when DeepSpeed is installed).
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from deepshard.compat.transformers.auto import AutoFill
from tests.compat.hf_trainer_harness import world1, world2
from tests.gloo_pool import pool

_RUNS: dict[str, object] = {}


def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One 1-rank launch (the reference and ours) and one 2-rank launch: 10-20 s each here."""
    if not _RUNS:  # world 2 first: world 1 resumes its checkpoint
        tmp = str(tmp_path_factory.mktemp("hf_trainer"))
        _RUNS["w2"] = pool(2).run(world2, tmp)
        _RUNS["w1"] = pool(1).run(world1, tmp)[0]
    return _RUNS


def _same(ours: list[dict], ref: list[dict], where: str) -> None:
    assert len(ours) == len(ref) == 4, where
    for mine, theirs in zip(ours, ref, strict=True):
        assert mine["step"] == theirs["step"], where
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5), where
        assert mine["learning_rate"] == pytest.approx(theirs["learning_rate"], abs=1e-12), where
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4), where


def _same_weights(ours: dict, ref: dict, where: str) -> None:
    """The trained weights agree: logits on held-out rows within 1e-5."""
    gap = (torch.tensor(ours["logits"]) - torch.tensor(ref["logits"])).abs().max().item()
    assert gap < 1e-5, f"{where}: logits differ by {gap}"


@pytest.mark.slow
@pytest.mark.parametrize("run", ["zero0", "zero3", "zero2_fp16"])
def test_world1_logs_equal_transformers_trainer(tmp_path_factory, run):
    out = runs(tmp_path_factory)["w1"]
    _same(out[run]["logs"], out["reference"]["logs"], f"world 1 {run}")
    assert out["reference"]["logs"][-1]["loss"] != out["reference"]["logs"][0]["loss"]  # it trains
    assert out[run]["eval_loss"] == pytest.approx(out["reference"]["eval_loss"], abs=1e-5)
    _same_weights(out[run], out["reference"], f"world 1 {run}")


@pytest.mark.slow
@pytest.mark.parametrize("run", ["zero0", "zero2", "zero3", "zero2_accum4", "zero3_offload", "zero3_ac"])
def test_world2_logs_equal_transformers_trainer(tmp_path_factory, run):
    """Rows of uneven length split over 2 ranks x 2 (or 4) micro-batches: exact only with token
    weighting over micro-batches and ranks (the gradient of one large batch)."""
    out = runs(tmp_path_factory)
    for rank, mine in enumerate(out["w2"]):
        _same(mine[run]["logs"], out["w1"]["reference"]["logs"], f"world 2 rank {rank} {run}")
        assert mine[run]["eval_loss"] == pytest.approx(mine["ddp"]["eval_loss"], abs=1e-5)
        _same_weights(mine[run], out["w1"]["reference"], f"world 2 rank {rank} {run}")


DS_FIXTURE = Path(__file__).parent / "fixtures" / "hf_trainer_ds.json"


@pytest.mark.slow
@pytest.mark.parametrize("run", ["zero2", "zero3_offload"])
def test_world2_logs_equal_deepspeed_trainer(tmp_path_factory, run):
    """Real DeepSpeed 0.19.8 + transformers' own Trainer(args=TrainingArguments(deepspeed=...)) on the
    same script at world 2 (recorded by bench/record_hf_trainer_ds.py, fp32 on a CPU host; no DeepSpeed
    needed here): our logged losses within 1e-4 and gradient norms within 2e-4 relative.  transformers
    logs DeepSpeed's rate one update ahead (the engine steps the scheduler inside the update, before
    Trainer reads it); ours logs the rate the update ran at, as transformers without DeepSpeed does."""
    fixture = json.loads(DS_FIXTURE.read_text())
    assert fixture["versions"]["deepspeed"] == "0.19.8" and fixture["world_size"] == 2
    theirs = fixture["runs"][run]["logs"]
    assert len(theirs) == 4
    for rank, mine in enumerate(runs(tmp_path_factory)["w2"]):
        logs = mine[run]["logs"]
        assert [h["step"] for h in logs] == [h["step"] for h in theirs], (rank, run)
        gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(logs, theirs, strict=True))
        assert gap < 1e-4, f"rank {rank} {run}: losses differ from DeepSpeed's by {gap}"
        # DeepSpeed sums the norm per partition / bucket: 6e-5 relative here
        assert [h["grad_norm"] for h in logs] == pytest.approx([h["grad_norm"] for h in theirs], rel=2e-4)
        assert [h["learning_rate"] for h in logs[1:]] == pytest.approx([h["learning_rate"] for h in theirs[:-1]],
                                                                       abs=1e-12)


@pytest.mark.slow
def test_checkpoint_resume_save_model_evaluate(tmp_path_factory):
    """World 2, ZeRO-3: checkpoint-N in transformers' layout with the engine's sharded state inside;
    a fresh Trainer resumed from checkpoint-2 logs what the uninterrupted run logged (bit-exact), and
    so, within 1e-5, does one resumed at world 1 / ZeRO 0; save_model() loads with from_pretrained
    (logits equal the engine's); evaluate() equals transformers' own (DDP) eval_loss, predict() too."""
    out = runs(tmp_path_factory)
    w1, w2 = out["w1"], out["w2"]
    for rank, r in enumerate(w2):
        assert r["checkpoints"] == ["checkpoint-2", "checkpoint-4"], rank
        assert {"trainer_state.json", "rng_state_0.pth", "rng_state_1.pth", "latest", "global_step2",
                "model.safetensors", "config.json"} <= set(r["files"]), rank
        _same(r["full"], w1["reference"]["logs"], f"rank {rank} full run")
        assert r["resumed"] == r["full"], rank  # bit-exact
        assert r["eval_loss"] == pytest.approx(r["ddp"]["eval_loss"], abs=1e-5), rank
        assert r["predict_loss"] == pytest.approx(r["eval_loss"], abs=1e-6), rank
    assert w2[0]["logit_gap"] < 1e-5
    _same(w1["resumed_w1"], w1["reference"]["logs"], "checkpoint-2 of world 2 / ZeRO-3 resumed at world 1 / ZeRO 0")


@pytest.mark.slow
def test_lora_at_zero3_saves_a_real_adapter(tmp_path_factory):
    """peft LoRA at world 2, ZeRO-3: the logs equal transformers' own Trainer on the same LoRA model,
    and save_model() writes the adapter (not DeepSpeed's empty [0] tensors: peft#2500) that
    PeftModel.from_pretrained loads with our logits."""
    out = runs(tmp_path_factory)
    ref = out["w1"]["lora_reference"]
    for rank, r in enumerate(out["w2"]):
        mine = r["lora"]
        _same(mine["logs"], ref["logs"], f"rank {rank} lora")
        _same_weights(mine, ref, f"rank {rank} lora")
        assert {"adapter_model.safetensors", "adapter_config.json"} <= set(mine["files"])
    assert out["w2"][0]["lora"]["loaded_gap"] < 1e-5


@pytest.mark.slow
def test_json_path_with_a_deepspeed_scheduler(tmp_path_factory):
    """deepspeed="ds_config.json" with WarmupDecayLR, every value "auto": DeepSpeed's schedule runs
    (warm-up 1 -> DeepSpeed's minimum of 2 steps, log warm-up, each update one step late), not
    transformers' lr_scheduler_type; before the first real update it equals the reference."""
    out = runs(tmp_path_factory)["w1"]
    logs, ref = out["json_file"], out["reference"]["logs"]
    assert [h["learning_rate"] for h in logs] == pytest.approx([0.0, 0.0, 3e-3, 3e-3])
    assert [h["loss"] for h in logs[:2]] == pytest.approx([h["loss"] for h in ref[:2]], abs=1e-5)
    assert len(logs) == 4 and all(math.isfinite(h["loss"]) and h["grad_norm"] > 0 for h in logs)
    assert list(tmp_path_factory.getbasetemp().rglob("json/**/events.out.tfevents*"))  # report_to="tensorboard"


@pytest.mark.slow
def test_epoch_with_a_short_last_accumulation(tmp_path_factory):
    """num_train_epochs=1 over 12 batches at accumulation 5: the last update has 2 micro-batches,
    token-weighted over those, as transformers does."""
    out = runs(tmp_path_factory)["w1"]
    assert len(out["short_last"]) == 3
    for mine, ref in zip(out["short_last"], out["short_last_reference"], strict=True):
        assert mine["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


SCRIPT = Path(__file__).with_name("hf_trainer_script.py")
# the harness's arguments() for world 2's ZeRO-2 run, as a command line
SCRIPT_ARGS = ["--per_device_train_batch_size=2", "--gradient_accumulation_steps=2", "--learning_rate=3e-3",
               "--weight_decay=0.01", "--max_grad_norm=0.5", "--warmup_steps=1", "--lr_scheduler_type=linear",
               "--max_steps=4", "--logging_steps=1", "--save_strategy=no", "--report_to=none", "--seed=0",
               "--train_sampling_strategy=sequential", "--remove_unused_columns=False", "--disable_tqdm=True",
               "--per_device_eval_batch_size=1"]


def _run_script(argv: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    from tests.compat.hf_stack_harness import run_launcher

    return run_launcher(argv, cwd, dict(os.environ), timeout)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "deepshard"])
def test_script_under_torchrun_and_our_launcher(tmp_path_factory, tmp_path, launcher):
    """The same Trainer script (HfArgumentParser, ``--deepspeed ds_config.json``) started by
    ``torchrun --nproc_per_node 2`` and by ``deepshard --num_gpus 2`` (which passes ``--local_rank=N``,
    taken by TrainingArguments' own field) logs exactly what world 2's ZeRO-2 run logged under the
    tests' launcher.  ~15 s each."""
    from tests.compat.hf_trainer_harness import ds_config

    (tmp_path / "ds_config.json").write_text(json.dumps(ds_config(2)))
    bindir = Path(sys.executable).parent
    start = ([str(bindir / "torchrun"), "--standalone", "--nproc_per_node", "2"] if launcher == "torchrun"
             else [str(bindir / "deepshard"), "--num_gpus", "2"])
    done = _run_script([*start, str(SCRIPT), "--output_dir", str(tmp_path / "out"), "--deepspeed", "ds_config.json",
                        "--logs_out", str(tmp_path / "logs.json"), *SCRIPT_ARGS], tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    got = json.loads((tmp_path / "logs.json").read_text())
    assert got["world_size"] == 2
    assert got["logs"] == runs(tmp_path_factory)["w2"][0]["zero2"]["logs"]


# --- "auto" filling against transformers' own rules
def _hf_filler():
    """transformers' HfTrainerDeepSpeedConfig methods on accelerate's HfDeepSpeedConfig (no DeepSpeed)."""
    from accelerate.utils.deepspeed import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    methods = {k: v for k, v in vars(HfTrainerDeepSpeedConfig).items()
               if k in ("fill_match", "fill_only", "is_auto", "trainer_config_process", "trainer_config_finalize")}

    def __init__(self, config):
        HfDeepSpeedConfig.__init__(self, config)
        self._dtype, self.mismatches = None, []

    return type("HfFiller", (HfDeepSpeedConfig,), {**methods, "__init__": __init__})


def _args(**kw):
    from transformers import TrainingArguments

    base = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, world_size=2, max_grad_norm=1.0,
                learning_rate=5e-5, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0,
                fp16=False, bf16=False, fp16_full_eval=False, bf16_full_eval=False, warmup_steps=0,
                save_on_each_node=False)
    ns = types.SimpleNamespace(**{**base, **kw})
    ns.get_warmup_steps = lambda n: TrainingArguments.get_warmup_steps(ns, n)
    return ns


ALL_AUTO = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                              "warmup_num_steps": "auto", "total_num_steps": "auto"}},
            "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                  "stage3_param_persistence_threshold": "auto"}}
ARGS = [dict(), dict(per_device_train_batch_size=1, gradient_accumulation_steps=8, world_size=1),
        dict(max_grad_norm=0.0, learning_rate=1e-3), dict(adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6),
        dict(weight_decay=0.1, fp16=True), dict(bf16=True, warmup_steps=0.1), dict(warmup_steps=7, world_size=4)]
CONFIGS = [ALL_AUTO,
           {**ALL_AUTO, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}},
           {**ALL_AUTO, "train_batch_size": 16, "gradient_clipping": 1.0, "fp16": {"enabled": True}},
           {"zero_optimization": {"stage": 1}, "optimizer": {"params": {"lr": 5e-5, "betas": [0.9, 0.999]}},
            "scheduler": {"params": {"warmup_num_steps": 0, "total_num_steps": 100}}}]


@pytest.mark.parametrize(("arg_kw", "config"), list(itertools.product(ARGS, CONFIGS)))
def test_auto_fill_equals_transformers(arg_kw, config):
    """28 argument/config combinations: the same filled ds_config and the same mismatch list."""
    args = _args(**arg_kw)
    ref = _hf_filler()(copy.deepcopy(config))
    ref.trainer_config_process(args)
    hidden = 48
    model = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=hidden))
    ref_error = None
    try:
        ref.trainer_config_finalize(args, model, 100)
    except ValueError as err:
        ref_error = str(err)
    ours = AutoFill(copy.deepcopy(config))
    ours.from_args(args, world_size=args.world_size)
    ours.for_run(args, hidden_size=hidden, num_training_steps=100)
    assert ours.ds == ref.config
    if ref_error is None:
        ours.check()
    else:
        with pytest.raises(ValueError) as err:
            ours.check()
        assert str(err.value) == ref_error


def test_mismatch_error_names_every_argument_and_key(tmp_path):
    from deepshard.compat.transformers import TrainingArguments
    from deepshard.compat.transformers.auto import fill

    ds = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": "auto"}}}
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_grad_norm=0.5,
                             learning_rate=3e-4, deepspeed=ds, report_to=[])
    assert args.deepspeed == ds and args.mixed_precision == "no"
    with pytest.raises(ValueError) as err:
        fill(args.deepspeed, args, world_size=1, model=None, num_training_steps=10)
    assert str(err.value) == (
        "Please correct the following DeepSpeed config values that mismatch TrainingArguments values:\n"
        "- ds train_micro_batch_size_per_gpu=8 vs hf per_device_train_batch_size=4\n"
        "- ds gradient_clipping=1.0 vs hf max_grad_norm=0.5\n"
        "- ds optimizer.params.lr=0.0001 vs hf learning_rate=0.0003\n"
        "The easiest method is to set these DeepSpeed config values to 'auto'.")


def test_refused_before_training(tmp_path):
    """What does not combine with the engine fails at construction, one line naming the argument."""
    from deepshard.compat.transformers import Trainer, TrainingArguments
    from tests.compat.hf_trainer_harness import collate, rows, tiny_llama

    ds = {"zero_optimization": {"stage": 2}}
    with pytest.raises(ValueError, match=r"^TrainingArguments\(torch_compile_mode='reduce-overhead'\)"):
        TrainingArguments(output_dir=str(tmp_path), deepspeed=ds, torch_compile=True,
                          torch_compile_mode="reduce-overhead", report_to=[])
    with pytest.raises(ValueError, match=r"^TrainingArguments\(load_best_model_at_end=True\)"):
        TrainingArguments(output_dir=str(tmp_path), deepspeed=ds, load_best_model_at_end=True,
                          eval_strategy="steps", save_strategy="steps", report_to=[])
    with pytest.raises(ValueError, match=r"^TrainingArguments\(activation_checkpointing_kwargs="):
        TrainingArguments(output_dir=str(tmp_path), deepspeed=ds, activation_checkpointing=True,
                          activation_checkpointing_kwargs={"use_reentrant": True}, report_to=[])
    model = tiny_llama()
    args = TrainingArguments(output_dir=str(tmp_path), deepspeed=ds, report_to=[])
    with pytest.raises(ValueError, match=r"^Trainer\(optimizers=...\)"):
        Trainer(model=model, args=args, train_dataset=rows(8), data_collator=collate,
                optimizers=(torch.optim.AdamW(model.parameters()), None))
