"""Offload benchmarks, JSON out, each against a baseline measured in the same run.

- swap: read/write bandwidth of the NVMe optimizer step vs a plain sequential O_DIRECT write and
  read of the same bytes on the same path (goal: step I/O >= 0.8 of sequential).
- adam: host AdamW step time, CpuStateStore vs torch.optim.AdamW (for-loop, foreach, fused).
- host_adam: CpuStateStore vs DeepSpeedCPUAdam (where DeepSpeed is installed) on 1 and 2 threads (one
  child process each, OMP_NUM_THREADS and torch's pool set; cpu_over_wall shows the threads really
  used), flat and 50-tensor layouts, each also with a gradient scale (clipping: DeepSpeed scales the
  grads in a pass of its own), plus bf16 params with fp32 host masters (ZeRO-Offload's case: ours
  writes the bf16 copy in the Adam pass, torch's fused AdamW and DeepSpeed cast after).  Interleaved
  rounds, median and min; bytes/s (28 B per element: reads p, g, m, v; writes p, m, v; 30 with the
  bf16 copy) against the floor, a plain in-place stream (``p += g; m += v``: 24 B/element, writes to
  lines it read) on the same buffers.
- rss: peak RSS of a fresh process stepping ~100M fp32 params with NvmeStateStore vs
  DeviceStateStore; the drop should be most of the optimizer-state bytes (goal >= 0.8).

    python bench/bench_offload.py [--sizes 50,500] [--swap-params 100] [--rss-params 100] [--nvme-path /var/tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch.optim.adamw import adamw

from deepshard.core.state_store import DeviceStateStore
from deepshard.core.update_rule import AdamW
from deepshard.offload import AioConfig, CpuStateStore, NvmeStateStore, OffloadConfig
from deepshard.offload.aio import ALIGN, aligned_empty, as_buffer

M = 1_000_000
CFG = AdamW()


def make_params(numel: int, pieces: int = 10) -> list[torch.Tensor]:
    """``pieces`` fp32 tensors totalling ``numel`` (odd sizes, like real layers)."""
    sizes = [numel // pieces] * pieces
    sizes[-1] += numel - sum(sizes)
    return [torch.rand(n) for n in sizes]


def best_of(fn, repeats: int) -> float:
    fn()  # warm-up (first touch of pages, thread pools)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def sequential_direct(path: str, nbytes: int, block: int) -> dict[str, float]:
    """Plain sequential O_DIRECT write then read of ``nbytes`` in ``block``-byte syscalls, one thread."""
    buf = aligned_empty(block)
    buf.fill_(1)
    mv = as_buffer(buf)
    fname = os.path.join(path, f"deepshard-bench-seq-{os.getpid()}")
    fd = os.open(fname, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        out = {}
        for name, op in (("write", os.pwritev), ("read", os.preadv)):
            t = time.perf_counter()
            for off in range(0, nbytes, block):
                n = min(block, nbytes - off)
                op(fd, [mv[:n]], off)
            out[f"seq_{name}_GBps"] = nbytes / (time.perf_counter() - t) / 1e9
            out[f"seq_{name}_s"] = time.perf_counter() - t
        return out
    finally:
        os.close(fd)
        os.unlink(fname)


def bench_swap(nvme_path: str, numel: int, steps: int) -> dict:
    aio = AioConfig()
    params = make_params(numel)
    grads = [torch.rand_like(p) for p in params]
    cfg = OffloadConfig(device="nvme", nvme_path=nvme_path, sub_group_size=2**23, buffer_size=2**23,
                        buffer_count=4, aio=aio)
    store = NvmeStateStore(params, [0.01] * len(params), CFG, config=cfg, run_id=f"bench{os.getpid()}")
    try:
        store.step(grads, lr=1e-3, step=1)
        store.reset_io_stats()
        t = time.perf_counter()
        for s in range(steps):
            store.step(grads, lr=1e-3, step=2 + s)
        t_step = (time.perf_counter() - t) / steps
        st = store.io_stats()
        direct = store.direct
    finally:
        store.close()
    per_step = st["read_bytes"] / steps
    seq = sequential_direct(nvme_path, int(per_step), aio.block_size)
    return {
        "params_M": numel / M, "o_direct": direct, "step_s": t_step, "swap_bytes_per_step_each_way": per_step,
        "step_read_GBps_busy": st["read_bytes"] / max(st["read_busy_s"], 1e-9) / 1e9,
        "step_write_GBps_busy": st["write_bytes"] / max(st["write_busy_s"], 1e-9) / 1e9,
        "step_io_GBps": (st["read_bytes"] + st["write_bytes"]) / steps / t_step / 1e9,
        **seq,
        "seq_io_GBps": 2 * per_step / (seq["seq_read_s"] + seq["seq_write_s"]) / 1e9,
        "ratio_step_vs_sequential": (seq["seq_read_s"] + seq["seq_write_s"]) / t_step,
    }


def bench_adam(numel: int, repeats: int) -> dict:
    out: dict = {"params_M": numel / M}
    params = make_params(numel)
    grads = [torch.rand_like(p) for p in params]
    for mode in ("for_loop", "foreach", "fused"):
        for p, g in zip(params, grads):
            p.grad = g
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01,
                                foreach=mode == "foreach", fused=mode == "fused" or None)
        with torch.no_grad():
            out[f"torch_{mode}_s"] = best_of(opt.step, repeats)
        del opt
    for p in params:
        p.grad = None
    store = CpuStateStore(params, [0.01] * len(params), CFG)
    k = [1]

    def ours() -> None:
        k[0] += 1
        store.step(grads, lr=1e-3, step=k[0])

    out["ours_cpu_store_s"] = best_of(ours, repeats)
    out["ours_vs_fused"] = out["torch_fused_s"] / out["ours_cpu_store_s"]
    return out


def _interleaved(fns: dict, repeats: int) -> dict[str, dict[str, float]]:
    """Each fn once per round, rounds repeated (drift and neighbours hit all alike); min, median and
    process-CPU/wall per fn (the threads it really used: DeepSpeed's OpenMP and torch's pool alike)."""
    for fn in fns.values():
        fn()  # warm-up: first touch, thread pools, compiled kernels
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, float] = dict.fromkeys(fns, 0.0)
    for _ in range(repeats):
        for k, fn in fns.items():
            c, t = time.process_time(), time.perf_counter()
            fn()
            wall[k].append(time.perf_counter() - t)
            cpu[k] += time.process_time() - c
    return {k: {"min_s": min(w), "median_s": statistics.median(w), "cpu_over_wall": cpu[k] / sum(w)}
            for k, w in wall.items()}


def _host_adam_rows(numel: int, repeats: int) -> list[dict]:
    """One thread count (this process's): fp32 rows per layout, then the bf16-params row."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError:
        DeepSpeedCPUAdam = None  # noqa: N806
    rows = []
    for layout, pieces in (("flat", 1), ("50_tensors", 50)):
        for scaled in (False, True):
            params = make_params(numel, pieces)
            grads = [torch.rand_like(p) * 1e-3 for p in params]
            store = CpuStateStore(params, [0.01] * pieces, CFG)
            # grad_scale (clipping / loss-scale removal): torch's fused kernel stores the scaled grads
            # back, DeepSpeed's ZeRO-Offload scales them in a pass of their own before its step
            scale = 0.5 if scaled else 1.0
            k = [1]

            def ours(store=store, grads=grads, scale=scale, k=k) -> None:
                k[0] += 1
                store.step(grads, lr=1e-3, step=k[0], grad_scale=scale)

            def stream(params=params, grads=grads, store=store) -> None:  # p += g; m += v: 24 B/element
                torch._foreach_add_(params, grads)
                torch._foreach_add_(store.states["exp_avg"], store.states["exp_avg_sq"])

            fns = {"ours": ours, "stream": stream}
            if DeepSpeedCPUAdam is not None:
                ds_params = [torch.nn.Parameter(torch.rand_like(p)) for p in params]
                for p, g in zip(ds_params, grads):
                    p.grad = g.clone()
                ds = DeepSpeedCPUAdam(ds_params, lr=1e-3, weight_decay=0.01, adamw_mode=True)
                ds_grads = [p.grad for p in ds_params]
                fns["deepspeed"] = (lambda ds=ds, gs=ds_grads: (torch._foreach_mul_(gs, 0.5), ds.step())) \
                    if scaled else ds.step
            rows.append(_host_adam_summary(f"{layout}{'_grad_scale' if scaled else ''}", numel, 28, fns, repeats))
            del store, fns
    for layout, pieces in (("flat", 1), ("50_tensors", 50)):
        rows.append(_bf16_row(numel, pieces, f"{layout}_bf16_params", repeats, DeepSpeedCPUAdam))
    return rows


def _bf16_row(numel: int, pieces: int, layout: str, repeats: int, ds_cls) -> dict:
    """ZeRO-Offload's real case: bf16 compute params, fp32 masters on the host.  Ours writes the bf16
    params in the Adam pass (runs of 4M+ elements; 50 tensors of 1M stay on torch's kernel + cast);
    torch's fused AdamW and DeepSpeedCPUAdam each need a cast pass after (DeepSpeed 0.19.8's stage
    1-2: ``bit16_partition_buffer.copy_(fp32_partition)``)."""
    masters = make_params(numel, pieces)
    params = [m.to(torch.bfloat16) for m in masters]
    grads = [torch.rand_like(m) * 1e-3 for m in masters]
    store = CpuStateStore(params, [0.01] * pieces, CFG, masters=masters)
    k = [1]

    def ours() -> None:
        k[0] += 1
        store.step(grads, lr=1e-3, step=k[0])

    ref_m = [m.clone() for m in masters]
    ref_state = ([torch.zeros_like(m) for m in masters], [torch.zeros_like(m) for m in masters])

    def fused_then_cast() -> None:  # our previous path
        adamw(ref_m, grads, *ref_state, [], [torch.tensor(float(k[0])) for _ in masters], fused=True, foreach=False,
              amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3, weight_decay=0.01, eps=1e-8, maximize=False)
        torch._foreach_copy_(params, ref_m)

    def stream() -> None:
        torch._foreach_add_(masters, grads)
        torch._foreach_add_(store.states["exp_avg"], store.states["exp_avg_sq"])

    fns = {"ours": ours, "torch_fused_then_cast": fused_then_cast, "stream": stream}
    if ds_cls is not None:
        ds_params = [torch.nn.Parameter(m.clone()) for m in masters]
        for p, g in zip(ds_params, grads):
            p.grad = g
        ds = ds_cls(ds_params, lr=1e-3, weight_decay=0.01, adamw_mode=True)
        fns["deepspeed"] = lambda: (ds.step(), torch._foreach_copy_(params, [p.detach() for p in ds_params]))
    return _host_adam_summary(layout, numel, 30, fns, repeats)


def _host_adam_summary(layout: str, numel: int, nbytes: int, fns: dict, repeats: int) -> dict:
    """GB/s from the median (``nbytes``/element: what the one-pass update must move; the stream moves 24)."""
    t = _interleaved(fns, repeats)
    row: dict = {"threads": torch.get_num_threads(), "layout": layout, "bytes_per_element": nbytes}
    for name, r in t.items():
        per = 24 if name == "stream" else nbytes
        row[name] = {"median_s": r["median_s"], "min_s": r["min_s"], "GBps": per * numel / r["median_s"] / 1e9,
                     "cpu_over_wall": r["cpu_over_wall"]}
    row["ours_vs_floor_GBps"] = row["ours"]["GBps"] / row["stream"]["GBps"]
    for base in ("deepspeed", "torch_fused_then_cast"):
        if base in row:
            row[f"ours_over_{base}_time"] = row["ours"]["median_s"] / row[base]["median_s"]
            row[f"ours_over_{base}_time_min"] = row["ours"]["min_s"] / row[base]["min_s"]
    return row


def bench_host_adam(numel: int, repeats: int) -> list[dict]:
    """Ours vs DeepSpeedCPUAdam vs the stream floor, one child process per thread count (see the docstring)."""
    rows = []
    for n_threads in (1, 2):
        env = {**os.environ, "OMP_NUM_THREADS": str(n_threads)}
        cmd = [sys.executable, __file__, "--host-adam-child", str(n_threads), "--host-adam-params",
               str(numel / M), "--host-adam-repeats", str(repeats)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        rows += json.loads(out.strip().splitlines()[-1])
    return rows


def rss_child(kind: str, numel: int, nvme_path: str) -> None:
    params = make_params(numel)
    grads = [torch.rand_like(p) for p in params]
    wds = [0.01] * len(params)
    if kind == "device":
        store = DeviceStateStore(params, wds, CFG)
    else:
        cfg = OffloadConfig(device="nvme", nvme_path=nvme_path, sub_group_size=2**21, buffer_size=2**21,
                            buffer_count=3)
        store = NvmeStateStore(params, wds, CFG, config=cfg, run_id=f"rss{os.getpid()}")
    for s in range(2):
        store.step(grads, lr=1e-3, step=s + 1)
    state = store.state_bytes()
    store.close()
    # VmHWM, not ru_maxrss: the latter keeps the forked parent's peak across exec
    hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    rss = int(hwm.split()[1]) * 1024
    print(json.dumps({"peak_rss": rss, "state_bytes": state}))


def bench_rss(numel: int, nvme_path: str) -> dict:
    res = {}
    for kind in ("device", "nvme"):
        cmd = [sys.executable, __file__, "--rss-child", kind, "--rss-params", str(numel / M), "--nvme-path", nvme_path]
        line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        res[kind] = json.loads(line)
    opt_bytes = res["device"]["state_bytes"]["device"]
    drop = res["device"]["peak_rss"] - res["nvme"]["peak_rss"]
    return {"params_M": numel / M, "peak_rss_device": res["device"]["peak_rss"],
            "peak_rss_nvme": res["nvme"]["peak_rss"], "optimizer_state_bytes": opt_bytes,
            "nvme_staging_bytes": res["nvme"]["state_bytes"]["host"], "rss_drop_over_state": drop / opt_bytes}


def zero3_worker(device: str, nvme_path: str, steps: int) -> dict:
    """One rank training model=small at ZeRO-3 with the given optimizer-state residence."""
    import statistics
    import time

    from deepshard.core import EngineConfig, OptimConfig, ZeroConfig, init_distributed, initialize
    from deepshard.finetune.models.llama import PRESETS, Llama
    from deepshard.offload import make_store_factory

    os.dup2(2, 1)  # keep stdout for the JSON
    rank, _ = init_distributed()
    with torch.device("meta"):  # sharded init: no rank ever holds the whole model
        model = Llama(PRESETS["small"])
    cfg = OffloadConfig(device=device, nvme_path=nvme_path if device == "nvme" else None,
                        sub_group_size=2**20, buffer_size=2**20, buffer_count=3)
    engine = initialize(model, EngineConfig(zero=ZeroConfig(stage=3), optim=OptimConfig(lr=1e-4)),
                        store_factory=make_store_factory(cfg, rank, os.environ.get("TORCHELASTIC_RUN_ID", "b")),
                        materialize=lambda m: m.init_weights(0))
    times = []
    for i in range(steps + 1):
        tokens = torch.randint(0, 2048, (2, 129))
        t0 = time.perf_counter()
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        engine.step()
        if i:
            times.append(time.perf_counter() - t0)
    state = engine.store.state_bytes()
    engine.store.close()
    hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    return {"step_s": statistics.median(times), "peak_rss": int(hwm.split()[1]) * 1024, "state_bytes": state}


def bench_zero3(nvme_path: str, steps: int) -> dict:
    """model=small (100M) at world 2, ZeRO-3: step time and peak RSS with state on device, host, NVMe."""
    from deepshard.launch.local import launch_local

    # glibc's dynamic mmap threshold keeps freed activation/all-gather buffers resident, so peak RSS
    # would measure the allocator's high-water mark, not live memory: a fixed threshold (inherited by
    # the workers, same for every run) makes RSS follow what is really held.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    runs = {dev: launch_local(zero3_worker, 2, dev, nvme_path, steps) for dev in ("none", "cpu", "nvme")}
    del os.environ["MALLOC_MMAP_THRESHOLD_"]
    base = max(r["step_s"] for r in runs["none"])
    opt_bytes = runs["none"][0]["state_bytes"]["device"]  # Adam moments (fp32 masters are the params)
    out = {"model": "small", "world": 2, "stage": 3,
           "optimizer_state_bytes_per_rank": opt_bytes}
    for dev, res in runs.items():
        out[dev] = {"step_s": max(r["step_s"] for r in res), "peak_rss_per_rank": [r["peak_rss"] for r in res],
                    "step_time_vs_no_offload": max(r["step_s"] for r in res) / base}
    drop = max(r["peak_rss"] for r in runs["none"]) - max(r["peak_rss"] for r in runs["nvme"])
    out["nvme_rss_drop_over_optimizer_state"] = drop / opt_bytes
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="50,500", help="host Adam sizes in millions of params")
    ap.add_argument("--swap-params", type=float, default=100, help="NVMe step size, millions of params")
    ap.add_argument("--rss-params", type=float, default=100, help="RSS comparison size, millions")
    ap.add_argument("--nvme-path", default=None, help="disk-backed dir (default: a temp dir under /var/tmp)")
    ap.add_argument("--only", default="swap,adam,host_adam,rss,zero3")
    ap.add_argument("--host-adam-params", type=float, default=50, help="host_adam size, millions of params")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--host-adam-repeats", type=int, default=11, help="interleaved rounds per host_adam row")
    ap.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--host-adam-child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.host_adam_child:
        torch.manual_seed(0)
        torch.set_num_threads(args.host_adam_child)
        print(json.dumps(_host_adam_rows(int(args.host_adam_params * M), args.host_adam_repeats)))
        return
    if args.rss_child:
        rss_child(args.rss_child, int(args.rss_params * M), args.nvme_path)
        return
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(dir=args.nvme_path or "/var/tmp") as path:
        result: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(), "align": ALIGN}
        only = args.only.split(",")
        if "swap" in only:
            result["swap"] = bench_swap(path, int(args.swap_params * M), args.repeats)
        if "adam" in only:
            result["adam"] = [bench_adam(int(float(s) * M), args.repeats) for s in args.sizes.split(",")]
        if "host_adam" in only:
            result["host_adam"] = bench_host_adam(int(args.host_adam_params * M), args.host_adam_repeats)
        if "rss" in only:
            result["rss"] = bench_rss(int(args.rss_params * M), path)
        if "zero3" in only:
            result["zero3_offload"] = bench_zero3(path, args.repeats + 2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
