"""ZeRO-Infinity through the app at Llama-like shapes (``python bench/bench_infinity.py app ...``), JSON out.

For each shape (largest first), ``apps/finetune/main.py`` runs ``--steps`` steps at ``--world`` ranks
with ``+zero=stage3 +offload=nvme offload.params=nvme`` (the app's defaults otherwise: the vocabulary
tiling, the buffers it picks for the limit) inside a cgroup v1 memory group of ``--limit-gib``; the
first that trains is reported with its fp32 model states (16 B per parameter) over the limit (goal
>= 4 at world 2), its step time and losses.  The same shape then trains without offload and without
a limit (where the host has the memory): the step time against it, and the losses against it (goal:
equal to 1e-5).  A run the app refuses before start (its estimate does not fit) says so in its
``refused`` line.

    python bench/bench_infinity.py app [--world 2] [--limit-gib 2.5] [--shapes 1b,450m,358m] [--nvme-path /var/tmp]
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.* and tests.* by package path
from bench.bench_app_run import _series  # noqa: E402

# Llama-like: head_dim 128, dim/ffn in Llama's ratio, vocabulary >= 32000 (the embedded tokenizer uses
# its first 8192 ids; the rest of the rows train as any unused row does)
SHAPES = {
    # TinyLlama-1.1B's shape (dim 2048, 22 layers, 32 heads, 4 kv heads, ffn 5632, vocabulary 32000)
    "1.1b": dict(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_hidden=5632, vocab_size=32000),
    "1b": dict(dim=2048, n_layers=16, n_heads=16, n_kv_heads=4, ffn_hidden=5632, vocab_size=32000),
    "450m": dict(dim=1536, n_layers=14, n_heads=12, n_kv_heads=4, ffn_hidden=4096, vocab_size=32000),
    "358m": dict(dim=1536, n_layers=14, n_heads=12, n_kv_heads=4, ffn_hidden=4096, vocab_size=8192),
}


def num_params(shape: dict) -> int:
    d, f, v = shape["dim"], shape["ffn_hidden"], shape["vocab_size"]
    kv = d // shape["n_heads"] * shape["n_kv_heads"]
    return 2 * v * d + d + shape["n_layers"] * (2 * d * d + 2 * d * kv + 3 * d * f + 2 * d)


def run_app(shape: dict, *, world: int, steps: int, offload: bool, limit: int | None, nvme: str,
            extra: list[str], timeout_s: float) -> dict:
    """One app run (confined when ``limit``): return code, wall time, peak, losses and step times."""
    from bench.bench_infinity import memory_cgroup

    run_dir = Path(tempfile.mkdtemp(prefix="infapp-", dir=nvme))
    args = [f"model.{k}={v}" for k, v in shape.items()] + [
        f"launcher.nproc_per_node={world}", f"train.max_steps={steps}", "+zero=stage3", f"hydra.run.dir={run_dir}",
        f"checkpoint.dir={run_dir / 'ckpt'}", "checkpoint.resume=none", *extra]
    if offload:
        args += ["+offload=nvme", "offload.params=nvme", f"offload.nvme_path={nvme}"]
    cmd = [sys.executable, str(ROOT / "apps/finetune/main.py"), *args]
    out: dict = {"offload": offload, "limit_gib": None if limit is None else limit / 2**30}
    try:
        with memory_cgroup(limit) if limit else _nothing() as group:
            t0 = time.monotonic()
            pre = (lambda: (group / "cgroup.procs").write_text(str(os.getpid()))) if group else None
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=run_dir, preexec_fn=pre)
            out["wall_s"] = round(time.monotonic() - t0, 1)
            if group:
                out["peak_gib"] = round(int((group / "memory.max_usage_in_bytes").read_text()) / 2**30, 3)
        out["rc"] = proc.returncode
        lines = [x for x in proc.stderr.splitlines() if x.startswith(("error:", "warning:", "offload:", "memory:"))]
        out["said"] = lines[-3:]
        try:
            loss = _series(run_dir / "tensorboard").get("train/loss", [])
            out["losses"] = [v for _, v in loss]
            out["step_s"] = [round(b[0] - a[0], 2) for a, b in zip(loss, loss[1:])]
        except Exception as e:  # noqa: BLE001 - no event file: the run died before its first step
            out["losses_error"] = f"{type(e).__name__}: {e}"[:200]
        if not out.get("losses"):  # events not flushed (a rank killed at the final save): the progress bar's
            bar = {int(m[0]): (float(m[1]), float(m[2])) for m in re.findall(r"(\d+)/\d+ \[[^\]]*?([\d.]+)s/step, "
                                                                          r"loss=([\d.]+)", proc.stderr)}
            out["losses"] = [bar[k][1] for k in sorted(bar)]
            out["step_s"] = [bar[k][0] for k in sorted(bar)][1:]
            out["losses_from"] = "progress bar (3 decimals)"
        if proc.returncode != 0:
            out["stderr_tail"] = proc.stderr[-800:]
    except subprocess.TimeoutExpired:
        out["rc"] = "timeout"
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main(argv: list[str]) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--limit-gib", type=float, default=2.5)
    ap.add_argument("--shapes", default="450m,358m", help=f"largest first, among {', '.join(SHAPES)}")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--nvme-path", default="/var/tmp")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--no-baseline", action="store_true", help="skip the run without offload")
    ap.add_argument("extra", nargs="*", help="more Hydra overrides for every run (e.g. ac=full)")
    args = ap.parse_args(argv)
    limit = int(args.limit_gib * 2**30)
    report: dict = {"world": args.world, "limit_gib": args.limit_gib, "tried": {}}
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        confined = run_app(shape, world=args.world, steps=args.steps, offload=True, limit=limit, nvme=args.nvme_path,
                           extra=args.extra, timeout_s=args.timeout)
        report["tried"][name] = {k: confined.get(k) for k in ("rc", "said", "peak_gib", "wall_s")}
        if len(confined.get("losses") or []) < args.steps:  # trained every step (the final save may still fail)
            continue
        states = 16 * num_params(shape)
        result = {"shape": name, **shape, "params": num_params(shape), "model_states_gib": states / 2**30,
                  "states_over_limit": round(states / limit, 2), "confined": confined}
        if not args.no_baseline:
            plain = run_app(shape, world=args.world, steps=args.steps, offload=False, limit=None, nvme=args.nvme_path,
                            extra=args.extra, timeout_s=args.timeout)
            result["no_offload"] = plain
            if plain.get("losses") and confined.get("losses"):
                result["max_loss_diff"] = max(abs(a - b) for a, b in zip(confined["losses"], plain["losses"]))
            if plain.get("step_s") and confined.get("step_s"):
                result["step_time_ratio"] = round(sorted(confined["step_s"])[len(confined["step_s"]) // 2]
                                                  / sorted(plain["step_s"])[len(plain["step_s"]) // 2], 2)
        report["largest"] = result
        break
    print(json.dumps(report))
