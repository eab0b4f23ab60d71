"""A user's HF Llama trains under ``parallel.sp=2`` through the app (``model=hf``, ZeRO-3, gradient
accumulation, eval from its own file (``data.eval_path``), the greedy sample) and matches plain
single-process torch on whole rows.

The reference and the data are tests/finetune_app/test_layouts_hf.py's: transformers' own
``LlamaForCausalLM`` on the same rows, ``torch.optim.AdamW``, ``clip_grad_norm_``, token-weighted loss;
it shares no code with the app.  One launch of 2 ranks (~20 s).
"""

from __future__ import annotations

import json
import math
import random

import pytest

from tests.finetune_app.app_harness import run_app, scalars, write_jsonl
from tests.finetune_app.test_layouts_hf import EVAL_FRACTION, LR, SEED, SEQ, STEPS, WD, reference, user_files  # noqa: F401

pytestmark = pytest.mark.slow


def test_hf_llama_under_sequence_parallel_matches_plain_torch(tmp_path, user_files, reference):  # noqa: F811
    """The reference's held-out rows come from their own file here (``data.eval_path``), the rest
    from data.path: the eval loss is plain torch's over exactly that file's rows."""
    hf, data = user_files
    records = [json.loads(line) for line in data.read_text().splitlines()]
    order = list(range(len(records)))  # the reference's held-out documents, by test_layouts_hf's split
    random.Random(SEED).shuffle(order)
    held = set(order[:math.ceil(len(records) * EVAL_FRACTION)])
    train = write_jsonl(tmp_path / "train.jsonl", [r for i, r in enumerate(records) if i not in held])
    evals = write_jsonl(tmp_path / "eval.jsonl", [r for i, r in enumerate(records) if i in held])
    proc = run_app(tmp_path, "model=hf", f"model.path={hf}", "data=jsonl", f"data.path={train}", "data.pack=false",
                   f"data.seq_len={SEQ}", f"data.eval_path={evals}", f"data.seed={SEED}",
                   "launcher.nproc_per_node=2", "parallel.sp=2", "+zero=stage3", "train.micro_batch_size=4",
                   "train.grad_accum=2", f"train.max_steps={STEPS}", "scheduler=constant", f"optim.lr={LR}",
                   f"optim.weight_decay={WD}", "train.log_every=1", "train.sample_prompt=alice has",
                   "train.sample_tokens=3", timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "2 rank(s) (pp 1 x dp 1 x tp 1 x sp 2)" in out, out[-3000:]  # the rows really were shared
    logged = scalars(tmp_path / "run/tensorboard")
    assert logged["train/loss"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-5), out[-2000:]
    assert logged["eval/loss"][-1] == pytest.approx(reference["eval"], rel=1e-5, abs=1e-5)
    assert "sample: 'alice has' -> " in out
