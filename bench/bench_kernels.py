"""Benchmark deepshard.kernels against PyTorch eager (and torch.compile): time and peak memory, JSON out.

On a GPU every kernel family runs as: ``triton`` (our kernels), ``torch`` (our PyTorch path where it
differs from the reference: chunked linear-CE), ``eager`` (the pure-PyTorch
reference) and ``compile`` (torch.compile of the reference), forward-only (no_grad) and fwd+bwd,
at Llama-8B-like sizes (hidden 4096, intermediate 14336, vocab 128256). On CPU only the PyTorch
paths run (Triton has no CPU backend; its interpreter is far too slow to time) and the JSON says so.
Every row carries ratios against ``eager`` from the same run.

    python bench/bench_kernels.py [--quick | --llama8b] [--repeat N] [--compile] [--only rms_norm,...] [--out F.json]

``--llama8b``: one case per family at Llama-3-8B shapes (4096 tokens, hidden 4096, ffn 14336,
32/8 heads of 128, vocab 128256), the bounded set
that bench/gpu_check.sh runs.

Peak memory: CUDA allocator peak above the pre-call baseline on GPU; on CPU the process's peak RSS
above baseline (VmHWM, reset through /proc/self/clear_refs), since torch's CPU allocations are
invisible to tracemalloc.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from deepshard.kernels import (
    apply_rotary,
    apply_rotary_reference,
    linear_cross_entropy,
    linear_cross_entropy_reference,
    rms_norm,
    rms_norm_reference,
    swiglu,
    swiglu_reference,
    triton_importable,
)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


# ---------------------------------------------------------------- measurement


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(field + r":\s+(\d+) kB", f.read()).group(1)) * 1024


def peak_bytes(fn: Callable[[], Any]) -> int | None:
    """Peak memory one call of ``fn`` adds above what was live before it."""
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        _sync()
        return torch.cuda.max_memory_allocated() - base
    try:
        base = _rss("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    fn()
    return _rss("VmHWM") - base


def measure(fn: Callable[[], Any], repeat: int, warmup: bool = True) -> dict[str, float | None]:
    """Median wall time (ms) after an optional warm-up call (absorbs compilation/autotuning), and peak memory."""
    if warmup:
        fn()
        _sync()
    times = []
    for _ in range(repeat):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - start) * 1e3)
    peak = peak_bytes(fn)
    return {"ms": round(statistics.median(times), 3), "peak_mib": None if peak is None else round(peak / 2**20, 1)}


def _leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().requires_grad_() for t in tensors]


def _fwd_bwd(fn: Callable[..., Any], leaves: list[torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        for t in leaves:
            t.grad = None
        out = fn(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    return run


def _fwd(fn: Callable[..., Any], leaves: list[torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        with torch.no_grad():
            fn(*leaves)

    return run


# ---------------------------------------------------------------- cases


def _providers(torch_path: Callable[..., Any] | None, triton_path: Callable[..., Any], reference: Callable[..., Any],
               use_compile: bool) -> dict[str, Callable[..., Any]]:
    out: dict[str, Callable[..., Any]] = {}
    if CUDA and triton_importable():
        out["triton"] = triton_path
    if torch_path is not None:
        out["torch"] = torch_path
    out["eager"] = reference
    if use_compile:
        out["compile"] = torch.compile(reference)
    return out


def cases(quick: bool, llama8b: bool = False) -> dict[str, list[dict[str, Any]]]:
    """Sizes per kernel family; Llama-8B: hidden 4096, intermediate 14336, 32 q / 8 kv heads, vocab 128256."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    if llama8b:
        return {
            "rms_norm": [dict(tokens=4096, hidden=4096, dtype=dtype)],
            "swiglu": [dict(tokens=4096, inter=14336, dtype=dtype)],
            "rope": [dict(batch=1, hq=32, hk=8, seq=4096, head_dim=128, dtype=dtype)],
            "linear_ce": [dict(tokens=4096, hidden=4096, vocab=128256, chunk=1024, dtype=dtype)],
        }
    if CUDA:
        return {
            "rms_norm": [dict(tokens=t, hidden=h, dtype=dtype) for t, h in [(4096, 4096), (16384, 4096), (4096, 8192)]],
            "swiglu": [dict(tokens=t, inter=i, dtype=dtype) for t, i in [(4096, 14336), (16384, 14336)]],
            "rope": [dict(batch=b, hq=32, hk=8, seq=s, head_dim=128, dtype=dtype) for b, s in [(1, 4096), (4, 2048)]],
            "linear_ce": [dict(tokens=t, hidden=h, vocab=v, chunk=c, dtype=dtype)
                          for t, h, v, c in [(4096, 4096, 128256, 1024), (8192, 4096, 128256, 1024),
                                             (16384, 2048, 32000, 2048)]],
        }
    if quick:
        return {
            "rms_norm": [dict(tokens=256, hidden=512, dtype=dtype)],
            "swiglu": [dict(tokens=256, inter=512, dtype=dtype)],
            "rope": [dict(batch=1, hq=4, hk=2, seq=128, head_dim=64, dtype=dtype)],
            "linear_ce": [dict(tokens=512, hidden=64, vocab=8000, chunk=128, dtype=dtype)],
        }
    return {
        "rms_norm": [dict(tokens=4096, hidden=4096, dtype=dtype)],
        "swiglu": [dict(tokens=2048, inter=14336, dtype=dtype)],
        "rope": [dict(batch=1, hq=32, hk=8, seq=1024, head_dim=128, dtype=dtype)],
        "linear_ce": [dict(tokens=t, hidden=h, vocab=v, chunk=c, dtype=dtype)
                      for t, h, v, c in [(4096, 256, 32000, 1024), (2048, 128, 128256, 512)]],
    }


def bench_rms_norm(size: dict[str, Any], repeat: int, use_compile: bool) -> list[dict[str, Any]]:
    x = torch.randn(size["tokens"], size["hidden"], device=DEVICE, dtype=size["dtype"])
    w = torch.ones(size["hidden"], device=DEVICE, dtype=size["dtype"])
    provs = _providers(None, lambda x, w: rms_norm(x, w, backend="triton"), rms_norm_reference, use_compile)
    return _run_elementwise(provs, [x, w], repeat)


def bench_swiglu(size: dict[str, Any], repeat: int, use_compile: bool) -> list[dict[str, Any]]:
    g = torch.randn(size["tokens"], size["inter"], device=DEVICE, dtype=size["dtype"])
    u = torch.randn_like(g)
    provs = _providers(None, lambda g, u: swiglu(g, u, backend="triton"), swiglu_reference, use_compile)
    return _run_elementwise(provs, [g, u], repeat)


def bench_rope(size: dict[str, Any], repeat: int, use_compile: bool) -> list[dict[str, Any]]:
    b, s, d = size["batch"], size["seq"], size["head_dim"]
    q = torch.randn(b, size["hq"], s, d, device=DEVICE, dtype=size["dtype"])
    k = torch.randn(b, size["hk"], s, d, device=DEVICE, dtype=size["dtype"])
    cos = torch.randn(s, d, device=DEVICE, dtype=size["dtype"])
    sin = torch.randn_like(cos)
    provs = _providers(
        None,
        lambda q, k: apply_rotary(q, k, cos, sin, backend="triton"),
        lambda q, k: apply_rotary_reference(q, k, cos, sin),
        use_compile,
    )
    return _run_elementwise(provs, [q, k], repeat)


def bench_linear_ce(size: dict[str, Any], repeat: int, use_compile: bool) -> list[dict[str, Any]]:
    n, h, v = size["tokens"], size["hidden"], size["vocab"]
    hidden = torch.randn(n, h, device=DEVICE, dtype=size["dtype"])
    weight = torch.randn(v, h, device=DEVICE, dtype=size["dtype"]) * h**-0.5
    targets = torch.randint(0, v, (n,), device=DEVICE)
    provs = _providers(
        lambda x, w: linear_cross_entropy(x, w, targets, chunk_size=size["chunk"], backend="torch"),
        lambda x, w: linear_cross_entropy(x, w, targets, chunk_size=size["chunk"], backend="triton"),
        lambda x, w: linear_cross_entropy_reference(x, w, targets),
        use_compile,
    )
    rows = _run_elementwise(provs, [hidden, weight], repeat)
    for row in rows:
        row["logits_mib"] = round(n * v * 4 / 2**20, 1)
    return rows


def _run_elementwise(provs: dict[str, Callable[..., Any]], inputs: list[torch.Tensor], repeat: int) -> list[dict[str, Any]]:
    rows = []
    for name, fn in provs.items():
        leaves = _leaves(*inputs)
        for mode, make in (("fwd", _fwd), ("fwd_bwd", _fwd_bwd)):
            try:
                warmup = CUDA or name == "compile"  # eager CPU calls need no warm-up; keeps the CPU run short
                rows.append({"provider": name, "mode": mode, **measure(make(fn, leaves), repeat, warmup)})
            except Exception as e:  # a provider failing (e.g. compile) must not hide the others
                rows.append({"provider": name, "mode": mode, "error": f"{type(e).__name__}: {e}"[:300]})
    return _ratios(rows)


def _ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    base = {r["mode"]: r for r in rows if r["provider"] == "eager" and "ms" in r}
    for r in rows:
        b = base.get(r["mode"])
        if b is None or "ms" not in r:
            continue
        r["time_vs_eager"] = round(r["ms"] / b["ms"], 3) if b["ms"] else None
        if r.get("peak_mib") is not None and b.get("peak_mib"):
            r["memory_vs_eager"] = round(r["peak_mib"] / b["peak_mib"], 3)
    return rows


BENCHES = {
    "rms_norm": bench_rms_norm,
    "swiglu": bench_swiglu,
    "rope": bench_rope,
    "linear_ce": bench_linear_ce,
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the selected benches and print one JSON document."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small CPU sizes (a smoke run)")
    ap.add_argument("--llama8b", action="store_true", help="one case per family at Llama-3-8B shapes")
    ap.add_argument("--out", default="", help="also write the JSON to this file")
    ap.add_argument("--repeat", type=int, default=None, help="timed calls per measurement (median)")
    ap.add_argument("--compile", dest="compile", action="store_true", default=None, help="add torch.compile")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--only", default="", help="comma-separated subset of " + ",".join(BENCHES))
    args = ap.parse_args(argv)
    use_compile = CUDA if args.compile is None else args.compile  # CPU compiles take 8-27 s each
    repeat = args.repeat or (20 if CUDA else 2)
    only = [s for s in args.only.split(",") if s] or list(BENCHES)
    for name in only:
        if name not in BENCHES:
            raise SystemExit(f"--only: unknown bench {name!r}; valid: {', '.join(BENCHES)}")
    doc: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if CUDA else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "compile": use_compile,
        "repeat": repeat,
        "triton": "measured" if CUDA and triton_importable() else
        "not measured: Triton figures need a CUDA GPU (Triton has no CPU backend)",
        "results": {},
    }
    if args.quick and args.llama8b:
        raise SystemExit("--quick and --llama8b: choose one size set")
    for name, sizes in cases(args.quick, args.llama8b).items():
        if name not in only:
            continue
        doc["results"][name] = []
        for size in sizes:
            shown = {k: (str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v) for k, v in size.items()}
            try:
                rows = BENCHES[name](size, repeat, use_compile)
            except Exception as e:  # one family failing (OOM, a kernel error) must not lose the others
                rows = [{"error": f"{type(e).__name__}: {e}"[:300]}]
            doc["results"][name].append({"size": shown, "rows": rows})
            print(f"{name} {shown} done", file=sys.stderr, flush=True)
    print(json.dumps(doc, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


if __name__ == "__main__":
    main()
