"""ZeRO++ at world 4 (gloo, "nodes" of 2 consecutive ranks): bytes each step sends, in total and
across nodes, for flat ZeRO-3, HSDP (2 x 2), hpZ (2), qwZ, qgZ, qwZ + hpZ + qgZ, and HSDP with qgZ
(its all-reduce across the replicas quantized too) and qwZ, their ratios to flat ZeRO-3, and step
times, all in one launch.

Bytes are counted at the collective: every ``torch.distributed`` call the step makes (FSDP2's,
ours, the loss and norm all-reduces) is wrapped, and the bytes this rank sends to each peer are
added up from the tensors it passes, as a direct algorithm moves them: a broadcast sends the tensor
to every peer, an all-gather this rank's input, a reduce-scatter or all-to-all chunk ``j`` to peer
``j``, an all-reduce ``2 x size / G`` to each peer (reduce-scatter + all-gather), a send its tensor.
A peer in another node makes those bytes cross-node.  (gloo's own algorithms may route differently;
the counts are what each rank hands over, the quantity ZeRO++ reduces.)

DeepSpeed's ZeRO++ on the same model and counts: bench/bench_zeropp_deepspeed.py (its ZeRO-3 and hpZ run here;
its qwZ/qgZ quantizers are CUDA ops, QuantizerBuilder, with no CPU fallback).

    python bench/bench_zeropp.py [--steps 6] [--warmup 2] [--layers 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from deepshard.launch.local import launch_local

NODE = 2  # ranks per simulated node
SEQ, MBS = 128, 2
CONFIGS = {
    "zero3": ({}, {}),
    "hsdp": ({"dp_replicate": 2}, {}),
    "hpz": ({}, {"hpz_partition_size": NODE}),
    "qwz": ({}, {"quantized_weights": True}),
    "qgz": ({}, {"quantized_gradients": True, "quantized_gradients_node_size": NODE}),
    "qgz_int4": ({}, {"quantized_gradients": True, "quantized_gradients_bits": 4, "quantized_gradients_node_size": NODE}),
    "qwz+hpz+qgz": ({}, {"quantized_weights": True, "hpz_partition_size": NODE, "quantized_gradients": True,
                         "quantized_gradients_node_size": NODE}),
    "qwz+hpz+qgz_int4": ({}, {"quantized_weights": True, "hpz_partition_size": NODE, "quantized_gradients": True,
                              "quantized_gradients_bits": 4, "quantized_gradients_node_size": NODE}),
    # HSDP's shard group is the node (hpZ's role; hpZ itself is refused with HSDP): qgZ quantizes the
    # reduce-scatter inside it and the all-reduce across the replicas (zero.replica_reduce)
    "hsdp+qgz": ({"dp_replicate": 2}, {"quantized_gradients": True}),
    "hsdp+qgz_int4": ({"dp_replicate": 2}, {"quantized_gradients": True, "quantized_gradients_bits": 4}),
    "hsdp+qwz+qgz": ({"dp_replicate": 2}, {"quantized_weights": True, "quantized_gradients": True}),
    "hsdp+qwz+qgz_int4": ({"dp_replicate": 2}, {"quantized_weights": True, "quantized_gradients": True,
                                                "quantized_gradients_bits": 4}),
}


class Counter:
    """Wraps torch.distributed's collectives; ``total``/``cross`` bytes this rank sent while ``on``."""

    NAMES = ("broadcast", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
             "reduce_scatter_single", "all_to_all_single", "all_reduce", "batch_isend_irecv")

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist, self.on, self.total, self.cross = dist, False, 0, 0
        self.me = dist.get_rank()
        for name in self.NAMES:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _peers(self, group) -> list[int]:
        return self.dist.get_process_group_ranks(group) if group is not None else list(range(self.dist.get_world_size()))

    def _send(self, peer: int, nbytes: float) -> None:
        if peer != self.me:
            self.total += nbytes
            self.cross += nbytes if peer // NODE != self.me // NODE else 0

    def _count(self, name: str, args: tuple, kwargs: dict) -> None:
        group = kwargs.get("group")
        if name == "batch_isend_irecv":
            for op in args[0]:
                if op.op is self.dist.isend or getattr(op.op, "__name__", "") == "isend":
                    self._send(op.peer, op.tensor.nbytes)  # P2POp's peer is a global rank
            return
        peers = self._peers(group)
        g = len(peers)
        if name == "broadcast":
            src = kwargs.get("src", args[1] if len(args) > 1 else None)
            if src == self.me:
                for p in peers:
                    self._send(p, args[0].nbytes)
        elif name.startswith("all_gather"):
            inp = kwargs.get("input_tensor", args[1] if len(args) > 1 else None)
            for p in peers:
                self._send(p, inp.nbytes)
        elif name.startswith("reduce_scatter") or name == "all_to_all_single":
            inp = kwargs.get("input", args[1] if len(args) > 1 else kwargs.get("input_tensor"))
            for p in peers:
                self._send(p, inp.nbytes / g)
        elif name == "all_reduce":
            for p in peers:
                self._send(p, 2 * args[0].nbytes / g)

    def _wrap(self, name: str, fn):
        def counted(*args, **kwargs):
            if self.on:
                self._count(name, args, kwargs)
            return fn(*args, **kwargs)

        return counted


def _worker(steps: int, warmup: int, layers: int) -> dict:
    import torch.distributed as dist

    from deepshard.core import (
        EngineConfig,
        OptimConfig,
        ParallelDims,
        PrecisionConfig,
        ZeroConfig,
        build_mesh,
        init_distributed,
        initialize,
    )
    from deepshard.core.mesh import local_device
    from deepshard.finetune.models.llama import Llama, LlamaConfig

    init_distributed()
    counter = Counter()
    cfg = LlamaConfig(n_layers=layers, max_seq_len=SEQ)  # the README's tiny model (vocab 2048, dim 256)
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (steps + warmup, MBS, SEQ + 1), generator=g).to(local_device())
    out = {}
    for name, (parallel, zero) in CONFIGS.items():
        torch.manual_seed(0)
        model = Llama(cfg)
        model.init_weights(0)
        config = EngineConfig(zero=ZeroConfig(stage=3, **zero), precision=PrecisionConfig(dtype="fp32"),
                              optim=OptimConfig(lr=1e-3))
        engine = initialize(model.to(local_device()), config, mesh=build_mesh(ParallelDims(**parallel)))
        times, losses = [], []
        for s in range(steps + warmup):
            counter.on = s >= warmup
            dist.barrier()
            t0 = time.perf_counter()
            loss = engine(tokens[s, :, :-1], tokens[s, :, 1:])
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - t0)
            counter.on = False
            losses.append(loss.item())
        out[name] = {"total": counter.total / steps, "cross": counter.cross / steps,
                     "step_s": statistics.median(times[warmup:]), "last_loss": losses[-1]}
        counter.total = counter.cross = 0
        del engine, model
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6)
    a = ap.parse_args()
    ranks = launch_local(_worker, 4, a.steps, a.warmup, a.layers)
    base = {k: sum(r["zero3"][k] for r in ranks) for k in ("total", "cross")}
    base_t = max(r["zero3"]["step_s"] for r in ranks)
    rows = {}
    for name in CONFIGS:
        total = sum(r[name]["total"] for r in ranks)
        cross = sum(r[name]["cross"] for r in ranks)
        step = max(r[name]["step_s"] for r in ranks)
        rows[name] = {"MB_per_step": round(total / 1e6, 3), "cross_node_MB_per_step": round(cross / 1e6, 3),
                      "ratio_total": round(total / base["total"], 3), "ratio_cross_node": round(cross / base["cross"], 3),
                      "step_s": round(step, 3), "step_ratio": round(step / base_t, 3),
                      "last_loss": round(ranks[0][name]["last_loss"], 4)}
    print(json.dumps({"world": 4, "ranks_per_node": NODE, "model": f"README tiny Llama, {a.layers} layers, fp32",
                      "tokens_per_rank_step": MBS * SEQ, "measured_steps": a.steps, "configs": rows,
                      "deepspeed": "bench/bench_zeropp_deepspeed.py (its ZeRO-3 and hpZ run here; qwZ/qgZ need "
                                   "QuantizerBuilder, a CUDA op)"}, indent=1))


if __name__ == "__main__":
    main()
