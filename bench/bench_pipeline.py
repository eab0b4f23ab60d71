"""Pipeline schedules at pp=2 against pp=1 in the same run; measured bubble next to theory.

    python bench/bench_pipeline.py [--steps 4] [--seq 128] [--rows 4] [--layers 8]

Prints one JSON object.  For every schedule and microbatch count m in (2, 4, 8) it reports the
step time at pp=2 (2 ranks) and at pp=1 (1 rank, the same global batch of m microbatches,
accumulated), their ratio, and the bubble fraction.

Bubble, measured: on each rank, busy = time inside the stage's compute calls (forward_one_chunk,
backward_one_chunk, backward_weight_one_chunk and the loss) during ``schedule.step``; the bubble
is 1 - busy / (wall time of ``schedule.step``) on each rank's fastest timed step, averaged over
ranks (the host is shared: the fastest step is the least disturbed).  Everything
not compute counts as bubble: waiting in recv for the neighbour stage, the p2p copies and the
schedule's own bookkeeping, so pp=1 (no pipeline, no p2p) is reported too as the overhead floor.
Theory for gpipe/1f1b: (p-1)/(m+p-1); for the interleaved schedules with v stages per rank
(p-1)/(v*m+p-1) (Megatron's interleaved bound; zero bubble should land below it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
MICROBATCHES = (2, 4, 8)


def _timed(fn, acc: list[float]):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[0] += time.perf_counter() - t
    return wrapper


def _measure(pp: int, schedule: str, m: int, args: argparse.Namespace) -> dict[str, float]:
    """Step and schedule times and the busy fraction on this rank (a process group exists)."""
    from deepshard.core import EngineConfig, OptimConfig, ParallelDims, ZeroConfig, build_mesh
    from deepshard.finetune.models.llama import Llama, LlamaConfig
    from deepshard.finetune.models.llama.parallelize import pipeline_llama

    cfg = LlamaConfig(vocab_size=2048, dim=256, n_layers=args.layers, n_heads=8, n_kv_heads=4, ffn_hidden=704,
                      max_seq_len=args.seq)
    torch.manual_seed(0)
    model = Llama(cfg)
    model.init_weights(0)
    mesh = build_mesh(ParallelDims(pp=pp, dp=1, tp=1))
    config = EngineConfig(zero=ZeroConfig(stage=0), optim=OptimConfig(lr=1e-4, grad_clip=1.0))
    pipe_engine = pipeline_llama(model, mesh, config, schedule=schedule, microbatches=m)
    busy = [0.0]
    for stage in pipe_engine.pipeline.stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, name, _timed(getattr(stage, name), busy))
    loss = pipe_engine.pipeline.loss
    loss.loss_fn = _timed(loss.loss_fn, busy)
    sched_time = [0.0]
    sched = pipe_engine.pipeline.schedule
    sched.step = _timed(sched.step, sched_time)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.steps + 1, m * args.rows, args.seq + 1), generator=g)
    steps, samples = [], []
    for i in range(args.steps + 1):  # the first step warms up (shape inference, p2p setup)
        busy[0] = sched_time[0] = 0.0
        result = pipe_engine.train_step(tokens[i, :, :-1], tokens[i, :, 1:])
        if i:
            steps.append(result.time_s)
            samples.append((sched_time[0], busy[0]))
    sched_s, busy_s = min(samples)  # the least disturbed step: the machine is shared
    return {"step_s": min(steps), "step_median_s": statistics.median(steps), "schedule_s": sched_s,
            "bubble": 1.0 - busy_s / sched_s}


def _worker(args: argparse.Namespace) -> list[dict]:
    from deepshard.core import init_distributed

    init_distributed()
    torch.set_num_threads(1)
    _measure(2, "gpipe", 2, args)  # warm every code path once before timing anything
    out = []
    for schedule in SCHEDULES:
        for m in MICROBATCHES:
            out.append({"schedule": schedule, "microbatches": m, **_measure(2, schedule, m, args)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rows", type=int, default=4, help="rows per microbatch")
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    from deepshard.launch.local import launch_local

    t0 = time.perf_counter()
    per_rank = launch_local(_worker, 2, args)
    # pp=1 afterwards, in this process: one rank, one thread, the other core idle
    from deepshard.core import init_distributed

    init_distributed()
    torch.set_num_threads(1)
    _measure(1, "gpipe", 2, args)
    baseline = {m: _measure(1, "gpipe", m, args) for m in MICROBATCHES}
    p = 2
    results = []
    for i, row in enumerate(per_rank[0]):
        m, name = row["microbatches"], row["schedule"]
        v = 2 if name in ("interleaved_1f1b", "zero_bubble") else 1
        pp2_step = max(r[i]["step_s"] for r in per_rank)
        results.append({
            "schedule": name, "microbatches": m, "stages_per_rank": v,
            "pp1_step_s": round(baseline[m]["step_s"], 4),
            "pp2_step_s": round(pp2_step, 4),
            "pp2_step_median_s": round(max(r[i]["step_median_s"] for r in per_rank), 4),
            "pp2_over_pp1": round(pp2_step / baseline[m]["step_s"], 3),
            "ideal_pp2_over_pp1": round((v * m + p - 1) / (v * m * p), 3),
            "bubble_measured": round(statistics.mean(r[i]["bubble"] for r in per_rank), 3),
            "bubble_measured_per_rank": [round(r[i]["bubble"], 3) for r in per_rank],
            "bubble_theory": round((p - 1) / (v * m + p - 1), 3),
            "pp1_overhead_fraction": round(baseline[m]["bubble"], 3),
        })
    print(json.dumps({
        "bench": "pipeline", "pp": p, "device": "cpu (gloo), 1 thread per rank",
        "model": {"dim": 256, "n_layers": args.layers, "vocab": 2048, "seq": args.seq,
                  "rows_per_microbatch": args.rows},
        "timed_steps": args.steps,
        "method": ("step times: min over timed steps after a warm-up run and one warm-up step (the host is "
                   "shared and noisy; medians beside), pp=2 takes the slower rank; bubble_measured: 1 - (time "
                   "in stage forward/backward/loss calls) / (wall time of schedule.step) on each rank's "
                   "fastest step, mean over ranks (recv waits, p2p and scheduling count as "
                   "bubble); bubble_theory: (p-1)/(v*m+p-1), v = stages per rank; ideal_pp2_over_pp1: "
                   "(v*m+p-1)/(v*m*p), the step-time ratio a perfect 2-stage split would reach"),
        "results": results,
        "wall_s": round(time.perf_counter() - t0, 1),
    }, indent=1))


if __name__ == "__main__":
    main()
