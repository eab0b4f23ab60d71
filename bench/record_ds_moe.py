"""Record real DeepSpeed 0.19.8 running bench/bench_ds_moe_cifar.py (DeepSpeedExamples' CIFAR-10 MoE script)
at world 4 on CPU (gloo, fp32) into tests/compat/fixtures/ds_moe_cifar.json, which
tests/compat/test_ds_moe_ep.py compares deepshard's losses with (within 1e-5; CI has no DeepSpeed).

    /tmp/benchvenv/bin/python bench/record_ds_moe.py    # the bench venv: pip install -r bench/requirements.txt

Variants (``VARIANTS``), each the script's argv after ``--deepspeed``: ``--ep-world-size 2`` (expert groups
[0, 1], [2, 3]; expert-data-parallel groups [0, 2], [1, 3]) with two MoE layers (``--num-experts 2 4``)
and ``--moe-param-group``: top-1 with RSample noise and random token selection (the script's run_ds_moe.sh
flags), top-2 (Gumbel-sampled second expert), and top-1 at ZeRO-2.  Launched by deepshard's
``launch_local`` (4 ranks); each rank sets ``DS_ACCELERATOR=cpu`` and ``init_distributed("gloo")`` before
the body.  A variant DeepSpeed cannot run on this host is recorded as the error it raised, never as
numbers.  The top-2 run's DeepSpeed checkpoint (``save_checkpoint`` after the epoch: its
``layer_N_expert_M_mp_rank_00_model_states.pt`` and ``expp_rank_R_mp_rank_00_optim_states.pt`` files) is
kept as fixtures/ds_moe_ckpt/ for the importer's test, with the losses of one more epoch after DeepSpeed
resumed it into a fresh engine (``resumed``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURES = ROOT / "tests" / "compat" / "fixtures"
MOE = ["--moe", "--ep-world-size", "2", "--num-experts", "2", "4", "--moe-param-group", "--deepspeed"]
VARIANTS = {"top1_rsample": [*MOE, "--top-k", "1", "--noisy-gate-policy", "RSample"],
            "top2": [*MOE, "--top-k", "2"],
            "top1_zero2": [*MOE, "--top-k", "1", "--stage", "2"]}
CKPT_VARIANT = "top2"


def worker(ckpt_dir: str) -> dict:
    sys.stdout.flush()
    os.dup2(2, 1)  # DeepSpeed's banners go to stderr
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    from bench.bench_ds_moe_cifar import main

    out: dict = {"deepspeed": deepspeed.__version__}
    for name, argv in VARIANTS.items():
        try:
            extra = ["--ckpt_dir", os.path.join(ckpt_dir, "ckpt")] if name == CKPT_VARIANT else []
            out[name] = main([*argv, *extra], deepspeed)
        except Exception as err:  # what DeepSpeed raised on this host, not numbers
            out[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
    return out


def main() -> None:
    import torch

    from deepshard.launch.local import launch_local

    with tempfile.TemporaryDirectory() as tmp:
        ranks = launch_local(worker, 4, tmp)
        kept = FIXTURES / "ds_moe_ckpt"
        shutil.rmtree(kept, ignore_errors=True)
        if (Path(tmp) / "ckpt").exists():
            shutil.copytree(Path(tmp) / "ckpt", kept, ignore=shutil.ignore_patterns("zero_to_*.py"))
    record = {"deepspeed": ranks[0]["deepspeed"], "torch": torch.__version__, "world_size": 4,
              "device": "cpu (gloo, fp32)", "variants": VARIANTS,
              "losses": {name: [r[name] for r in ranks] for name in VARIANTS}}
    (FIXTURES / "ds_moe_cifar.json").write_text(json.dumps(record, indent=1) + "\n")
    for name, per_rank in record["losses"].items():
        print(name, json.dumps(per_rank)[:400])


if __name__ == "__main__":
    main()
