"""The app end to end, at 2 ranks: fine-tune a tiny Llama saved by transformers (model=hf), SIGTERM the
launcher's process group mid-training (what a scheduler does), then resume=auto and export."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepshard.core.checkpoint.manifest import step_dirs, verify_checkpoint
from deepshard.finetune.data.tokenizer import load_tokenizer
from deepshard.finetune.tools.export import main as export_main
from tests.checkpoint.hf_fixtures import save_tiny_hf_llama

pytestmark = pytest.mark.slow  # world-size launches: the full suite only (the inner loop: -m 'not slow')

ROOT = Path(__file__).resolve().parents[2]


def _losses(text: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"step\s+(\d+)\s+loss (\d+\.\d+)", text)}


def test_sigterm_saves_then_resume_continues_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir, run_dir = tmp_path / "hf", tmp_path / "run"
    save_tiny_hf_llama(hf_dir)
    cmd = [sys.executable, str(ROOT / "apps/finetune/main.py"), "model=hf", f"model.path={hf_dir}", "+zero=stage1",
           "train.log_every=1", "train.micro_batch_size=4", "optim.lr=3e-3", "scheduler=constant", f"hydra.run.dir={run_dir}"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd + ["train.max_steps=500"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=tmp_path, start_new_session=True)
    first = ""
    for line in proc.stdout:
        first += line
        if re.search(r"step\s+3\s+loss", line):
            os.killpg(proc.pid, signal.SIGTERM)
            break
    first += proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, first[-3000:]
    assert "preempted" in first
    (saved,) = step_dirs(run_dir / "checkpoints")
    assert 3 <= saved.step < 500
    manifest = verify_checkpoint(saved.path)
    assert manifest["world"] == {"world_size": 2, "dp_size": 2, "zero_stage": 1}
    assert manifest["meta"]["model"]["dim"] == 64

    end = saved.step + 3
    second = subprocess.run(cmd + [f"train.max_steps={end}"], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=300)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert f"resumed from {saved.path} at step {saved.step}" in out
    assert min(_losses(out)) == saved.step + 1 and max(_losses(out)) == end
    losses = {**_losses(first), **_losses(out)}
    assert losses[end] < losses[1] - 0.3  # it fine-tunes
    assert [c.step for c in step_dirs(run_dir / "checkpoints")] == [end, saved.step]

    out_dir = tmp_path / "exported"
    assert export_main([str(run_dir / "checkpoints" / f"step-{end:08d}"), str(out_dir)]) == 0
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    model = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    assert model.config.hidden_size == 64
    ids = tok("Once upon a time", return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == load_tokenizer(None)("Once upon a time")["input_ids"]  # the run's tokenizer
    assert torch.isfinite(model(ids).logits).all()
