"""Record that real DeepSpeed 0.19.8 resumes our export of a ``deepspeed.moe`` checkpoint as its own: DeepSpeed's
MoE checkpoint (tests/compat/fixtures/ds_moe_ckpt, written by bench/record_ds_moe.py's ``top2`` variant) goes
through our converters as a user runs them (``from_deepspeed``, then ``to_deepspeed``, with this checkout's
venv), and DeepSpeed at world 4 (CPU, gloo) loads the export into the CIFAR-10 MoE script's fresh engine
(``--load_dir``) and trains the next epoch.  Its losses go into tests/compat/fixtures/ds_moe_cifar.json as
``resumed_from_export`` beside ``resumed`` (DeepSpeed after loading its own files), which
tests/compat/test_ds_moe_export.py holds equal.

    /tmp/benchvenv/bin/python bench/record_ds_moe_export.py [OUR_PYTHON]   # default: .venv/bin/python
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURES = ROOT / "tests" / "compat" / "fixtures"


def worker(load_dir: str) -> list[float]:
    sys.stdout.flush()
    os.dup2(2, 1)  # DeepSpeed's banners go to stderr
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    from bench.bench_ds_moe_cifar import main
    from bench.record_ds_moe import CKPT_VARIANT, VARIANTS

    return main([*VARIANTS[CKPT_VARIANT], "--load_dir", load_dir], deepspeed)["resumed"]


def main() -> None:
    from deepshard.launch.local import launch_local

    ours = sys.argv[1] if len(sys.argv) > 1 else str(ROOT / ".venv" / "bin" / "python")
    with tempfile.TemporaryDirectory() as tmp:
        for tool, src, dst in (("from_deepspeed", FIXTURES / "ds_moe_ckpt", "ours"), ("to_deepspeed", "ours", "ds")):
            subprocess.run([ours, "-m", f"deepshard.finetune.tools.{tool}", str(Path(tmp) / src), str(Path(tmp) / dst)],
                           check=True, cwd=ROOT)
        ranks = launch_local(worker, 4, str(Path(tmp) / "ds"))
    path = FIXTURES / "ds_moe_cifar.json"
    record = json.loads(path.read_text())
    for rank, losses in zip(record["losses"]["top2"], ranks, strict=True):
        rank["resumed_from_export"] = losses
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps([{k: r[k] for k in ("resumed", "resumed_from_export")} for r in record["losses"]["top2"]])[:800])


if __name__ == "__main__":
    main()
