"""Issue 41: the HF stack's own scripts, unchanged, on deepshard's engine through the provided ``deepspeed``.

- the plain ``transformers.Trainer`` with ``TrainingArguments(deepspeed="ds_config.json")`` at ZeRO-2 and
  at ZeRO-3 with optimizer offload, started by ``deepshard --num_gpus 2``: its logs against real DeepSpeed
  0.19.8 + transformers' own Trainer on the same script, model and rows (recorded by
  bench/record_hf_trainer_ds.py into fixtures/hf_trainer_ds.json); checkpoint-2 resumed gives the
  uninterrupted losses; the saved model loads in transformers with the engine's logits;
- TRL's ``SFTTrainer`` (full fine-tune, chat data, loss on completions only, the model by path: ``zero.Init``
  under ``from_pretrained`` at ZeRO-3) at ZeRO-3 with offload, world 2, against TRL's own SFTTrainer without
  DeepSpeed in one process on the same rows per step (token-weighted, so exact), and at ZeRO-2 and ZeRO-3 +
  offload against real DeepSpeed 0.19.8's recorded runs (fixtures/hf_stack_ds.json, bench/record_hf_stack_ds.py);
  at ZeRO-2 checkpoint-2 resumed by a fresh trainer gives the uninterrupted steps 3-4 and the saved model loads
  in transformers with the engine's logits (at ZeRO-3 the same script's LoRA run in test_hf_stack_peft.py and the
  plain Trainer's run above check resume and save: one resumed trainer less in the suite's budget).

One launch per run (~20-40 s each here; a layout is a launch); docs/compat/hf-stack.md lists what each exercises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.compat.hf_stack_harness import make_model_dir, run_launcher, write_ds_config

HERE = Path(__file__).parent
DS_TRAINER = HERE / "fixtures" / "hf_trainer_ds.json"  # real DeepSpeed + transformers.Trainer (issue 26's recording)
DS_STACK = HERE / "fixtures" / "hf_stack_ds.json"  # real DeepSpeed + TRL (bench/record_hf_stack_ds.py)
_RUNS: dict[str, dict] = {}


def _deepshard(argv: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``deepshard --num_gpus 2 ...`` in its own process group, stopped with its workers on any failure."""
    env = {k: v for k, v in os.environ.items() if k != "DEEPSHARD_DEEPSPEED"}  # the launcher sets it
    cmd = [str(Path(sys.executable).parent / "deepshard"), "--num_gpus", "2", *argv]
    return run_launcher(cmd, cwd, env, timeout)


def _run(name: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    if name not in _RUNS:
        tmp = tmp_path_factory.mktemp(name)
        if name.startswith("trainer"):
            stage = 2 if name == "trainer_zero2" else 3
            argv = [str(HERE / "hf_stack_trainer_script.py"), "--ds_config", write_ds_config(tmp / "ds.json", stage),
                    "--out", str(tmp / "out")]
        else:  # SFTTrainer, full fine-tune; at ZeRO-2 with checkpoints, save_model and checkpoint-2 resumed (--save)
            stage, save = (2, ["--save"]) if name == "sft_zero2" else (3, [])
            argv = [str(HERE / "hf_stack_sft_script.py"), "--model", make_model_dir(tmp / "model"), *save,
                    "--ds_config", write_ds_config(tmp / "ds.json", stage, optimizer=False), "--out", str(tmp / "out")]
        done = _deepshard([*argv, "--result", str(tmp / "result.json")], tmp)
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        _RUNS[name] = {**json.loads((tmp / "result.json").read_text()), "stderr": done.stderr, "tmp": str(tmp)}
    return _RUNS[name]


def _close_to_deepspeed(mine: list[dict], theirs: list[dict], where: str) -> None:
    assert [h["step"] for h in mine] == [h["step"] for h in theirs] == [1.0, 2.0, 3.0, 4.0], where
    gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(mine, theirs, strict=True))
    assert gap < 1e-5, f"{where}: losses differ from DeepSpeed's by {gap}"
    assert [h["grad_norm"] for h in mine] == pytest.approx([h["grad_norm"] for h in theirs], rel=2e-4), where
    assert [h["learning_rate"] for h in mine] == pytest.approx([h["learning_rate"] for h in theirs], abs=1e-12), where


@pytest.mark.slow
@pytest.mark.parametrize(("name", "recorded"), [("trainer_zero2", "zero2"), ("trainer_zero3_offload", "zero3_offload")])
def test_plain_trainer_trains_saves_resumes_like_deepspeed(tmp_path_factory, name, recorded):
    out = _run(name, tmp_path_factory)
    assert out["engine"] == "deepshard.compat.deepspeed.engine.DeepSpeedEngine" and out["world_size"] == 2
    assert out["deepspeed"] == "0.19.8+deepshard"
    assert out["stderr"].count("deepspeed: deepshard 0.19.8+deepshard engine") == 1  # rank 0's one line
    fixture = json.loads(DS_TRAINER.read_text())
    assert fixture["versions"]["deepspeed"] == "0.19.8" and fixture["world_size"] == 2
    _close_to_deepspeed(out["logs"], fixture["runs"][recorded]["logs"], name)
    # checkpoint-2 resumed by a fresh Trainer: the uninterrupted run's steps 3 and 4
    resumed = [h for h in out["resumed"] if h["step"] > 2]
    assert [h["step"] for h in resumed] == [3.0, 4.0]
    assert [h["loss"] for h in resumed] == pytest.approx([h["loss"] for h in out["logs"][2:]], abs=1e-6)
    assert out["checkpoints"] == ["checkpoint-2", "checkpoint-4"]
    assert {"global_step2", "latest", "trainer_state.json"} <= set(out["checkpoint_files"])
    assert "model.safetensors" in out["final_files"] and "config.json" in out["final_files"]
    # save_model's output loads in transformers (here, no DeepSpeed) and gives the engine's logits
    import torch
    from transformers import AutoModelForCausalLM

    from tests.compat.hf_trainer_harness import probe_batch

    loaded = AutoModelForCausalLM.from_pretrained(Path(out["tmp"]) / "out" / "final")
    with torch.no_grad():
        gap = (loaded(**probe_batch()).logits - torch.tensor(out["logits"])).abs().max().item()
    assert gap < 1e-5, f"{name}: the saved model's logits differ from the engine's by {gap}"


def _sft_reference(tmp: Path, model_dir: str) -> list[dict]:
    """TRL's SFTTrainer without DeepSpeed, one process, micro 4 x accumulation 2: the rows of each step of
    the world-2 run (rank r takes micro-batches r, r+2, ...)."""
    code = f"""
import json, sys
sys.path.insert(0, {str(HERE.parents[1])!r})
from datasets import Dataset
from trl import SFTConfig, SFTTrainer
from tests.compat.hf_stack_harness import chat_rows
args = SFTConfig(output_dir={str(tmp / "ref")!r}, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                 learning_rate=3e-3, max_steps=4, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                 bf16=False, fp16=False, max_length=64, completion_only_loss=True, use_cpu=True,
                 train_sampling_strategy="sequential", disable_tqdm=True, model_init_kwargs={{"dtype": "float32"}})
t = SFTTrainer(model={model_dir!r}, args=args, train_dataset=Dataset.from_list(chat_rows()))
t.train()
print(json.dumps([{{k: float(v) for k, v in h.items() if k in ("loss", "grad_norm", "learning_rate", "step")}}
                  for h in t.state.log_history if "loss" in h]))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("DEEPSHARD_DEEPSPEED", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_NUM_THREADS": "2"}, capture_output=True,
                          text=True, timeout=300, cwd=tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_sft_trainer_zero3_chat_completion_only(tmp_path_factory):
    out = _run("sft_zero3_offload", tmp_path_factory)
    assert out["engine"] == "deepshard.compat.deepspeed.engine" and out["world_size"] == 2
    tmp = Path(out["tmp"])
    ref = _sft_reference(tmp, str(tmp / "model"))
    assert len(out["logs"]) == len(ref) == 4
    assert out["logs"][-1]["loss"] < out["logs"][0]["loss"]  # it learns
    for mine, theirs in zip(out["logs"], ref, strict=True):
        assert mine["step"] == theirs["step"]
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=2e-4)
    _close_to_deepspeed(out["logs"], _recorded("sft_zero3_offload")["logs"], "sft_zero3_offload")


@pytest.mark.slow
def test_sft_trainer_zero2_full_matches_deepspeed_resumes_and_saves(tmp_path_factory):
    out, theirs = _run("sft_zero2", tmp_path_factory), _recorded("sft_zero2")
    assert out["engine"] == "deepshard.compat.deepspeed.engine" and out["world_size"] == 2
    assert theirs["zero_stage"] == 2 and out["trainable"] == theirs["trainable"]
    _close_to_deepspeed(out["logs"], theirs["logs"], "sft_zero2")
    _sft_resumes_and_saves(out, "sft_zero2")
    # DeepSpeed's own resume of checkpoint-2 logged its uninterrupted losses; ours logs DeepSpeed's
    assert [h["loss"] for h in out["resumed"] if h["step"] > 2] == pytest.approx(
        [h["loss"] for h in theirs["resumed"] if h["step"] > 2], abs=1e-5)
    assert set(out["final_files"]) == set(theirs["final_files"])


def _recorded(name: str) -> dict:
    fixture = json.loads(DS_STACK.read_text())
    assert fixture["versions"]["deepspeed"] == "0.19.8" and fixture["versions"]["trl"] == "1.16.0"
    return fixture["runs"][name]


def _sft_resumes_and_saves(out: dict, name: str) -> None:
    """The SFT script's ``--save``: checkpoint-2 resumed by a fresh SFTTrainer logs the uninterrupted steps
    3-4; ``save_model``'s folder loads with ``from_pretrained`` (no DeepSpeed) and gives the engine's logits."""
    resumed = [h for h in out["resumed"] if h["step"] > 2]
    assert [h["step"] for h in resumed] == [3.0, 4.0], name
    assert [h["loss"] for h in resumed] == pytest.approx([h["loss"] for h in out["logs"][2:]], abs=1e-6), name
    assert {"latest", "trainer_state.json"} <= set(out["checkpoint_files"]), name
    assert any(f.startswith("global_step2/") for f in out["checkpoint_files"]), name
    assert {"model.safetensors", "config.json"} <= set(out["final_files"]), name
    import torch
    from transformers import AutoModelForCausalLM

    from tests.compat.hf_stack_sft_script import probe

    tmp = Path(out["tmp"])
    loaded = AutoModelForCausalLM.from_pretrained(tmp / "out" / "final", dtype=torch.float32).eval()
    with torch.no_grad():
        gap = (loaded(**probe(str(tmp / "model"))).logits - torch.tensor(out["logits"])).abs().max().item()
    assert gap < 1e-5, f"{name}: the saved model's logits differ from the engine's by {gap}"
