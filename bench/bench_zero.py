"""ZeRO stages 0-3 at world sizes 2 and 4: step time relative to stage 0, peak memory per rank, and
measured vs expected per-rank model-state bytes.  Every stage builds its model on the compute device
(``local_device()``: the rank's GPU where CUDA exists); peak memory is the device's
``max_memory_allocated``/``max_memory_reserved`` on CUDA and the process's ``ru_maxrss`` otherwise.  Where DeepSpeed is installed (bench/requirements.txt,
never a dependency of our packages) it trains the same model and batches at the same stage in the same
run, and the JSON adds our/DeepSpeed ratios.

    python bench/bench_zero.py [--worlds 2 4] [--steps 6] [--dim 512 --layers 8] [--no-deepspeed] [--compile]
    python bench/bench_zero.py --hf [--rounds 2] [--steps 10] [--engines ddp fsdp2 ours1 ...] [--zero KEY=VALUE ...]

``--hf``: HF ``LlamaForCausalLM`` through the public API beside DDP, raw FSDP2 and DeepSpeed, world 2,
fp32, every engine in one launch, interleaved rounds (see bench/bench_zero_hf.py); prints JSON and the table.
``--compile``: our engine with every block compiled (``EngineConfig.compile``), beside eager DeepSpeed
(the compile issue's peer figure: ZeRO-3 compiled at most 0.65x DeepSpeed's step time); warm-up steps,
where inductor compiles, are excluded from the median.
``ours2cpu``/``ds2cpu``: stage 2 with the optimizer state and step in host memory (ZeRO-Offload).

On CUDA each rank needs its own GPU (nccl): choose worlds up to the GPU count (``--worlds 1`` on one).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from deepshard.launch.local import launch_local

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.* by package path

SEQ, MBS = 128, 4


def _model_cfg(dim: int, layers: int):
    from deepshard.finetune.models.llama import LlamaConfig

    return LlamaConfig(vocab_size=2048, dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4,
                       ffn_hidden=int(dim * 2.75) // 64 * 64, max_seq_len=SEQ)


def _batches(rank: int, n: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, vocab, (MBS, SEQ + 1), generator=g) for _ in range(n)]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _peaks() -> dict[str, float]:
    """This rank's peak memory: the GPU's on CUDA (host RSS beside it), else the host's."""
    out = {"peak_rss_mb": _peak_rss_mb()}
    if torch.cuda.is_available():
        out["device_max_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
        out["device_max_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
    return out


def _quiet_stdout() -> None:
    """Workers print (DeepSpeed's banners, launcher notices) to stderr: stdout carries the JSON alone."""
    sys.stdout.flush()
    os.dup2(2, 1)


def ours(stage: int, dim: int, layers: int, steps: int, compile: bool = False) -> dict:
    from deepshard.core import EngineConfig, OptimConfig, ZeroConfig, init_distributed, initialize
    from deepshard.core.mesh import local_device
    from deepshard.finetune.models.llama import Llama

    _quiet_stdout()
    rank, _ = init_distributed()
    cfg = _model_cfg(dim, layers)
    torch.manual_seed(0)
    sharded_init = stage == 3  # as the app does: no rank ever holds the whole model
    device = local_device()
    with torch.device("meta" if sharded_init else device):
        model = Llama(cfg)
    if not sharded_init:
        model.init_weights(0)
    engine = initialize(model, EngineConfig(zero=ZeroConfig(stage=stage, reduce_bucket_size=5_000_000,
                                                            allgather_bucket_size=5_000_000),
                                            optim=OptimConfig(lr=1e-4, grad_clip=1.0), compile=compile),
                        materialize=(lambda m: m.init_weights(0)) if sharded_init else None)
    times, memory = [], None
    for i, tokens in enumerate(_batches(rank, steps + 2, cfg.vocab_size)):
        tokens = tokens.to(device)
        t0 = time.perf_counter()
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        if i == 0:
            memory = {k: v.as_dict() for k, v in engine.memory().items()}
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:  # warm-up excluded
            times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times), **_peaks(), "memory": memory}


def deepspeed_run(stage: int, dim: int, layers: int, steps: int) -> dict:
    _quiet_stdout()
    cuda = torch.cuda.is_available()
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if cuda else "cpu")
    import deepspeed

    from deepshard.finetune.models.llama import Llama

    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank = torch.distributed.get_rank()
    cfg = _model_cfg(dim, layers)
    torch.manual_seed(0)
    model = Llama(cfg)
    ds_config = {
        "train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    times = []
    for i, tokens in enumerate(_batches(rank, steps + 2, cfg.vocab_size)):
        t0 = time.perf_counter()
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times), **_peaks()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--compile", action="store_true", help="our engine with every block compiled")
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--hf", action="store_true", help="HF LlamaForCausalLM vs DDP / FSDP2 / DeepSpeed")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--engines", nargs="+", default=None)
    ap.add_argument("--zero", nargs="*", default=[], metavar="KEY=VALUE",
                    help="--hf: ZeroConfig fields for our engines (bucket sizes reach DeepSpeed too)")
    args = ap.parse_args()
    if args.hf:
        return hf_main(args)
    # find, not import: importing DeepSpeed prints its accelerator banner to stdout
    have_ds = importlib.util.find_spec("deepspeed") is not None and not args.no_deepspeed
    out = {"model": {"dim": args.dim, "layers": args.layers, "seq": SEQ, "micro_batch": MBS},
           "ours_compiled": args.compile, "worlds": {}}
    for world in args.worlds:
        rows = {}
        for stage in args.stages:
            res = launch_local(ours, world, stage, args.dim, args.layers, args.steps, args.compile)
            mem = res[0]["memory"]
            rows[stage] = {
                "step_s": max(r["step_s"] for r in res),
                "peak_rss_mb_per_rank": [round(r["peak_rss_mb"], 1) for r in res],
                **({"device_max_allocated_mb_per_rank": [round(r["device_max_allocated_mb"], 1) for r in res],
                    "device_max_reserved_mb_per_rank": [round(r["device_max_reserved_mb"], 1) for r in res]}
                   if "device_max_allocated_mb" in res[0] else {}),
                "model_state_bytes_measured": mem["measured"]["total"],
                "model_state_bytes_expected": mem["expected"]["total"],
                "measured_over_expected": round(mem["measured"]["total"] / mem["expected"]["total"], 4),
            }
            if have_ds:
                ds = launch_local(deepspeed_run, world, stage, args.dim, args.layers, args.steps)
                ds_step = max(r["step_s"] for r in ds)
                ds_rss = max(r["peak_rss_mb"] for r in ds)
                rows[stage]["deepspeed_step_s"] = ds_step
                rows[stage]["deepspeed_peak_rss_mb"] = round(ds_rss, 1)
                rows[stage]["ours_over_deepspeed_step_time"] = round(rows[stage]["step_s"] / ds_step, 3)
                rows[stage]["ours_over_deepspeed_peak_rss"] = round(max(rows[stage]["peak_rss_mb_per_rank"]) / ds_rss, 3)
            print(f"world {world} stage {stage}: {rows[stage]}", file=sys.stderr, flush=True)
        if 0 in rows:
            for stage in rows:
                rows[stage]["step_time_vs_stage0"] = round(rows[stage]["step_s"] / rows[0]["step_s"], 3)
        out["worlds"][world] = rows
    out["deepspeed"] = "compared" if have_ds else "not installed: pip install -r bench/requirements.txt"
    print(json.dumps(out, indent=2))


def hf_main(args: argparse.Namespace) -> None:
    from bench import bench_zero_hf as zero_hf

    have_ds = importlib.util.find_spec("deepspeed") is not None and not args.no_deepspeed
    names = args.engines or ["ddp", "fsdp2", "ours1", "ours2", "ours3", "ours2cpu"] + \
        (["ds1", "ds2", "ds3", "ds2cpu"] if have_ds else [])
    zero_kwargs = {k: json.loads(v.lower()) for k, v in (kv.split("=", 1) for kv in args.zero)}
    steps = 10 if args.steps == 6 else args.steps
    dim, layers = (384, 6) if (args.dim, args.layers) == (512, 8) else (args.dim, args.layers)  # ~17M params
    res = launch_local(zero_hf.worker, 2, names, dim, layers, args.vocab, steps, args.warmup,
                       args.rounds, zero_kwargs)
    rows = zero_hf.summarize(res, names)
    print(json.dumps({"model": {"hf": "LlamaForCausalLM", "dim": dim, "layers": layers, "vocab": args.vocab,
                                "params": res[0][names[0]][0]["num_params"], "seq": zero_hf.SEQ,
                                "micro_batch": zero_hf.MBS, "world": 2, "steps": steps, "rounds": args.rounds,
                                "zero": zero_kwargs or "library defaults"},
                      "engines": rows}, indent=2))
    print(zero_hf.table(rows))


if __name__ == "__main__":
    main()
