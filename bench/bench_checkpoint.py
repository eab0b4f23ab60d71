"""Checkpoint costs for model=small (~100M params, 1.2 GB of fp32 masters and AdamW moments) at world 2:
save and load seconds and bytes; an asynchronous save against a synchronous one of the same state;
the HF export's peak RSS relative to the model's size, against a load-everything baseline (every
model tensor consolidated in memory, then one safetensors write) in the same run.

Asynchronous saves (``deepshard.core.checkpoint.async_save``), each figure against its baseline here:
- ``async_blocked_over_sync``: the training thread's time in a (reused-buffer) async save over a whole
  synchronous save of the same state (goal <= 0.1);
- ``step_during_async_save_over_step``: the step time while the writer runs over the step time without;
- ``staging_rss_over_state``: the resident memory the staging added (read from /proc, not from our code)
  over this rank's state bytes (goal <= 1: one copy), and ``second_save_rss_growth_bytes``: what a second
  save added on top (goal ~0: the buffers are reused).

    python bench/bench_checkpoint.py [--stage 3] [--world 2] [--dir /tmp/deepshard-bench-ckpt] [--no-export]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deepshard.launch.local import launch_local

_EXPORT = """
import json, resource, sys, time
from deepshard.finetune.tools.hf_export import export_checkpoint
from deepshard.core.checkpoint.consolidate import iter_full_tensors
import safetensors.torch, torch, transformers  # imports count in the baseline, not in the export
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t = time.perf_counter()
if sys.argv[1] == "stream":
    export_checkpoint(sys.argv[2], sys.argv[3])
else:  # the baseline: hold every consolidated tensor, then write once
    tensors = {i.key: t for i, t in iter_full_tensors(sys.argv[2], "model.")}
    safetensors.torch.save_file(tensors, sys.argv[3] + "/model.safetensors")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"extra_peak_bytes": peak - base, "seconds": time.perf_counter() - t}))
"""


def _rss() -> int:
    """This process's resident bytes now (/proc/self/statm)."""
    import os

    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # 5: reset VmHWM, the peak resident size
        f.write("5")


def _peak() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _async(engine, root: str, step_fn) -> dict:
    """Two asynchronous saves of the same state as the synchronous one: blocked seconds, steps while writing,
    and the resident memory the staging added, measured from /proc."""
    import torch
    import torch.distributed as dist

    from deepshard.core.checkpoint.async_save import AsyncCheckpointer
    from deepshard.core.checkpoint.state import save_request
    from deepshard.core.mesh import local_device

    dp = engine.mesh["dp"]
    state = save_request(root, 0, engine.optimizer, dp, model=engine.model).state
    local_bytes = sum((v.to_local() if hasattr(v, "to_local") else v).nbytes for v in state.values()
                      if isinstance(v, torch.Tensor))
    del state  # an NVMe store's state_dict is a fresh read: not held past this line
    writer = AsyncCheckpointer(device=local_device())
    out: dict = {"local_state_bytes": local_bytes, "saves": []}
    for n in (2, 3):
        dist.barrier()
        rss0 = _rss()
        _reset_peak()
        since = time.perf_counter()  # an NVMe store's state_dict reads its files: blocked time too
        blocked = writer.start(save_request(root, n, engine.optimizer, dp, model=engine.model), since=since)
        rss_staged, staging_peak = _rss(), _peak()  # before any step: what staging alone held at its peak
        during = []
        while (outcome := writer.poll()) is None:  # training goes on while the writer writes
            during.append(step_fn())
        assert outcome.error is None, outcome.error
        out["saves"].append({"blocked_s": blocked, "write_s": outcome.write_s, "steps_during": len(during),
                             "step_during_s": sum(during) / len(during) if during else None,
                             "rss_before": rss0, "rss_staged": rss_staged, "rss_after": _rss(),
                             "staging_peak": staging_peak,
                             "peak_during": _peak()})
    writer.close()
    return out


def _worker(root: str, stage: int, model_name: str, offload: str) -> dict:
    import torch
    import torch.distributed as dist

    from deepshard.core import EngineConfig, ZeroConfig, init_distributed, initialize
    from deepshard.core.checkpoint.state import load_checkpoint, save_checkpoint
    from deepshard.core.mesh import local_device
    from deepshard.finetune.models.llama import PRESETS, Llama

    init_distributed()
    cfg = PRESETS[model_name]
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    kwargs = {}
    if offload != "none":  # the optimizer state in host memory or in NVMe swap files under root
        from deepshard.offload import OffloadConfig, make_store_factory

        kwargs["store_factory"] = make_store_factory(OffloadConfig(device=offload, nvme_path=root),
                                                     dist.get_rank(), "bench")
    engine = initialize(model, EngineConfig(zero=ZeroConfig(stage=stage)), **kwargs)
    dp = engine.mesh["dp"]
    meta = {"model": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}}
    tokens = torch.randint(0, cfg.vocab_size, (1, 129), generator=torch.Generator().manual_seed(dist.get_rank()))
    tokens = tokens.to(local_device())

    def step() -> float:
        t = time.perf_counter()
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        engine.step()
        return time.perf_counter() - t

    step()  # warm-up: the optimizer state exists from here on
    rss0 = _rss()
    _reset_peak()
    base = [step() for _ in range(3)]
    step_peak = _peak() - rss0  # what a step itself holds at its peak (gathered params, activations, grads)
    base_step_s = sum(base) / len(base)
    dist.barrier()
    rss0 = _rss()
    _reset_peak()
    t = time.perf_counter()
    path = save_checkpoint(root, 1, engine.optimizer, dp, model=engine.model, meta=meta)
    save_s = time.perf_counter() - t
    sync_peak = _peak() - rss0  # what DCP's writing itself holds, synchronously
    async_ = _async(engine, str(Path(root) / "async"), step)
    dist.barrier()
    t = time.perf_counter()
    load_checkpoint(path, engine.optimizer, dp, model=engine.model)
    load_s = time.perf_counter() - t
    return {"path": str(path), "save_s": save_s, "load_s": load_s, "num_params": engine.num_params,
            "step_s": base_step_s, "step_peak": step_peak, "sync_save_peak": sync_peak, "async": async_}


def _export(mode: str, ckpt: str, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-c", _EXPORT, mode, ckpt, str(out)], capture_output=True, text=True,
                          check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _async_row(results: list[dict]) -> dict:
    """The asynchronous-save figures, the worst rank's; the first save allocates the staging, the second
    reuses it (its blocked time is the one a run pays at every later save)."""
    rows = []
    for r in results:
        a = r["async"]
        first, second = a["saves"]
        rows.append({
            "sync_save_s": r["save_s"], "step_s": r["step_s"],
            "async_first_blocked_s": first["blocked_s"], "async_blocked_s": second["blocked_s"],
            "async_blocked_over_sync": second["blocked_s"] / r["save_s"],
            "async_first_blocked_over_sync": first["blocked_s"] / r["save_s"],
            "async_write_s": second["write_s"],
            "step_during_async_save_s": second["step_during_s"],
            "step_during_async_save_over_step": (second["step_during_s"] / r["step_s"]
                                                 if second["step_during_s"] else None),
            "steps_during_async_save": second["steps_during"],
            "rank_state_bytes": a["local_state_bytes"],
            "staging_rss_bytes": first["rss_staged"] - first["rss_before"],
            "staging_rss_over_state": (first["rss_staged"] - first["rss_before"]) / a["local_state_bytes"],
            "second_save_rss_growth_bytes": second["rss_after"] - first["rss_after"],
            "first_staging_peak_rss_over_state": (first["staging_peak"] - first["rss_before"])
            / a["local_state_bytes"],
            "second_staging_peak_rss_over_state": (second["staging_peak"] - second["rss_before"])
            / a["local_state_bytes"],
            "first_save_peak_rss_over_state": (first["peak_during"] - first["rss_before"]) / a["local_state_bytes"],
            "second_save_peak_rss_over_state": (second["peak_during"] - second["rss_before"])
            / a["local_state_bytes"],
            "write_peak_over_staged_bytes": max(s["peak_during"] - s["rss_staged"] for s in a["saves"]),
            "baseline_step_peak_bytes": r["step_peak"],
            "baseline_sync_save_peak_bytes": r["sync_save_peak"],
        })
    worst = {}
    for key in rows[0]:
        values = [row[key] for row in rows if row[key] is not None]
        v = max(values) if values else None
        worst[key] = round(v, 4) if isinstance(v, float) else v
    return {"async": worst}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir, removed after)")
    parser.add_argument("--model", default="small", help="a Llama preset (small: the >= 1 GB state; tiny: a smoke run)")
    parser.add_argument("--offload", default="none", choices=("none", "cpu", "nvme"), help="optimizer state store")
    parser.add_argument("--no-export", action="store_true", help="skip the HF export rows")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="deepshard-bench-ckpt-"))
    root.mkdir(parents=True, exist_ok=True)  # also the NVMe store's swap dir (--offload nvme)
    # freed large tensors go back to the OS at once (glibc's threshold fixed at 1 MB), so the resident
    # sizes read from /proc are what is live, not what the heap kept
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    try:
        results = launch_local(_worker, args.world, str(root), args.stage, args.model, args.offload)
        r = results[0]
        ckpt = Path(r["path"])
        total = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
        model_bytes = r["num_params"] * 4
        row = {
            "model": args.model, "offload": args.offload, "world": args.world, "zero_stage": args.stage, "num_params": r["num_params"],
            "checkpoint_bytes": total, "save_s": round(r["save_s"], 3), "load_s": round(r["load_s"], 3),
            "save_GBps": round(total / r["save_s"] / 1e9, 3), "load_GBps": round(total / r["load_s"] / 1e9, 3),
            "model_fp32_bytes": model_bytes, **_async_row(results),
        }
        if not args.no_export:
            stream = _export("stream", str(ckpt), root / "hf-stream")
            naive = _export("naive", str(ckpt), root / "hf-naive")
            row.update({
                "export_s": round(stream["seconds"], 2),
                "export_extra_peak_rss_over_model": round(stream["extra_peak_bytes"] / model_bytes, 3),
                "baseline_load_all_extra_peak_rss_over_model": round(naive["extra_peak_bytes"] / model_bytes, 3),
                "baseline_s": round(naive["seconds"], 2)})
        print(json.dumps(row, indent=1))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
