"""Issue 41: the HF stack's own scripts, unchanged, on deepshard's engine through the provided ``deepspeed``,
world 2, fp32, one launch per layout (tests/compat/hf_stack_layouts.py: ZeRO-2, and ZeRO-3 with the optimizer
offloaded to the CPU), each script against real DeepSpeed 0.19.8's recorded run of it (fixtures/hf_stack_ds.json,
bench/record_hf_stack_ds.py; the plain Trainer's: fixtures/hf_trainer_ds.json, bench/record_hf_trainer_ds.py):

- the plain ``transformers.Trainer`` with ``TrainingArguments(deepspeed="ds_config.json")``: checkpoint-2 resumed
  gives the uninterrupted losses; the saved model loads in transformers with the engine's logits; ``evaluate()``
  before any ``train()`` (ZeRO-3) and after it gives transformers' own eval_loss without DeepSpeed;
- TRL's ``SFTTrainer`` (full fine-tune, chat rows, loss on completions only, the model by path: ``zero.Init`` under
  ``from_pretrained`` at ZeRO-3), also against TRL's own SFTTrainer without DeepSpeed in one process on the same
  rows per step (recorded); checkpoint-2 resumed by a fresh trainer gives the uninterrupted steps 3-4 and the saved
  model loads in transformers with the engine's logits;
- ``SFTTrainer``'s ``evaluate()`` on held-out rows (two per device, a short last batch): before training (ZeRO-3)
  transformers' own value without DeepSpeed on the same 2 processes (recorded), after it DeepSpeed's (recorded);
- ``SFTTrainer`` with ``peft_config`` (LoRA) at both layouts: checkpoint-2 (without the frozen base) resumed, the
  adapter loads with PEFT; at ZeRO-3 ``deepshard --accelerate_config`` (no ``deepspeed=`` in the script) gives
  the losses of the ds_config run;
- ``DPOTrainer`` with the reference model TRL prepares with ``deepspeed.initialize`` without an optimizer: also
  checkpoint-2 resumed and the saved policy loaded;
- ``GRPOTrainer`` (``use_vllm=False``) at both layouts: 5 steps, the same sampled tokens, TRL's generation time per
  step; checkpoint-3 resumed by a fresh trainer gives the uninterrupted steps 4-5 and the saved policy loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.compat.hf_stack_layouts import Layouts

HERE = Path(__file__).parent
DS_TRAINER = HERE / "fixtures" / "hf_trainer_ds.json"  # real DeepSpeed + transformers.Trainer (issue 26's recording)
DS_STACK = HERE / "fixtures" / "hf_stack_ds.json"  # real DeepSpeed + TRL (bench/record_hf_stack_ds.py)
ENGINE_LINE = "deepspeed: deepshard 0.19.8+deepshard engine"


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> Layouts:
    return Layouts(tmp_path_factory)


def _recorded(name: str) -> dict:
    fixture = json.loads(DS_STACK.read_text())
    assert fixture["versions"]["deepspeed"] == "0.19.8" and fixture["versions"]["trl"] == "1.16.0"
    return fixture["runs"][name]


def _close_to_deepspeed(mine: list[dict], theirs: list[dict], where: str) -> None:
    assert [h["step"] for h in mine] == [h["step"] for h in theirs] == [1.0, 2.0, 3.0, 4.0], where
    gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(mine, theirs, strict=True))
    assert gap < 1e-5, f"{where}: losses differ from DeepSpeed's by {gap}"
    assert [h["grad_norm"] for h in mine] == pytest.approx([h["grad_norm"] for h in theirs], rel=2e-4), where
    assert [h["learning_rate"] for h in mine] == pytest.approx([h["learning_rate"] for h in theirs], abs=1e-12), where


def _resumed_steps_equal(out: dict, name: str, theirs: dict | None = None, first: int = 2) -> None:
    """checkpoint-``first`` resumed by a fresh trainer logs the uninterrupted steps after it (and DeepSpeed's
    resumed ones)."""
    resumed = [h for h in out["resumed"] if h["step"] > first]
    assert [h["step"] for h in resumed] == [h["step"] for h in out["logs"][first:]] and resumed, name
    assert [h["loss"] for h in resumed] == pytest.approx([h["loss"] for h in out["logs"][first:]], abs=1e-6), name
    if theirs is not None:  # DeepSpeed's own resume of the checkpoint logged its uninterrupted losses
        assert [h["loss"] for h in resumed] == pytest.approx(
            [h["loss"] for h in theirs["resumed"] if h["step"] > first], abs=1e-5), name


def _saved_as_deepspeeds(out: dict, theirs: dict, name: str, *, adapter: bool = False) -> float:
    """``save_model``'s folder holds the files DeepSpeed's run saved (the weights; or the adapter, without the
    base's weights) and loads with the engine's logits (1e-5); returns the gap."""
    files = set(out["final_files"])
    want = {"adapter_model.safetensors", "adapter_config.json"} if adapter else {"model.safetensors", "config.json"}
    assert want <= files and files == set(theirs["final_files"]), (name, files)
    assert not adapter or "model.safetensors" not in files, name
    gap = _saved_logits_gap(out, adapter=adapter)
    assert gap < 1e-5, f"{name}: the saved {'adapter' if adapter else 'model'}'s logits differ from the engine's by {gap}"
    return gap


def _saved_logits_gap(out: dict, adapter: bool = False) -> float:
    """``save_model``'s folder loaded without DeepSpeed (``from_pretrained``; an adapter with PEFT on the base
    model) against the engine's logits on the script's probe row."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.compat.hf_stack_sft_script import probe

    final = Path(out["tmp"]) / "out" / "final"
    if adapter:
        from peft import PeftModel

        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out["model"], dtype=torch.float32),
                                           str(final))
    else:
        loaded = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    with torch.no_grad():
        return (loaded.eval()(**probe(out["model"])).logits - torch.tensor(out["logits"])).abs().max().item()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zero2", "zero3_offload"])
def test_plain_trainer_trains_saves_resumes_like_deepspeed(layouts, layout):
    launch = layouts(layout)
    out = launch["runs"][f"trainer_{layout}"]
    assert out["engine"] == "deepshard.compat.deepspeed.engine.DeepSpeedEngine" and out["world_size"] == 2
    assert out["deepspeed"] == "0.19.8+deepshard"
    assert launch["stderr"].count(ENGINE_LINE) == 1  # rank 0's one line
    fixture = json.loads(DS_TRAINER.read_text())
    assert fixture["versions"]["deepspeed"] == "0.19.8" and fixture["world_size"] == 2
    _close_to_deepspeed(out["logs"], fixture["runs"][layout]["logs"], layout)
    _resumed_steps_equal(out, layout)
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
    assert gap < 1e-5, f"{layout}: the saved model's logits differ from the engine's by {gap}"


def _eval_loss_alone(model, tmp: Path) -> float:
    """transformers' own ``Trainer.evaluate()`` without DeepSpeed, in this process (world 1), over the script's
    held-out rows two per batch: each batch holds the rows of one eval step of the world-2 run (one per rank).
    The same number as transformers' own world-2 run without DeepSpeed (``use_cpu``, gloo; measured 2026-12-07 on
    these rows without the prompt-only one: 5.575145721435547 both)."""
    import transformers
    from accelerate.state import AcceleratorState, GradientState

    from tests.compat.hf_stack_trainer_script import EVAL_BATCH, eval_rows
    from tests.compat.hf_trainer_harness import collate

    args = transformers.TrainingArguments(output_dir=str(tmp), per_device_eval_batch_size=2 * EVAL_BATCH, use_cpu=True,
                                          report_to=[], remove_unused_columns=False, disable_tqdm=True)
    try:
        trainer = transformers.Trainer(model=model, args=args, data_collator=collate)
        return trainer.evaluate(eval_dataset=eval_rows())["eval_loss"]
    finally:
        AcceleratorState._reset_state(True)  # leave no accelerate state in this pytest process
        GradientState._reset_state()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zero3_offload", "zero2"])
def test_plain_trainer_evaluate_gives_transformers_eval_loss(layouts, layout, tmp_path):
    """The plain ``transformers.Trainer``'s ``evaluate()`` on held-out rows (one per device, one prompt-only):
    before any ``train()`` (transformers' ``deepspeed_init(inference=True)``: ``deepspeed.initialize`` without an
    optimizer, our forward-only engine) the eval_loss of transformers without DeepSpeed on the initial model (real
    DeepSpeed 0.19.8 stops there on its batch-size assertion: no recording); after ``train()`` that of transformers
    without DeepSpeed on the saved model.  Below ZeRO-3 transformers itself refuses the evaluate() before train()."""
    from transformers import AutoModelForCausalLM

    from tests.compat.hf_trainer_harness import tiny_llama

    out = layouts(layout)["runs"][f"trainer_{layout}"]
    gaps = {}
    if layout == "zero3_offload":
        gaps["before"] = abs(out["eval_before"]["eval_loss"] - _eval_loss_alone(tiny_llama(), tmp_path / "before"))
    else:
        assert out["eval_before"]["error"].startswith("ValueError: ZeRO inference only makes sense"), out["eval_before"]
    trained = AutoModelForCausalLM.from_pretrained(Path(out["tmp"]) / "out" / "final")
    gaps["after"] = abs(out["eval_after"]["eval_loss"] - _eval_loss_alone(trained, tmp_path / "after"))
    print(f"\n{layout}: eval_loss {out['eval_before']}, {out['eval_after']}; gaps to transformers alone {gaps}")
    assert max(gaps.values()) < 1e-6, gaps


@pytest.mark.slow
def test_sft_trainer_zero3_chat_completion_only(layouts):
    out = layouts("zero3_offload")["runs"]["sft_zero3_offload"]
    assert out["engine"] == "deepshard.compat.deepspeed.engine" and out["world_size"] == 2
    # TRL without DeepSpeed in one process, micro 4 x accumulation 2: the rows of each world-2 step (recorded)
    ref = _recorded("sft_trl_alone")
    assert ref["world_size"] == 1 and ref["deepspeed"] is None
    assert len(out["logs"]) == len(ref["logs"]) == 4
    assert out["logs"][-1]["loss"] < out["logs"][0]["loss"]  # it learns
    for mine, theirs in zip(out["logs"], ref["logs"], strict=True):
        assert mine["step"] == theirs["step"]
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=2e-4)
    theirs = _recorded("sft_zero3_offload")
    _close_to_deepspeed(out["logs"], theirs["logs"], "sft_zero3_offload")
    _resumed_steps_equal(out, "sft_zero3_offload", theirs)
    _saved_as_deepspeeds(out, theirs, "sft_zero3_offload")  # stage3_gather_16bit_weights_on_model_save


@pytest.mark.slow
def test_sft_trainer_zero2_full_matches_deepspeed_resumes_and_saves(layouts):
    out, theirs = layouts("zero2")["runs"]["sft_zero2"], _recorded("sft_zero2")
    assert out["engine"] == "deepshard.compat.deepspeed.engine" and out["world_size"] == 2
    assert theirs["zero_stage"] == 2 and out["trainable"] == theirs["trainable"]
    _close_to_deepspeed(out["logs"], theirs["logs"], "sft_zero2")
    _resumed_steps_equal(out, "sft_zero2", theirs)
    assert {"latest", "trainer_state.json"} <= set(out["checkpoint_files"])
    assert any(f.startswith("global_step2/") for f in out["checkpoint_files"])
    _saved_as_deepspeeds(out, theirs, "sft_zero2")


def _same_metrics(mine: dict, theirs: dict, where: str) -> float:
    """``evaluate()``'s metrics (TRL's: loss, entropy, token accuracy, tokens; not the timings) equal within 1e-5;
    the loss gap."""
    mine, theirs = ({k: v for k, v in d.items() if not k.endswith("_time")} for d in (mine, theirs))
    assert "error" not in mine and set(mine) == set(theirs) and "eval_loss" in mine, (where, mine, theirs)
    for key, value in theirs.items():
        assert abs(mine[key] - value) < 1e-5 * max(1.0, abs(value)), f"{where}: {key} {mine[key]} != {value}"
    return abs(mine["eval_loss"] - theirs["eval_loss"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zero3_offload", "zero2"])
def test_sft_trainer_evaluate_gives_transformers_eval_loss(layouts, layout):
    """The full SFT run of the layout: ``evaluate()`` by a fresh trainer before training and by the trainer after
    it.  The engine hands each rank's own model loss to transformers' eval loop, as DeepSpeed's does, so before
    training ``eval_loss`` is transformers' own without DeepSpeed on the same 2 processes (and DeepSpeed's), and
    after it DeepSpeed's; below ZeRO-3 transformers itself refuses the evaluate() before train()."""
    out, theirs = layouts(layout)["runs"][f"sft_{layout}"], _recorded(f"sft_eval_{layout}")
    alone = _recorded("sft_eval_no_deepspeed")  # transformers' own DDP path on CPU, the same 2 processes
    assert alone["zero_stage"] is None
    gaps = {}
    if layout == "zero3_offload":
        gaps["before"] = _same_metrics(out["eval_before"], alone["eval_before"], f"{layout} before train()")
        _same_metrics(out["eval_before"], theirs["eval_before"], f"{layout} before train(), DeepSpeed")
    else:
        assert out["eval_before"] == theirs["eval_before"], out["eval_before"]
        assert out["eval_before"]["error"].startswith("ValueError: ZeRO inference only makes sense"), out
    _close_to_deepspeed(out["logs"], theirs["logs"], f"sft_eval_{layout}")  # the steps DeepSpeed evaluated after
    gaps["after"] = _same_metrics(out["eval_after"], theirs["eval_after"], f"{layout} after train()")
    print(f"\n{layout}: eval_loss gaps {gaps}")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zero3_offload", "zero2"])
def test_sft_lora_matches_deepspeed_resumes_and_saves_the_adapter(layouts, layout):
    name = f"sft_lora_{layout}"
    out, theirs = layouts(layout)["runs"][name], _recorded(name)
    assert out["engine"] == "deepshard.compat.deepspeed.engine" and out["world_size"] == 2
    assert theirs["peft"] == "PeftModelForCausalLM" and out["peft"].endswith(theirs["peft"])  # FSDP2 names it FSDP...
    assert out["trainable"] == theirs["trainable"]
    _close_to_deepspeed(out["logs"], theirs["logs"], name)
    assert out["logs"][-1]["loss"] < out["logs"][0]["loss"]
    # checkpoint-2, saved without the frozen base (exclude_frozen_parameters), resumed by a fresh trainer
    _resumed_steps_equal(out, name, theirs)
    manifest = next(f for f in out["checkpoint_files"] if f.endswith("manifest.json"))
    meta = json.loads((Path(out["tmp"]) / "out" / "checkpoint-2" / manifest).read_text())["meta"]
    assert meta == {"exclude_frozen_parameters": True}
    # the adapter, as DeepSpeed's run saved it, loads with PEFT on the base model and gives the engine's logits
    _saved_as_deepspeeds(out, theirs, name, adapter=True)


@pytest.mark.slow
def test_accelerate_config_equals_the_ds_config_run(layouts):
    """``deepshard --accelerate_config deepspeed_zero3.yaml sft.py --lora``: the ds_config run's losses."""
    launch = layouts("zero3_offload")
    ds, acc = launch["runs"]["sft_lora_zero3_offload"], launch["runs"]["sft_lora_yaml"]
    assert acc["engine"] == "deepshard.compat.deepspeed.engine" and acc["world_size"] == 2
    assert launch["stderr"].count(ENGINE_LINE) == 1
    assert [h["step"] for h in acc["logs"]] == [1.0, 2.0, 3.0, 4.0]
    for mine, theirs in zip(acc["logs"], ds["logs"], strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-6)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
        assert mine["learning_rate"] == pytest.approx(theirs["learning_rate"], abs=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zero2", "zero3_offload"])
def test_dpo_trainer_with_reference_model_matches_deepspeed(layouts, layout):
    name = f"dpo_{layout}"
    out = layouts(layout)["runs"][name]
    assert out["engine"] == "deepshard.compat.deepspeed.engine" and out["world_size"] == 2
    assert out["ref_engine"] == "deepshard.compat.deepspeed.inference.InferenceEngine"
    theirs = _recorded(name)["logs"]
    assert [h["step"] for h in out["logs"]] == [h["step"] for h in theirs] == [1.0, 2.0, 3.0, 4.0]
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        gap = max(abs(a[key] - b[key]) for a, b in zip(out["logs"], theirs, strict=True))
        assert gap < 1e-5 * max(1.0, max(abs(b[key]) for b in theirs)), f"{name}: {key} differs from DeepSpeed's by {gap}"
    assert [h["grad_norm"] for h in out["logs"]] == pytest.approx([h["grad_norm"] for h in theirs], rel=2e-4)
    # checkpoint-2 resumed by a fresh DPOTrainer (its reference model prepared again); the policy saved and loaded
    _resumed_steps_equal(out, name, _recorded(name))
    _saved_as_deepspeeds(out, _recorded(name), name)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zero3_offload", "zero2"])
def test_grpo_trainer_matches_deepspeed_resumes_and_saves(layouts, layout):
    name = f"grpo_{layout}"
    out, theirs = layouts(layout)["runs"][name], _recorded(name)
    assert out["engine"] == "deepshard.compat.deepspeed.engine" and out["world_size"] == 2
    assert out["ref_engine"] == "deepshard.compat.deepspeed.inference.InferenceEngine"
    assert [h["step"] for h in out["logs"]] == [h["step"] for h in theirs["logs"]] == [1.0, 2.0, 3.0, 4.0, 5.0]
    for key in ("reward", "reward_std", "completions/mean_length", "num_tokens"):  # the same sampled tokens
        assert [h[key] for h in out["logs"]] == pytest.approx([h[key] for h in theirs["logs"]], abs=1e-5), key
    gaps = {}
    for key in ("loss", "reward", "kl", "entropy"):
        gaps[key] = max(abs(a[key] - b[key]) for a, b in zip(out["logs"], theirs["logs"], strict=True))
        assert gaps[key] < 1e-5 * max(1.0, max(abs(b[key]) for b in theirs["logs"])), f"{key} differs by {gaps[key]}"
    assert [h["grad_norm"] for h in out["logs"]] == pytest.approx([h["grad_norm"] for h in theirs["logs"]], rel=2e-4)
    gaps["grad_norm (rel)"] = max(abs(a["grad_norm"] / b["grad_norm"] - 1) for a, b in zip(out["logs"], theirs["logs"]))
    # checkpoint-3 resumed by a fresh GRPOTrainer (its reference model prepared again): steps 4-5 sample the same
    # tokens and log the uninterrupted losses, as DeepSpeed's resume did; the saved policy loads in transformers
    _resumed_steps_equal(out, name, theirs, first=3)
    resumed = [h for h in out["resumed"] if h["step"] > 3]
    for key in ("reward", "num_tokens", "kl"):
        assert [h[key] for h in resumed] == pytest.approx([h[key] for h in out["logs"][3:]], abs=1e-6), key
    gaps["resumed loss"] = max(abs(a["loss"] - b["loss"]) for a, b in zip(resumed, out["logs"][3:], strict=True))
    assert {"latest", "trainer_state.json"} <= set(out["checkpoint_files"])
    assert any(f.startswith("global_step3/") for f in out["checkpoint_files"])
    gaps["saved logits"] = _saved_as_deepspeeds(out, theirs, name)
    ours, ds = out["generation_seconds"], theirs["generation_seconds"]
    assert len(ours) == len(ds) == 5
    print(f"\n{name} vs DeepSpeed 0.19.8, max gaps: {', '.join(f'{k} {v:.2g}' for k, v in gaps.items())}; generation "
          f"s/step (steps 2-5): deepshard {sum(ours[1:]) / 4:.3f}, DeepSpeed (recorded) {sum(ds[1:]) / 4:.3f}")
