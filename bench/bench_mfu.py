"""Eager vs ``compile=true`` through the app, in one run: the README model and ``model=small`` at
world 2, ZeRO 0, 2 and 3; tokens/s, MFU, the largest process's peak RSS and compile time (cold: each run's inductor
cache is its own run dir).  JSON on stdout (and ``--out FILE``).

    python bench/bench_mfu.py [--models tiny,small] [--stages 0,2,3] [--steps tiny=30,small=8]

Each run is ``apps/finetune/main.py`` unchanged, the same config apart from ``compile``; tokens/s and
MFU are medians over the steps after ``--warmup`` (step 1 compiles); ``ratio`` is compiled over eager
tokens/s.  On a GPU the same runs print MFU against torchtitan's published 33-39% (Llama-3.1-8B, 8xH100).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAIN = ROOT / "apps/finetune/main.py"
TORCHTITAN_MFU = (0.33, 0.39)


def _watch(cmd: list[str], timeout: float, env: dict) -> tuple[object, str, float]:
    """Run ``cmd``; its return code, output and the largest RSS any of its processes reached (MiB,
    sampled every 0.2 s: the workers are not reaped by their parent's parent, so rusage misses them)."""
    import psutil

    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
        peak, start = 0, time.perf_counter()
        while proc.poll() is None:
            if time.perf_counter() - start > timeout:
                proc.kill()
                proc.wait()
                break
            try:
                procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
                peak = max([peak, *(p.memory_info().rss for p in procs if p.is_running())])
            except psutil.Error:
                pass
            time.sleep(0.2)
        log.seek(0)
        rc = proc.returncode if proc.returncode is not None else "timeout"
        return rc, log.read(), peak / 2**20


def _scalars(logdir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def run(model: str, stage: int, compiled: bool, steps: int, warmup: int, out: Path, timeout: float) -> dict:
    name = f"{model}_zero{stage}_{'compiled' if compiled else 'eager'}"
    run_dir = out / name
    cmd = [sys.executable, str(MAIN), f"model={model}", f"+zero=stage{stage}",
           f"compile={'true' if compiled else 'false'}", f"train.max_steps={steps}", "launcher.nproc_per_node=2",
           f"train.log_every={steps}", "checkpoint.every_steps=0", "checkpoint.resume=none",
           f"checkpoint.dir={run_dir / 'ckpt'}", f"hydra.run.dir={run_dir}", "precision=fp32"]
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}  # cold: the run dir's cache
    t0 = time.perf_counter()
    rc, log, peak_mib = _watch(cmd, timeout, env)
    result: dict = {"name": name, "model": model, "zero": stage, "compile": compiled, "rc": rc,
                    "wall_s": round(time.perf_counter() - t0, 1), "peak_rss_mib": round(peak_mib, 1)}
    try:
        s = _scalars(run_dir / "tensorboard")
        late = slice(warmup, None)
        result.update(tokens_per_s=round(statistics.median(s["train/tokens_per_s"][late])),
                      mfu=round(statistics.median(s["train/mfu"][late]), 4) if "train/mfu" in s else None,
                      final_loss=round(s["train/loss"][-1], 4))
        if compiled:
            result.update(compile_s=round(s["compile/seconds"][-1], 1), graphs=int(s["compile/graphs"][-1]),
                          recompiles=int(s["compile/recompiles"][-1]))
    except Exception as e:  # the run died before logging
        result["error"] = f"{type(e).__name__}: {e}"[:200]
        result["log_tail"] = log[-1500:]
    done = [line for line in log.splitlines() if line.startswith("done:")]
    result["done"] = done[-1] if done else None
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--stages", default="0,2,3")
    ap.add_argument("--steps", default="tiny=30,small=8", help="optimizer steps per run, per model")
    ap.add_argument("--warmup", default="tiny=5,small=3", help="steps left out of the medians, per model")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    steps = dict(kv.split("=") for kv in args.steps.split(","))
    warmup = dict(kv.split("=") for kv in args.warmup.split(","))
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_mfu_") as tmp:
        for model in args.models.split(","):
            for stage in map(int, args.stages.split(",")):
                pair = [run(model, stage, c, int(steps[model]), int(warmup[model]), Path(tmp), args.timeout)
                        for c in (False, True)]
                eager, comp = pair
                if eager.get("tokens_per_s") and comp.get("tokens_per_s"):
                    comp["ratio"] = round(comp["tokens_per_s"] / eager["tokens_per_s"], 3)
                runs += pair
                print(json.dumps(pair[-1]), file=sys.stderr)
    import torch

    report = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "world": 2,
              "runs": runs}
    if torch.cuda.is_available():
        report["torchtitan_mfu"] = TORCHTITAN_MFU
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
