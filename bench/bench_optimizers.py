"""The README run (apps/finetune/main.py +zero=stage3, 100 steps, same seed) with AdamW and Muon, and with
fp32 and bf16 optimizer states: final losses side by side, one JSON line.

    python bench/bench_optimizers.py [--out DIR] [--steps 100] [--timeout 600]

Each run is bench/bench_app_run.py (the app unchanged, its TensorBoard scalars read back).  No goal on
which optimizer wins; bf16 states are expected within 2% of fp32 states' final loss.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {
    "adamw": [],
    "muon": ["optim=muon"],
    "adamw_bf16_states": ["precision=bf16", "optim.state_dtype=bf16"],
    "adamw_fp32_states_bf16": ["precision=bf16"],
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/bench_optimizers")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--timeout", type=int, default=600)
    args = ap.parse_args()
    results = {}
    for name, extra in RUNS.items():
        subprocess.run([sys.executable, str(ROOT / "bench/bench_app_run.py"), "--name", name, "--out", args.out,
                        "--timeout", str(args.timeout), "--", "+zero=stage3", f"train.max_steps={args.steps}", *extra],
                       check=False, cwd=ROOT, stdout=subprocess.DEVNULL)
        path = Path(args.out) / f"{name}.json"
        results[name] = json.loads(path.read_text()) if path.exists() else {"rc": "missing"}
    final = {k: v.get("last_loss") for k, v in results.items()}
    fp32, bf16 = final["adamw_fp32_states_bf16"], final["adamw_bf16_states"]
    summary = {"final_loss": final, "bf16_vs_fp32_states": None if not (fp32 and bf16) else bf16 / fp32 - 1,
               "step_s": {k: v.get("step_s") for k, v in results.items()}}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
