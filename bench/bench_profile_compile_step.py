"""Where a training step's time goes, eager vs ``compile=true``, on one rank of the README run.

The README model (the app's ``model=tiny``: LlamaConfig's defaults), a micro-batch of 8 rows of 128
tokens, fp32, AdamW, one thread (a rank of the world-2 run has one core); the blocks compiled by
``deepshard.core.compile`` as the recipe does.  ``torch.profiler`` over ``--steps`` steps after
``--warmup``; each op's self CPU time is put in one class: GEMMs (what inductor hands to the same
BLAS as eager), attention (SDPA and its backward, an extern kernel in both), the optimizer, the
inductor-generated C++ kernels (the compiled graphs' own time), the other aten ops (elementwise,
copies, the loss) and what no op accounts for (Python, autograd, dispatch).  JSON on stdout.

    python bench/bench_profile_compile_step.py [--steps 5] [--warmup 3] [--threads 1]

No collectives: the world-2 run adds ZeRO's (eager around the blocks, the same in both modes).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

CLASSES = {
    "gemm": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_flash_attention_for_cpu_backward"),
    "optimizer": ("aten::_fused_adamw_", "aten::_foreach_", "Optimizer.step"),
    "compiled_kernels": ("CompiledFunction", "CompiledFunctionBackward", "Torch-Compiled Region",
                         "## Call CompiledFxGraph"),
}


def _classify(name: str) -> str:
    for cls, prefixes in CLASSES.items():
        if any(name.startswith(p) for p in prefixes):
            return cls
    return "other_aten" if name.startswith("aten::") else "unclassified"


def profile(compiled: bool, steps: int, warmup: int) -> dict:
    import torch._dynamo

    from deepshard.core import compile as ds_compile
    from deepshard.finetune.models.llama.model import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig())
    model.init_weights(0)
    if compiled:
        torch._dynamo.reset()
        ds_compile.apply_compile(model.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, model.cfg.vocab_size, (8, 128))
    labels = ids.roll(-1, 1)

    def step() -> None:
        model(ids, labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    plain_s = (time.perf_counter() - t0) / steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        profiled_s = (time.perf_counter() - t0) / steps
    shares: dict[str, float] = {}
    for e in prof.key_averages():
        cls = _classify(e.key)
        shares[cls] = shares.get(cls, 0.0) + e.self_cpu_time_total / 1e6 / steps
    accounted = sum(shares.values())
    shares["python_autograd_dispatch"] = max(0.0, profiled_s - accounted)
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
    return {"compiled": compiled, "step_s": round(plain_s, 4), "tokens_per_s": round(ids.numel() / plain_s),
            "profiled_step_s": round(profiled_s, 4),
            "share": {k: round(v / profiled_s, 3) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])},
            "top_ops_ms": {e.key: round(e.self_cpu_time_total / 1e3 / steps, 2) for e in top}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    eager, compiled = profile(False, a.steps, a.warmup), profile(True, a.steps, a.warmup)
    print(json.dumps({"threads": a.threads, "eager": eager, "compiled": compiled,
                      "ratio": round(eager["step_s"] / compiled["step_s"], 3)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
