"""MoE at world 4 (gloo): expert parallelism against ZeRO-3 gathering every expert, in one launch.

Layouts (dense params ZeRO-3 over all 4 ranks in each):
- ``ep4``: ``parallel.ep=4``, each rank 2 of the 8 experts whole, tokens to them by all-to-all;
- ``zero3``: ``parallel.ep=1``, every expert on every rank, ZeRO-3 all-gathers each layer's experts
  in forward and backward and reduce-scatters their gradients;
- ``ep2_dp2``: ``parallel.ep=2``, each rank 4 experts, ZeRO-3-sharded over the 2 ranks left after ep.

Fixed shape: 8 experts, top-2, hidden 256, expert FFN 512, 4 layers, 4096 tokens per step per rank
(16 rows of 256), fp32.  Per layout: tokens/s over the world (median step), bytes this rank sent
per step counted at the collective (every ``torch.distributed`` call wrapped, as bench_zeropp.py
counts: an all-to-all's bytes from its input splits), and each rank's peak RSS; JSON on stdout.

    python bench/bench_moe.py [--steps 3] [--warmup 1] [--layouts ep4 zero3 ep2_dp2]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch

from deepshard.launch.local import launch_local

WORLD, EXPERTS, TOP_K, DIM, FFN, LAYERS, ROWS, SEQ = 4, 8, 2, 256, 512, 4, 16, 256
LAYOUTS = {"ep4": 4, "zero3": 1, "ep2_dp2": 2}


class Counter:
    """Wraps torch.distributed's collectives; ``total`` bytes this rank sent to other ranks while ``on``."""

    NAMES = ("broadcast", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
             "reduce_scatter_single", "all_to_all_single", "all_reduce", "batch_isend_irecv")

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist, self.on, self.total = dist, False, 0
        for name in self.NAMES:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _count(self, name: str, args: tuple, kwargs: dict) -> None:
        dist = self.dist
        group = kwargs.get("group")
        g = dist.get_world_size(group)
        if name == "batch_isend_irecv":
            self.total += sum(op.tensor.nbytes for op in args[0] if "isend" in getattr(op.op, "__name__", ""))
        elif name == "broadcast":
            src = kwargs.get("src", args[1] if len(args) > 1 else None)
            self.total += args[0].nbytes * (g - 1) if src == dist.get_rank() else 0
        elif name.startswith("all_gather"):
            self.total += kwargs.get("input_tensor", args[1] if len(args) > 1 else None).nbytes * (g - 1)
        elif name.startswith("reduce_scatter"):
            self.total += kwargs.get("input", args[1] if len(args) > 1 else None).nbytes * (g - 1) / g
        elif name == "all_to_all_single":
            inp = args[1]
            splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
            me = dist.get_rank(group)
            if splits is None:
                self.total += inp.nbytes * (g - 1) / g
            else:
                row = inp.nbytes / max(1, inp.shape[0])
                self.total += row * sum(s for j, s in enumerate(splits) if j != me)
        elif name == "all_reduce":
            self.total += 2 * args[0].nbytes * (g - 1) / g

    def _wrap(self, name: str, fn):
        def counted(*args, **kwargs):
            if self.on:
                self._count(name, args, kwargs)
            return fn(*args, **kwargs)

        return counted


def _layout(name: str, steps: int, warmup: int, counter: Counter, profile: bool = False) -> dict:
    import torch.distributed as dist

    from deepshard.core import (
        EngineConfig,
        OptimConfig,
        ParallelDims,
        PrecisionConfig,
        ZeroConfig,
        build_mesh,
        initialize,
    )
    from deepshard.core.mesh import local_device
    from deepshard.finetune.models import registry
    from deepshard.finetune.models.qwen3_moe import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=2048, dim=DIM, n_layers=LAYERS, n_heads=4, n_kv_heads=4, head_dim=64,
                         ffn_hidden=FFN, max_seq_len=SEQ, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                         moe_hidden=FFN, norm_topk_prob=True, router_aux_loss_coef=0.01)
    spec = registry.get("qwen3_moe")
    torch.manual_seed(0)
    model = spec.build(cfg).to(local_device())
    model.init_weights(0)
    config = EngineConfig(zero=ZeroConfig(stage=3), precision=PrecisionConfig(dtype="fp32"),
                          optim=OptimConfig(lr=1e-4, grad_clip=1.0))
    mesh = build_mesh(ParallelDims(dp=WORLD, ep=LAYOUTS[name]))
    from functools import partial

    engine = initialize(model, config, mesh=mesh,
                        parallelize_fn=partial(spec.parallelize, mesh=mesh, zero=config.zero, dtype="fp32", ac="none"))
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    times, sent = [], []
    for step in range(warmup + steps):
        ids = torch.randint(0, cfg.vocab_size, (ROWS, SEQ + 1), generator=g).to(local_device())
        dist.barrier()
        counter.total, counter.on = 0, step >= warmup
        t0 = time.perf_counter()
        num_items = engine.global_num_items(ROWS * SEQ)
        loss = engine(ids[:, :-1], ids[:, 1:], reduction="sum")
        engine.backward(loss, num_items=num_items)
        engine.step()
        counter.on = False
        dist.barrier()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
            sent.append(counter.total)
    step_s = statistics.median(times)
    out = {"step_s": step_s, "tokens_per_s": WORLD * ROWS * SEQ / step_s, "bytes_sent_per_step": statistics.median(sent)}
    if profile:  # one more step under torch's profiler (not timed): where this layout's time goes
        ids = torch.randint(0, cfg.vocab_size, (ROWS, SEQ + 1), generator=g).to(local_device())
        with torch.profiler.profile() as prof:
            loss = engine(ids[:, :-1], ids[:, 1:], reduction="sum")
            engine.backward(loss, num_items=engine.global_num_items(ROWS * SEQ))
            engine.step()
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
        out["profile_self_ms"] = {e.key: round(e.self_cpu_time_total / 1e3, 1) for e in ops}
    return out


def _worker(layouts: list[str], steps: int, warmup: int, profile: bool = False) -> dict:
    from deepshard.core import init_distributed

    init_distributed()
    counter = Counter()
    out = {}
    for name in layouts:
        out[name] = _layout(name, steps, warmup, counter, profile)
        import gc

        gc.collect()
    # peak RSS of the whole run: the first layout's is alone in ru_maxrss only if run alone (--layouts X)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--separate", action="store_true", help="one launch per layout (peak RSS per layout)")
    ap.add_argument("--profile", action="store_true", help="one more step per layout under torch's profiler: "
                                                          "rank 0's 15 ops of most self time")
    args = ap.parse_args()
    runs = ([[n] for n in args.layouts] if args.separate else [args.layouts])
    result: dict = {"shape": {"world": WORLD, "experts": EXPERTS, "top_k": TOP_K, "hidden": DIM, "expert_ffn": FFN,
                              "layers": LAYERS, "tokens_per_step_per_rank": ROWS * SEQ}, "layouts": {}}
    for names in runs:
        ranks = launch_local(_worker, WORLD, names, args.steps, args.warmup, args.profile)
        for name in names:
            result["layouts"][name] = {
                "tokens_per_s": ranks[0][name]["tokens_per_s"], "step_s": ranks[0][name]["step_s"],
                "bytes_sent_per_step_per_rank": [r[name]["bytes_sent_per_step"] for r in ranks],
                "peak_rss_mb_per_rank": [r["peak_rss_mb"] for r in ranks],
                **({"profile_self_ms_rank0": ranks[0][name]["profile_self_ms"]} if args.profile else {})}
    lay = result["layouts"]
    if "ep4" in lay and "zero3" in lay:
        result["ep4_vs_zero3"] = {
            "tokens_per_s": lay["ep4"]["tokens_per_s"] / lay["zero3"]["tokens_per_s"],
            "bytes": sum(lay["ep4"]["bytes_sent_per_step_per_rank"]) / sum(lay["zero3"]["bytes_sent_per_step_per_rank"])}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
