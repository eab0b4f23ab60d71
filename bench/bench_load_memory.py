"""Host memory while ranks load a HF checkpoint at ZeRO-3 (issue 39): each rank's peak growth during
the load (anonymous pages, sampled, and VmHWM, which also counts the file's mapped pages) beside the
checkpoint's size / world and its largest tensor.

    python bench/bench_load_memory.py [--dir DIR] [--vocab 32000] [--dim 1024] [--layers 4] [--world 2]

writes a random-weight Llama checkpoint into ``DIR`` (a temporary folder unless given; never kept in
the repo), loads it through the app's ZeRO-3 path (``build_model`` on meta, the family's recipe,
``to_empty``, ``init_model``) on ``--world`` local ranks and prints one JSON line.  Run it with another
checkout's interpreter (``/work/main/.venv/bin/python bench/bench_load_memory.py``) for the figures
before a change.  ``worker`` is one rank (what the launch runs; tests/finetune_app's cgroup test too).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

MIB = 2**20


def make_checkpoint(path: Path, *, vocab: int, dim: int, layers: int, seed: int = 0) -> dict:
    """A Llama HF folder (config.json + one safetensors file, random fp32 weights written tensor by
    tensor, so making it never holds the model); its size and largest tensor in bytes."""
    import torch

    from deepshard.finetune.models.hf import to_hf_name, write_safetensors
    from deepshard.finetune.models.llama import Llama, LlamaConfig
    from deepshard.finetune.models.llama.hf import hf_config_dict

    cfg = LlamaConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=max(1, dim // 64),
                      n_kv_heads=max(1, dim // 128), ffn_hidden=int(dim * 8 / 3) // 64 * 64, max_seq_len=64)
    with torch.device("meta"):
        model = Llama(cfg)
    specs = [(to_hf_name(n), torch.float32, tuple(p.shape)) for n, p in model.named_parameters()]
    g = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
    size = write_safetensors(path / "model.safetensors", specs,
                             (torch.randn(s, generator=g) * 0.02 for _, _, s in specs))
    largest = max(4 * torch.Size(s).numel() for _, _, s in specs)
    return {"bytes": size, "largest_tensor": largest, "num_params": sum(torch.Size(s).numel() for _, _, s in specs)}


def checksum(t) -> float:
    """A tensor's float64 sum, 2**18 elements at a time (a whole float64 copy would outgrow the load)."""
    return float(sum(c.double().sum().item() for c in t.reshape(-1).split(2**18)))


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def worker(path: str, wait: bool = False) -> dict:
    """One rank (RANK/WORLD_SIZE/MASTER_* in the environment): the app's ZeRO-3 load of ``path``; its
    peak growth (anonymous, sampled every ms; VmHWM), its local shard's bytes and each parameter's
    local sum (float64).  ``wait``: print ``ready`` once imported and joined, then load when stdin
    gives a line (so a caller can set a memory limit over what the process already holds)."""
    import torch
    import torch.distributed as dist

    from deepshard.core import build_mesh, init_distributed
    from deepshard.finetune.config import validate
    from deepshard.finetune.models import registry
    from deepshard.finetune.recipe.assemble import build_model, init_model
    from deepshard.finetune.tools.estimate import compose

    world = int(os.environ["WORLD_SIZE"])
    s = validate(compose(["model=hf", f"model.path={path}", "+zero=stage3", "precision=fp32", "data.seq_len=32",
                          f"launcher.nproc_per_node={world}"]))
    init_distributed()
    mesh = build_mesh(s.parallel)
    e, spec = s.engine, registry.spec_of(s.model)
    dist.barrier()
    if wait:
        print("ready", flush=True)
        sys.stdin.readline()
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM from here on
        f.write("5")
    start_anon, start_rss = _status("RssAnon"), _status("VmRSS")
    peak = [start_anon]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _status("RssAnon"))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    model = build_model(s, torch.device("cpu"), materialize=False)
    spec.parallelize(model, mesh=mesh, zero=e.zero, dtype=e.precision.dtype, ac=e.ac, offload_params=None,
                     ac_offload=e.ac_offload, compile=e.compile)
    model.to_empty(device="cpu")
    init_model(model, s)
    took = time.perf_counter() - t0
    done.set()
    sampler.join()
    peak[0] = max(peak[0], _status("RssAnon"))
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    out = {"rank": dist.get_rank(), "anon_growth": peak[0] - start_anon, "hwm_growth": _status("VmHWM") - start_rss,
           "shard_bytes": shard, "load_s": round(took, 2),
           "sums": {n: checksum(p.to_local()) for n, p in model.named_parameters()}}
    dist.barrier()
    dist.destroy_process_group()
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(path: Path, world: int, *, python: str = sys.executable, group: Path | None = None,
           when_ready: Callable[[], None] | None = None, timeout_s: float = 300) -> list[dict | int]:
    """``world`` worker processes (inside the cgroup ``group`` when given); each rank's JSON, or its
    return code when it failed (-9: killed, e.g. by the OOM killer).  ``when_ready``: called once every
    rank has imported and joined, before any loads."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "OMP_NUM_THREADS": "1"}
        cmd = [python, os.path.abspath(__file__), "worker", str(path)] + (["wait"] if when_ready else [])
        if group is not None:  # join the group before exec: everything the worker maps is charged
            cmd = ["sh", "-c", f'echo $$ > {group}/tasks && exec "$@"', "sh", *cmd]
        procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))
    out: list[dict | int] = []
    try:
        if when_ready is not None:
            for p in procs:
                line = p.stdout.readline()
                if line.strip() != "ready":  # it ended before joining: say why (its stderr), not just its code
                    p.wait(timeout=30)
                    raise AssertionError(f"a worker ended before it was ready (exit {p.returncode}, stdout "
                                         f"{line!r}): {p.stderr.read()[-3000:]}")
            when_ready()
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout_s)
            if p.returncode != 0:
                out.append(p.returncode)
                if p.returncode != -9:
                    sys.stderr.write(stderr[-3000:])
            else:
                out.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.dir or tmp) / "ckpt"
        ckpt = make_checkpoint(path, vocab=args.vocab, dim=args.dim, layers=args.layers) if not (
            path / "model.safetensors").exists() else json.loads((path / "made.json").read_text())
        (path / "made.json").write_text(json.dumps(ckpt))
        ranks = launch(path, args.world)
        print(json.dumps({"checkpoint_mib": round(ckpt["bytes"] / MIB, 1),
                          "per_world_mib": round(ckpt["bytes"] / args.world / MIB, 1),
                          "largest_tensor_mib": round(ckpt["largest_tensor"] / MIB, 1),
                          "ranks": [r if isinstance(r, int) else {k: round(v / MIB, 1) if k.endswith(
                              ("growth", "bytes")) else v for k, v in r.items() if k != "sums"} for r in ranks]}))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        print(json.dumps(worker(sys.argv[2], wait=sys.argv[3:] == ["wait"])))
    else:
        main()
