"""The app end to end on user data and on DeepSpeed config files (real 1- and 2-rank runs)."""

from __future__ import annotations

import pytest

from deepshard.finetune.data.corpus import generate
from tests.finetune_app.app_harness import (
    FIXTURES,
    TINY,
    prompt_response_rows,
    run_app,
    scalars,
    write_jsonl,
    write_save_to_disk,
)

pytestmark = pytest.mark.slow

LOGGED = ("train/loss", "train/perplexity", "train/lr", "train/grad_norm", "train/loss_scale", "train/tokens_per_s",
          "train/mfu", "memory/model_state_bytes_rank0", "memory/model_state_bytes_rank1", "eval/loss",
          "eval/perplexity", "profile/forward_s", "profile/backward_s", "profile/optimizer_s",
          "profile/comm_wait_s", "profile/tflops")


def test_jsonl_prompt_response_zero3_eval_profile_sample(tmp_path):
    data = write_jsonl(tmp_path / "pr.jsonl", prompt_response_rows(300))
    proc = run_app(tmp_path, "data=jsonl", f"data.path={data}", "data.eval_fraction=0.1", "train.eval_every=3",
                   "+zero=stage3", "train.max_steps=6", "profile.enabled=true", "profile.trace_steps=[2,3]",
                   "train.sample_prompt=alice has two red apples.", "train.sample_tokens=4", *TINY)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "2 rank(s), zero stage 3" in out and "sample: 'alice has two red apples.' -> " in out
    logged = scalars(tmp_path / "run/tensorboard")
    for tag in LOGGED:
        assert tag in logged, (tag, sorted(logged))
    assert len(logged["train/loss"]) == 6 and len(logged["eval/perplexity"]) == 2  # steps 3 and 6
    assert logged["eval/perplexity"][-1] < logged["eval/perplexity"][0]
    assert 0 < logged["train/mfu"][-1] < 1
    traces = sorted(p.name.split(".")[0] for p in (tmp_path / "run/profile").glob("*.pt.trace.json"))
    assert traces == ["rank0", "rank1"]


def test_text_files_unpacked_one_rank(tmp_path):
    (tmp_path / "corpus").mkdir()
    for i, story in enumerate(generate(40, seed=5)):
        (tmp_path / "corpus" / f"{i:02d}.txt").write_text(story)
    proc = run_app(tmp_path, "data=text", f"data.path={tmp_path / 'corpus' / '*.txt'}", "data.pack=false",
                   "launcher.nproc_per_node=1", "train.max_steps=4", *TINY)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    logged = scalars(tmp_path / "run/tensorboard")
    assert len(logged["train/loss"]) == 4 and "eval/perplexity" in logged


def test_hf_disk_saved_dataset_one_rank(tmp_path):
    root = write_save_to_disk(tmp_path / "saved", prompt_response_rows(120), split="train")
    proc = run_app(tmp_path, "data=hf_disk", f"data.path={root}", "launcher.nproc_per_node=1",
                   "train.max_steps=4", *TINY)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert len(scalars(tmp_path / "run/tensorboard")["train/loss"]) == 4


def test_deepspeed_zero2_fp16_config_trains(tmp_path):
    proc = run_app(tmp_path, f"+deepspeed={FIXTURES / 'ds_zero2_fp16.json'}", "train.max_steps=4", *TINY)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "notice: precision=fp16 needs a CUDA device" in out  # CPU-only host: fp32 instead
    assert "2 rank(s), zero stage 2, fp32" in out and "warning:" not in out
    lrs = scalars(tmp_path / "run/tensorboard")["train/lr"]
    # the file's WarmupLR (2 warm-up steps, DeepSpeed's default log warm-up) as DeepSpeed's engine applies it:
    # update k at the scheduler's iteration k-1, so [min, log(1)/log(2), log(2)/log(2), max] x 0.001
    assert lrs[:4] == pytest.approx([0.0, 0.0, 0.001, 0.001])


def test_deepspeed_zero3_cpu_offload_config_trains(tmp_path):
    proc = run_app(tmp_path, f"+deepspeed={FIXTURES / 'ds_zero3_offload.json'}", "train.max_steps=6", *TINY)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "2 rank(s), zero stage 3, offload optimizer=cpu params=cpu" in out
    warnings = [line for line in out.splitlines() if line.startswith("warning: deepspeed=")]
    assert len(warnings) == 1 and warnings[0].endswith(
        "not supported, ignored: comms_logger")  # stage3_gather_16bit_weights_on_model_save: saves always gather
    assert len(scalars(tmp_path / "ds_logs/zero3_offload")["train/loss"]) == 6  # the file's tensorboard path


def test_bad_data_and_contradictory_batch_fail_before_any_work(tmp_path, monkeypatch):
    """The launcher's checks in this process (tests/app/prelaunch.py: no worker may start)."""
    from tests.app.prelaunch import prelaunch_error

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": \n')
    line = prelaunch_error(["data=jsonl", f"data.path={bad}", "launcher.nproc_per_node=1"], tmp_path / "run",
                           monkeypatch)
    assert line.startswith(f"error: {bad}:2: not valid JSON"), line
    line = prelaunch_error(["train.global_batch_size=30", "train.micro_batch_size=4", "train.grad_accum=2"],
                           tmp_path / "run", monkeypatch)
    assert line == (
        "error: train.global_batch_size=30 != train.micro_batch_size=4 x train.grad_accum=2 x data-parallel "
        "size 2 = 16: give two of the three, or make them agree")
