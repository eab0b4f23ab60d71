"""How long a sequence trains in the same per-rank memory: sp=1, sp=2, sp=2 + tiled MLP + activation
checkpointing (world 2 on this host; ``python bench/bench_long_context.py``, JSON out).

Each rank measures its own peak RSS growth over one training step (after a first step has created the
optimizer state): ``/proc/self/clear_refs`` resets the high-water mark, VmHWM - VmRSS before the step is
what the step's activations and temporaries took.  glibc would keep freed tensors resident (its mmap
threshold grows with use) and hide the growth: the workers run with a fixed ``MALLOC_MMAP_THRESHOLD_``
so every large tensor is its own mapping, returned on free, and ``malloc_trim`` runs before each step.  sp=1 runs two independent rows (dp 2), sp=2 one row
shared by both ranks, so every variant holds one row's worth of work per rank pair.  The budget is
sp=1's peak at ``--budget-seq``; each variant's longest ``seq_len`` (from the list) within it, and the
ratio against sp=1's, are the answer.  Tokens/s counts every rank's tokens of the measured step.
Beside each measured peak, ``estimate_mb``: the app's estimator (models/working_set.py) for the same
step, and ``estimate_over_measured`` its range of ratios per variant.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time
from functools import partial
from typing import Any

SEQS = (1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768)  # 1.5x and 2x steps
VARIANTS = {"sp1": (1, 1, "none"), "sp2": (2, 1, "none"), "sp2_tiled_ac": (2, 8, "full")}  # sp, mlp tiles, ac


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _measure(sp: int, tiles: int, ac: str, seq: int, ac_offload: bool = False, model_cfg: Any = None) -> dict:
    """One layout's measured peak and estimate; ``model_cfg``: any registered family's config (the
    registry builds and parallelizes it; its ``vocab_size`` draws the tokens), else the bench's Llama."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from deepshard.core import EngineConfig, OptimConfig, ParallelDims, ZeroConfig, build_mesh, initialize
    from deepshard.core.mesh import local_device
    from deepshard.core.sequence_parallel import shard_sequence
    from deepshard.finetune.models.llama import LlamaConfig
    from deepshard.finetune.models.registry import spec_of

    cfg = model_cfg or LlamaConfig(vocab_size=2048, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=512,
                                   max_seq_len=max(SEQS))
    cfg = dataclasses.replace(cfg, mlp_tiles=tiles)
    spec = spec_of(cfg)
    config = EngineConfig(zero=ZeroConfig(stage=1), optim=OptimConfig(lr=1e-4), ac=ac, ac_offload=ac_offload)
    mesh = build_mesh(ParallelDims(sp=sp))
    torch.manual_seed(0)
    model = spec.build(cfg)
    model.init_weights(0)
    engine = initialize(model.to(local_device()), config, mesh=mesh,
                        parallelize_fn=partial(spec.parallelize, mesh=mesh, zero=config.zero, ac=ac,
                                               ac_offload=ac_offload))
    g = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=g)
    rank = mesh["sp"].get_local_rank()
    ids = shard_sequence(ids, rank, sp)

    def step() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        count = engine.global_num_items(ids.numel())
        engine.backward(engine(ids, ids, reduction="sum"), num_items=count)
        engine.step()
        dist.barrier()
        return time.perf_counter() - t0

    step()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status("VmRSS")
    seconds = step()
    peak = _status("VmHWM") - before
    out = torch.tensor([float(peak)], device=local_device())
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    est = estimate_step(cfg, sum(p.numel() for p in model.parameters()), sp=sp, tiles=tiles, ac=ac, seq=seq,
                        ac_offload=ac_offload)
    return {"seq_len": seq, "peak_mb": round(out.item() / 2**20, 1), "estimate_mb": round(est / 2**20, 1),
            "tokens_per_s": round(2 * seq / sp / seconds)}


def estimate_step(cfg, num_params: int, *, sp: int, tiles: int, ac: str, seq: int, ac_offload: bool = False,
                  world: int = 2) -> int:
    """The estimator's figure for one rank's growth over a step of this layout (ZeRO 1 over the world)."""
    import dataclasses

    from deepshard.finetune.models.memory_plan import ModelCounts
    from deepshard.finetune.models.working_set import RunShape, working_set

    cfg = dataclasses.replace(cfg, mlp_tiles=tiles)
    shape = RunShape(stage=1, dp=world, seq_len=seq // sp, sp=sp, mlp_tiles=tiles, ac=ac, ac_offload=ac_offload)
    return step_growth(working_set(cfg, ModelCounts(num_params), shape, baseline=0), on_device=False)


def step_growth(ws, on_device: bool) -> int:
    """The part of the estimator's working set ``ws`` that this bench measures: what a step adds on top
    of the model states and the process.  Activations and the loss at the start of backward, or the
    gradients once the activations are freed (stages 0-2: they grow as the blocks' activations go),
    plus the offloaded block inputs where the host's RAM is the device's too.  It lives here because
    only this comparison needs it: the app sizes a run by the whole working set."""
    act = ws.device.get("activations", 0) + ws.device.get("loss", 0)
    act += 0 if on_device else ws.host.get("activations (offloaded inputs)", 0)
    grads = ws.device.get("gradients in flight", 0) + ws.device.get("gathered units", 0)
    return max(act, grads)


def _worker(seqs: tuple[int, ...], budget_seq: int) -> dict:
    """Every variant from the shortest seq_len up, until its peak passes the budget (sp=1's peak at
    ``budget_seq``): a longer one only grows."""
    from deepshard.core import init_distributed

    init_distributed()
    results: dict[str, list[dict]] = {}
    budget = None
    for name, (sp, tiles, ac) in VARIANTS.items():
        results[name] = []
        for seq in seqs:
            r = _measure(sp, tiles, ac, seq)
            results[name].append(r)
            if name == "sp1" and seq == budget_seq:
                budget = r["peak_mb"]
            if budget is not None and r["peak_mb"] > budget:
                break
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seqs", default=",".join(map(str, SEQS)))
    parser.add_argument("--budget-seq", type=int, default=2048, help="sp=1's peak at this seq_len is the budget")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # before the launcher records the environment
    from deepshard.launch.local import launch_local

    seqs = tuple(int(s) for s in args.seqs.split(","))
    t0 = time.perf_counter()
    results = launch_local(_worker, 2, seqs, args.budget_seq)[0]
    budget = next(r["peak_mb"] for r in results["sp1"] if r["seq_len"] == args.budget_seq)
    longest = {name: max((r["seq_len"] for r in rows if r["peak_mb"] <= budget), default=0)
               for name, rows in results.items()}
    print(json.dumps({
        "world": 2, "budget_mb": budget, "budget_from": f"sp1 at seq_len {args.budget_seq}",
        "longest_seq_len": longest,
        "vs_sp1": {name: round(v / max(longest["sp1"], 1), 2) for name, v in longest.items()},
        "estimate_over_measured": {name: [round(min(r["estimate_mb"] / r["peak_mb"] for r in rows), 2),
                                          round(max(r["estimate_mb"] / r["peak_mb"] for r in rows), 2)]
                                   for name, rows in results.items()},
        "runs": results, "seconds": round(time.perf_counter() - t0, 1),
    }, indent=1))


if __name__ == "__main__":
    main()
