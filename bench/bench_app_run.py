"""One run of the finetune app (apps/finetune/main.py, unchanged) and its figures as one JSON line.

    python bench/bench_app_run.py --name s3_cpu --out DIR [--timeout 60] -- model=small precision=bf16 +zero=stage3 ...

Reads the run's TensorBoard scalars back: step time (median gap between steps' scalars, first
``--warmup`` steps excluded), tokens/s, MFU (``train/mfu``: model FLOPs over the device table's
peak), rank 0's device peak memory (``memory/device_max_allocated_bytes_rank0`` and reserved,
logged after the first step on CUDA) and the first/last loss.  Writes ``DIR/<name>.json`` and
prints it; a failed or timed-out run still writes its return code and the tail of its log.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAIN = ROOT / "apps/finetune/main.py"


def _series(logdir: Path) -> dict[str, list[tuple[float, float]]]:
    """Every scalar tag -> [(wall_time, value)] in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.wall_time, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def figures(logdir: Path, warmup: int) -> dict[str, float | int | None]:
    s = _series(logdir)
    loss = s.get("train/loss", [])
    gaps = [b[0] - a[0] for a, b in zip(loss, loss[1:])][warmup:]
    late = slice(warmup, None)
    peak = s.get("memory/device_max_allocated_bytes_rank0", [])
    reserved = s.get("memory/device_max_reserved_bytes_rank0", [])
    state = s.get("memory/model_state_bytes_rank0", [])
    return {
        "steps": len(loss),
        "step_s": _median(gaps),
        "tokens_per_s": _median([v for _, v in s.get("train/tokens_per_s", [])[late]]),
        "mfu": _median([v for _, v in s.get("train/mfu", [])[late]]),
        "tflops": _median([v for _, v in s.get("profile/tflops", [])[late]]),
        "device_peak_allocated_gib": peak[0][1] / 2**30 if peak else None,
        "device_peak_reserved_gib": reserved[0][1] / 2**30 if reserved else None,
        "model_state_gib": state[0][1] / 2**30 if state else None,
        "first_loss": loss[0][1] if loss else None,
        "last_loss": loss[-1][1] if loss else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    ap.add_argument("--keep", action="store_true", help="keep the run dir (checkpoints included)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, after --")
    args = ap.parse_args()
    run_dir = args.out / "runs" / args.name
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, str(MAIN), *args.overrides, f"hydra.run.dir={run_dir}",
           f"checkpoint.dir={run_dir / 'checkpoints'}", "checkpoint.resume=none"]
    t0 = time.perf_counter()
    result: dict = {"name": args.name, "overrides": args.overrides}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
        result["rc"], log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        result["rc"], log = "timeout", out.decode(errors="replace") if isinstance(out, bytes) else out
    result["seconds"] = round(time.perf_counter() - t0, 1)
    try:
        result.update(figures(run_dir / "tensorboard", args.warmup))
    except Exception as e:  # no event file: the run died before its first step
        result["figures_error"] = f"{type(e).__name__}: {e}"[:300]
    if result["rc"] != 0:
        result["log_tail"] = log[-3000:]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"{args.name}.log").write_text(log)
    if not args.keep:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    print(json.dumps({k: v for k, v in result.items() if k != "log_tail"}))
    return 0 if result["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
