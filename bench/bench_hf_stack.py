"""Step time and peak RSS of issue 41's HF-stack scripts on deepshard's engine against real DeepSpeed, in one run.

    flock /tmp/deepshard-heavy.lock python bench/bench_hf_stack.py [--deepspeed_venv /tmp/benchvenv] [--stages 2 3] [--out f.json]

Each script of tests/compat runs unchanged at world 2 (fp32, CPU) in issue 41's two layouts, ZeRO-2 and ZeRO-3
with the optimizer on the CPU (the layout TRL users run), twice: ``deepshard --num_gpus 2`` in this venv (the provided ``deepspeed``) and
``deepspeed --num_gpus 2`` in a venv with DeepSpeed 0.19.8 and the same transformers/accelerate/TRL/PEFT
(bench/record_hf_stack_ds.py's).  The accelerate loop runs under ``deepshard --accelerate_config zero3.yaml``,
and on DeepSpeed with the ``ACCELERATE_*`` variables ``accelerate launch`` derives from the same yaml
(``deepshard.compat.accelerate_config.launch_env``: accelerate's own code), started by ``deepspeed``.

Both run through this file's ``--worker``: it times the engine's optimizer updates (the wall time between
consecutive ``step()`` calls that end an accumulation, of the same engine: forward, backward, update, the
trainer's own work and, in GRPO, generation) and reads the worker's peak RSS (``VmHWM``) at exit.  Real
DeepSpeed gets the CPU backend nudge of bench/record_hf_trainer_ds.py.  Prints JSON: per script and engine the
median update time and the largest rank's peak RSS, and ours/DeepSpeed ratios.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import runpy
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "compat"
SCRIPTS = {"trainer": "hf_stack_trainer_script.py", "sft": "hf_stack_sft_script.py", "sft_lora": "hf_stack_sft_script.py",
           "dpo": "hf_stack_dpo_script.py", "grpo": "hf_stack_grpo_script.py", "accelerate": "hf_stack_accelerate_script.py"}
OUT_ENV = "BENCH_HF_STACK_OUT"  # the worker's result folder
LAYOUTS = {2: "ZeRO-2", 3: "ZeRO-3, optimizer offload cpu"}  # tests/compat/hf_stack_harness.write_ds_config's


def worker(script: str, argv: list[str]) -> None:
    """One rank: time the engine's updates, note the peak RSS at exit, then run the script unchanged."""
    sys.path.insert(0, str(ROOT))
    import deepspeed

    real = not deepspeed.__version__.endswith("+deepshard")
    if real:
        from bench.record_hf_trainer_ds import accelerate_gloo_on_cpu

        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        accelerate_gloo_on_cpu()
    updates: dict[int, list[float]] = {}
    engine_cls = deepspeed.DeepSpeedEngine
    original = engine_cls.step

    def step(self: object, *args: object, **kwargs: object) -> object:
        boundary = self.is_gradient_accumulation_boundary()  # type: ignore[attr-defined]
        out = original(self, *args, **kwargs)
        if boundary:
            updates.setdefault(id(self), []).append(time.perf_counter())
        return out

    engine_cls.step = step

    def report() -> None:
        rank = int(os.environ.get("RANK", "0"))
        hwm = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                   if line.startswith("VmHWM:"))
        gaps = [b - a for times in updates.values() for a, b in zip(times, times[1:])]
        Path(os.environ[OUT_ENV], f"rank{rank}.json").write_text(json.dumps(
            {"engine": deepspeed.__version__, "update_s": gaps, "updates": sum(map(len, updates.values())),
             "peak_rss_mib": hwm / 1024}))

    atexit.register(report)
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def _args(name: str, tmp: Path, stage: int) -> list[str]:
    from tests.compat.hf_stack_harness import make_id_model_dir, make_model_dir, write_ds_config

    result = ["--result", str(tmp / "result.json")]
    if name == "accelerate":
        return ["--model", make_id_model_dir(tmp / "model"), *result]
    ds = ["--ds_config", write_ds_config(tmp / "ds.json", stage, optimizer=name == "trainer"), "--out", str(tmp / "out")]
    if name == "trainer":
        return [*ds, *result]
    extra = ["--lora", "--save"] if name == "sft_lora" else []
    return ["--model", make_model_dir(tmp / "model"), *ds, *result, *extra]


def run(name: str, engine: str, deepspeed_venv: Path, stage: int) -> dict:
    from tests.compat.hf_stack_harness import run_launcher, write_accelerate_config

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "ranks").mkdir()
        env = {k: v for k, v in os.environ.items() if k not in ("DEEPSHARD_DEEPSPEED", "RANK", "WORLD_SIZE")
               and not k.startswith("ACCELERATE_")}
        env[OUT_ENV] = str(tmp / "ranks")
        tail = [str(Path(__file__).resolve()), "--worker", str(TESTS / SCRIPTS[name]), "--", *_args(name, tmp, stage)]
        if engine == "deepshard":
            launch = [str(Path(sys.executable).parent / "deepshard")]
            launch += (["--accelerate_config", write_accelerate_config(tmp, stage)] if name == "accelerate"
                       else ["--num_gpus", "2"])
        else:
            launch = [str(deepspeed_venv / "bin" / "deepspeed"), "--num_gpus", "2"]
            env["DS_ACCELERATOR"] = "cpu"
            if name == "accelerate":  # what accelerate launch gives its workers for the same yaml
                from deepshard.compat.accelerate_config import launch_env

                env.update(launch_env(write_accelerate_config(tmp, stage))[1])
        start = time.perf_counter()
        done = run_launcher([*launch, *tail], tmp, env, timeout=1200)
        wall = time.perf_counter() - start
        if done.returncode != 0:  # named in the output; the other scripts still run
            print(f"{name} on {engine}: exit {done.returncode}\n{(done.stdout + done.stderr)[-3000:]}", file=sys.stderr)
            return {"error": f"exit {done.returncode}", "wall_s": wall}
        ranks = [json.loads(p.read_text()) for p in sorted((tmp / "ranks").glob("rank*.json"))]
    assert len(ranks) == 2, f"{name} on {engine}: {len(ranks)} rank reports"
    gaps = [g for r in ranks for g in r["update_s"]]
    return {"engine": ranks[0]["engine"], "updates_per_rank": ranks[0]["updates"],
            "update_s": statistics.median(gaps), "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
            "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deepspeed_venv", default="/tmp/benchvenv")
    ap.add_argument("--scripts", nargs="+", default=list(SCRIPTS))
    ap.add_argument("--stages", nargs="+", type=int, default=[2, 3], choices=[2, 3])
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    opts, rest = ap.parse_known_args()
    if opts.worker:
        worker(opts.worker, [a for a in rest if a != "--"])
        return
    sys.path.insert(0, str(ROOT))
    venv = Path(opts.deepspeed_venv)
    if not (venv / "bin" / "deepspeed").exists():
        raise SystemExit(f"--deepspeed_venv={venv}: no bin/deepspeed there (a venv with DeepSpeed 0.19.8)")
    results: dict = {"world_size": 2, "precision": "fp32", "layouts": {}}
    for stage in opts.stages:
        layout = results["layouts"][LAYOUTS[stage]] = {}
        for name in opts.scripts:
            ours, theirs = run(name, "deepshard", venv, stage), run(name, "deepspeed", venv, stage)
            layout[name] = {"deepshard": ours, "deepspeed": theirs}
            if "error" not in ours and "error" not in theirs:
                layout[name].update(update_time_ratio=ours["update_s"] / theirs["update_s"],
                                    peak_rss_ratio=ours["peak_rss_mib"] / theirs["peak_rss_mib"])
                print(f"{LAYOUTS[stage]} {name}: update {ours['update_s']:.3f} s vs {theirs['update_s']:.3f} s, "
                      f"peak RSS {ours['peak_rss_mib']:.0f} vs {theirs['peak_rss_mib']:.0f} MiB", file=sys.stderr,
                      flush=True)
            if opts.out:  # what is done so far, should a later script hang
                Path(opts.out).write_text(json.dumps(results, indent=1) + "\n")
    text = json.dumps(results, indent=1)
    print(text)
    if opts.out:
        Path(opts.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
