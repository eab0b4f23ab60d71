"""QLoRA's base memory per rank, by a census of storages: LoRA on an fp32 base (what ZeRO-3 keeps today:
fp32 shards, cast per all-gather), LoRA on a bf16 base, and QLoRA (``peft.base_quant=nf4``), each at
ZeRO-3 over the same ranks, in one run.

A tensor subclass shows no storage of its own (``NF4Tensor`` is a wrapper: its bytes are in its
``quantized_data``, ``quantized_scalers`` and ``quantization_factor``), so the census walks each
parameter's local shard down to the inner tensors and counts each untyped storage once.  Base bytes
are those of the frozen block Linear weights (Ψ_base of them); the expected figure for NF4 is 0.5 B x
Ψ_base / world plus the scales.  Each variant also runs 2 steps on random tokens (seconds per step).

    python bench/bench_qlora_memory.py [--world 2] [--dim 512 --layers 4]
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import torch

from deepshard.launch.local import launch_local


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind ``t``: a DTensor's local piece, a wrapper subclass's inner tensors."""
    t = t._local_tensor if hasattr(t, "_local_tensor") else t
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [s for n in names for s in _storages(getattr(t, n))]
    return [t.untyped_storage()]


def census(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        for s in _storages(t):
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def _variant(kind: str, dim: int, layers: int, world: int) -> dict:
    from deepshard.core import (
        EngineConfig,
        OptimConfig,
        ParallelDims,
        PrecisionConfig,
        ZeroConfig,
        build_mesh,
        initialize,
    )
    from deepshard.finetune.models import registry
    from deepshard.finetune.models.lora import apply_lora
    from deepshard.finetune.models.qlora import apply_nf4, nf4_weights

    spec = registry.get("llama")
    cfg = spec.config(vocab_size=2048, dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4,
                      ffn_hidden=dim * 11 // 4, max_seq_len=256, loss_chunk_size=0)
    model = spec.build(cfg)
    model.init_weights(0)
    apply_lora(model, r=16, alpha=32.0, seed=0)
    names = [n for n, _ in nf4_weights(model)]
    psi_base = sum(m.weight.numel() for _, m in nf4_weights(model))
    dtype = "bf16" if kind == "lora_bf16_base" else "fp32"
    if kind == "lora_bf16_base":  # the frozen block weights stored in bf16 (the all-gather casts the rest)
        for _, m in nf4_weights(model):
            m.weight.data = m.weight.data.to(torch.bfloat16)
    elif kind == "qlora_nf4":
        apply_nf4(model, world=world)
    config = EngineConfig(zero=ZeroConfig(stage=3), precision=PrecisionConfig(dtype=dtype), optim=OptimConfig(lr=1e-4))
    mesh = build_mesh(ParallelDims(dp=world))
    engine = initialize(model, config, mesh=mesh,
                        parallelize_fn=partial(spec.parallelize, mesh=mesh, zero=config.zero, dtype=dtype, ac="none"))
    params = dict(engine.model.named_parameters())
    base = census([params[n] for n in names])
    ids = torch.randint(0, cfg.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        num = engine.global_num_items(torch.tensor(ids.numel()))
        engine.backward(engine(ids, ids, reduction="sum"), num_items=num)
        engine.step()
        times.append(time.perf_counter() - t0)
    return {"base_bytes_per_rank": base, "psi_base": psi_base, "all_param_bytes_per_rank": census(list(params.values())),
            "bytes_per_base_param_per_rank": base * world / psi_base, "step_s": min(times)}


def worker(dim: int, layers: int, world: int) -> dict:
    from deepshard.core import init_distributed

    init_distributed()
    return {kind: _variant(kind, dim, layers, world) for kind in ("lora_fp32_base", "lora_bf16_base", "qlora_nf4")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    ranks = launch_local(worker, args.world, args.dim, args.layers, args.world)
    out = {"world": args.world, "dim": args.dim, "layers": args.layers, "ranks": ranks}
    r0 = ranks[0]
    psi = r0["qlora_nf4"]["psi_base"]
    out["expected_nf4_bytes_per_rank"] = {"codes_only": psi // 2 // args.world,
                                          "with_scales": (psi // 2 + psi // 64 + psi // 4096) // args.world}
    out["ratios"] = {f"nf4_vs_{k}": r0["qlora_nf4"]["base_bytes_per_rank"] / r0[k]["base_bytes_per_rank"]
                     for k in ("lora_fp32_base", "lora_bf16_base")}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
