"""Record real DeepSpeed running issue 32's scripts 3-5 at world 2 on CPU (gloo, fp32), into
tests/compat/fixtures/ds_scripts_more.json, which tests/compat/test_ds_scripts_more.py compares ours with
(CI has no DeepSpeed).  Scripts 1-2 (CIFAR, PipelineModule) are bench/record_ds_scripts.py's.

    pip install -r bench/requirements.txt    # the bench extra: DeepSpeed 0.19.x
    python bench/record_ds_more_scripts.py

The bodies live in tests/compat (each file's header lists every line changed from the original, and why):
  - ds_chat_sft_script.py: DeepSpeed-Chat step-1 SFT (ZeRO-3, FusedAdam + transformers' cosine schedule
    passed to initialize, HF gradient checkpointing, save_hf_format + save_zero_three_model);
  - ds_hello_script.py: HelloDeepSpeed's train_bert_ds.py (RoBERTa MLM, ZeRO-1 + offload_optimizer cpu,
    save_checkpoint with client_state, a second invocation resuming with load_checkpoint);
  - ds_gan_script.py: DeepSpeedExamples' training/gan (two engines over client torch.optim.Adam).
One 2-rank launch runs the three (ds_more_scripts_harness.run_more) with ``import deepspeed``; lines
changed for the DeepSpeed run only: ``init_distributed(dist_backend="gloo")`` first and ``DS_ACCELERATOR=cpu``.
Kept as fixtures beside the JSON: DeepSpeed's saved SFT model (ds_chat_sft/pytorch_model.bin, rank 0's
save_zero_three_model output) and its HelloDeepSpeed checkpoint after the first invocation
(ds_hello_zero1/: hparams.json, latest, global_step6), which the tests import with from_deepspeed and
resume with ours.  DeepSpeed's C++ FusedAdam / DeepSpeedCPUAdam build on this CPU host (JIT, ~2 min once).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.* and tests.* by package path
FIXTURES = ROOT / "tests" / "compat" / "fixtures"
HELLO_TAG = "global_step6"  # the first invocation's last save (steps 1-6; re-saved at its exit as step 7)


def worker(root: str) -> dict:
    sys.stdout.flush()
    os.dup2(2, 1)  # DeepSpeed's banners go to stderr
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    from tests.compat.ds_more_scripts_harness import run_more

    out = run_more(root, deepspeed)
    out["deepspeed"] = deepspeed.__version__
    return out


def keep_hello(exp_dir: Path, dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    shutil.copy(exp_dir / "hparams.json", dest)
    (dest / "latest").write_text(HELLO_TAG)
    shutil.copytree(exp_dir / HELLO_TAG, dest / HELLO_TAG)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(FIXTURES / "ds_scripts_more.json"))
    args = ap.parse_args()
    import torch

    from deepshard.launch.local import launch_local

    with tempfile.TemporaryDirectory() as tmp:
        ranks = launch_local(worker, 2, tmp)
        (FIXTURES / "ds_chat_sft").mkdir(exist_ok=True)
        shutil.copy(ranks[0]["sft"]["saved"], FIXTURES / "ds_chat_sft" / "pytorch_model.bin")
        keep_hello(Path(ranks[0]["hello"]["exp_dir"]), FIXTURES / "ds_hello_zero1")
    record = {"deepspeed": ranks[0]["deepspeed"], "torch": torch.__version__, "world_size": 2,
              "device": "cpu (gloo, fp32)", "hello_tag": HELLO_TAG,
              "sft": [{k: r["sft"][k] for k in ("losses", "evals", "lrs")} for r in ranks],
              "hello": [{k: r["hello"][k] for k in ("losses", "resumed")} for r in ranks],
              "gan": [r["gan"] for r in ranks]}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("deepspeed", "sft", "hello", "gan")})[:3000])


if __name__ == "__main__":
    main()
