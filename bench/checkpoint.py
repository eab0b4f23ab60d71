"""Checkpoint costs for model=small (~100M params) at world 2: save and load seconds and bytes,
and the HF export's peak RSS relative to the model's size, against a load-everything baseline
(every model tensor consolidated in memory, then one safetensors write) in the same run.

    python bench/checkpoint.py [--stage 2] [--world 2] [--dir /tmp/deepshard-bench-ckpt]
"""

from __future__ import annotations

import argparse
import json
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


def _worker(root: str, stage: int) -> dict:
    import torch
    import torch.distributed as dist

    from deepshard.core import EngineConfig, ZeroConfig, init_distributed, initialize
    from deepshard.core.checkpoint.state import load_checkpoint, save_checkpoint
    from deepshard.finetune.models.llama import PRESETS, Llama

    init_distributed()
    cfg = PRESETS["small"]
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    engine = initialize(model, EngineConfig(zero=ZeroConfig(stage=stage)))
    dp = engine.mesh["dp"]
    meta = {"model": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}}
    dist.barrier()
    t = time.perf_counter()
    path = save_checkpoint(root, 1, engine.optimizer, dp, model=engine.model, meta=meta)
    save_s = time.perf_counter() - t
    dist.barrier()
    t = time.perf_counter()
    load_checkpoint(path, engine.optimizer, dp, model=engine.model)
    load_s = time.perf_counter() - t
    return {"path": str(path), "save_s": save_s, "load_s": load_s, "num_params": engine.num_params}


def _export(mode: str, ckpt: str, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-c", _EXPORT, mode, ckpt, str(out)], capture_output=True, text=True,
                          check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir, removed after)")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="deepshard-bench-ckpt-"))
    try:
        r = launch_local(_worker, args.world, str(root), args.stage)[0]
        ckpt = Path(r["path"])
        total = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
        model_bytes = r["num_params"] * 4
        stream = _export("stream", str(ckpt), root / "hf-stream")
        naive = _export("naive", str(ckpt), root / "hf-naive")
        print(json.dumps({
            "model": "small", "world": args.world, "zero_stage": args.stage, "num_params": r["num_params"],
            "checkpoint_bytes": total, "save_s": round(r["save_s"], 3), "load_s": round(r["load_s"], 3),
            "save_GBps": round(total / r["save_s"] / 1e9, 3), "load_GBps": round(total / r["load_s"] / 1e9, 3),
            "model_fp32_bytes": model_bytes,
            "export_s": round(stream["seconds"], 2),
            "export_extra_peak_rss_over_model": round(stream["extra_peak_bytes"] / model_bytes, 3),
            "baseline_load_all_extra_peak_rss_over_model": round(naive["extra_peak_bytes"] / model_bytes, 3),
            "baseline_s": round(naive["seconds"], 2),
        }, indent=1))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
