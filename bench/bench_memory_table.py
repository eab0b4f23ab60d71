"""The preflight's memory estimate against the measured peak, row by row (issue 43's memory table), JSON out.

Each row runs ``apps/finetune/main.py`` (ZeRO-3, parameters and optimizer state on NVMe, random init, a few
steps, the app's defaults otherwise: micro-batch 8 of 128 tokens, the buffers and ``ac`` it picks for the
limit) inside a fresh cgroup v1 memory group of the row's limit, which holds the launcher, the forkserver
and the workers.  The app runs through this file's ``app`` mode, which reports what the preflight judged:
``estimate`` (``preflight.plan_memory``'s bytes: ranks x the working set + what the job's processes share
once), ``per_rank`` with its parts, what it picked, and the group's usage at the check (the room is the
limit less that usage).

Peak: the group's usage less its page cache (``memory.usage_in_bytes`` - ``memory.stat`` ``total_cache``),
sampled every 20 ms from outside the group; ``max_usage_gib`` (the kernel's high-water mark, page cache
included) beside it.  The estimate is held against the peak's growth over the usage at the check
(``grown``: peak - at check), which is what the preflight claims (estimate <= limit - usage at the check):
``ratio`` = estimate / grown, goal 1.0-1.15.

    python bench/bench_memory_table.py [--rows 450m_pf0_1.75,450m_pf0_2.25,1.1b_3.75] [--nvme-path /var/tmp]

Needs root and the cgroup v1 memory controller; the swap files go under ``--nvme-path`` (a disk, not a
tmpfs: tmpfs pages would be charged to the group as unreclaimable shared memory).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo root: bench.* by package path
GiB = 2**30

# (shape, world, limit GiB, overrides beyond ZeRO-Infinity's)
ROWS = {
    "450m_pf0_1.75": ("450m", 1, 1.75, ["zero.prefetch=0"]),
    "450m_pf0_2.25": ("450m", 1, 2.25, ["zero.prefetch=0"]),
    "450m_1.75": ("450m", 1, 1.75, []),
    "1.1b_3.75": ("1.1b", 2, 3.75, []),
    "smoke": ("tiny", 1, 1.5, []),  # the bench itself, in a minute
}
TINY = dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=512, vocab_size=8192)


def app_mode(argv: list[str]) -> None:
    """Run main.py with ``argv`` as its overrides, printing what the preflight judged (one
    ``memory-table:`` JSON line on stderr) before the run goes on."""
    import runpy

    import deepshard.finetune.app as app
    from deepshard.finetune import preflight
    from deepshard.finetune.models.working_set import run_shape, working_set_of
    from deepshard.launch.memory import memory_group

    planned = app.plan_memory

    def plan(s, nproc, *, forked=True):
        at_check = _usage(memory_group()[0]) if memory_group() else None
        base = preflight.job_baseline(nproc, forked=forked)
        out, estimate = planned(s, nproc, forked=forked)
        shape = run_shape(out)
        ws = working_set_of(out, baseline=base.per_rank, shape=shape)
        o = out.offload
        print("memory-table: " + json.dumps({
            "estimate": estimate, "nproc": nproc, "per_rank": ws.ram(shape.on_device),
            "parts": {**ws.host, **ws.device}, "shared": base.shared, "at_check": at_check,
            "picked": {"ac": out.engine.ac, "buffer_count": o.buffer_count, "param_buffer_count": o.param_buffer_count,
                       "param_prefetch": o.param_prefetch, "sub_group_size": o.sub_group_size}}), file=sys.stderr)
        return out, estimate

    app.plan_memory = plan
    sys.argv = [str(ROOT / "apps/finetune/main.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


# put on every process of a row by PYTHONPATH: once torch is imported, each backward writes its start and end
# (CLOCK_MONOTONIC, the sampler's clock) to DEEPSHARD_MEMTABLE_EVENTS, so the peak is split by phase
SITECUSTOMIZE = """
import os, sys, threading, time
def _watch():
    while "torch" not in sys.modules or not hasattr(sys.modules["torch"], "Tensor"):
        time.sleep(0.2)
    time.sleep(1.0)  # torch's import finished
    import torch
    path, inner = os.environ["DEEPSHARD_MEMTABLE_EVENTS"], torch.autograd.backward
    def backward(*a, **k):
        with open(path, "a") as f:
            f.write(f"{os.getpid()} start {time.monotonic()}\\n")
        try:
            return inner(*a, **k)
        finally:
            with open(path, "a") as f:
                f.write(f"{os.getpid()} end {time.monotonic()}\\n")
    torch.autograd.backward = backward  # Tensor.backward calls torch.autograd.backward by this name
if os.environ.get("DEEPSHARD_MEMTABLE_EVENTS"):
    threading.Thread(target=_watch, daemon=True).start()
"""


def _by_phase(series: list[tuple[float, int]], events: Path) -> dict[str, int]:
    """The largest usage (less page cache) sampled while some rank was in backward, and while none was."""
    spans, open_ = [], {}
    for line in (events.read_text().splitlines() if events.exists() else []):
        pid, what, t = line.split()
        if what == "start":
            open_[pid] = float(t)
        elif pid in open_:
            spans.append((open_.pop(pid), float(t)))
    inside = [u for t, u in series if any(a <= t <= b for a, b in spans)]
    outside = [u for t, u in series if not any(a <= t <= b for a, b in spans)]
    return {"backward": max(inside, default=0), "not_backward": max(outside, default=0), "backwards": len(spans)}


def _beats(beat_dir: Path) -> dict[str, str]:
    """Each rank's step and phase from its heartbeat (the loop's phases: forward covers the backward)."""
    out = {}
    for f in beat_dir.glob("rank*.json"):
        try:
            b = json.loads(f.read_text())
            out[f.stem] = f"step {b['step']} {b['phase']}"
        except (OSError, ValueError, KeyError):
            continue
    return out


def _usage(group: Path) -> dict[str, int]:
    """The group's usage, its page cache and their difference (bytes)."""
    usage = int((group / "memory.usage_in_bytes").read_text())
    stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
    cache = int(stat.get("total_cache", stat.get("cache", 0)))
    return {"usage": usage, "cache": cache, "less_cache": usage - cache}


def _processes(group: Path) -> dict[str, dict[str, int]]:
    """Each process of the group: its role (``launcher``, ``forkserver``, ``worker``: a child of the
    forkserver, or the launcher itself at world 1), anonymous and shared resident bytes (``/proc/PID/status``;
    a worker's count includes the forkserver's pages it shares), so a peak is split by who holds it."""
    seen: dict[str, tuple[str, bool, dict[str, int]]] = {}
    for pid in (group / "cgroup.procs").read_text().split():
        try:
            status = dict(x.split(":", 1) for x in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in x)
            cmd = b" ".join(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))
        except (OSError, ValueError):
            continue
        kib = {k: int(status.get(k, "0 kB").split()[0]) * 1024 for k in ("RssAnon", "RssShmem")}
        seen[pid] = (status.get("PPid", "").strip(), b"forkserver" in cmd, {"anon": kib["RssAnon"], "shmem": kib["RssShmem"]})
    out = {}
    for pid, (ppid, forkserver, sizes) in seen.items():
        role = "worker" if forkserver and seen.get(ppid, ("", False))[1] else "forkserver" if forkserver else "launcher"
        out[f"{role} ({pid})"] = sizes
    return out


def run_row(name: str, *, nvme: str, steps: int, timeout_s: float) -> dict:
    from bench.bench_infinity import memory_cgroup
    from bench.bench_infinity_app import SHAPES

    shape_name, world, limit_gib, extra = ROWS[name]
    run_dir = Path(tempfile.mkdtemp(prefix="memtable-", dir=nvme))
    beat_dir = run_dir / "beats"  # each rank's step and phase, read at the peak
    site = run_dir / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    events, series = run_dir / "backward-events", []
    args = [f"model.{k}={v}" for k, v in {**SHAPES, "tiny": TINY}[shape_name].items()] + [
        f"launcher.nproc_per_node={world}", f"train.max_steps={steps}", "+zero=stage3", "+offload=nvme",
        "offload.params=nvme", f"offload.nvme_path={run_dir}", f"hydra.run.dir={run_dir}",
        f"checkpoint.dir={run_dir / 'ckpt'}", "checkpoint.resume=none", *extra]
    cmd = [sys.executable, os.path.abspath(__file__), "app", *args]
    out: dict = {"row": name, "shape": shape_name, "world": world, "limit_gib": limit_gib, "overrides": extra}
    peak = {"less_cache": 0}
    try:
        with memory_cgroup(int(limit_gib * GiB)) as group:
            done = threading.Event()

            def sample() -> None:
                while not done.is_set():
                    try:
                        u = _usage(group)
                    except (OSError, ValueError):
                        u = {"less_cache": 0}
                    series.append((time.monotonic(), u["less_cache"]))
                    if u["less_cache"] > peak["less_cache"]:
                        peak.update(u, t=time.monotonic() - t0)
                        if u["less_cache"] > peak.get("split_at", 0) + 4 * 2**20:  # who holds it (a few reads)
                            peak.update(split_at=u["less_cache"], procs=_processes(group), beats=_beats(beat_dir))
                    time.sleep(0.02)

            t0 = time.monotonic()
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=run_dir,
                                      env={**os.environ, "DEEPSHARD_HEARTBEAT_DIR": str(beat_dir),
                                           "DEEPSHARD_MEMTABLE_EVENTS": str(events),
                                           "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])},
                                      preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))
            finally:
                done.set()
                sampler.join()
            out["wall_s"] = round(time.monotonic() - t0, 1)
            out["max_usage_gib"] = round(int((group / "memory.max_usage_in_bytes").read_text()) / GiB, 3)
        out["rc"] = proc.returncode
        table = [json.loads(x.split(": ", 1)[1]) for x in proc.stderr.splitlines() if x.startswith("memory-table: ")]
        said = [x for x in proc.stderr.splitlines() if x.startswith(("error:", "warning:", "offload:", "memory:"))]
        out["said"] = said[-4:]
        out["steps_done"] = len(re.findall(r"(\d+)/\d+ \[", proc.stderr)) and max(
            int(m) for m in re.findall(r"(\d+)/\d+ \[", proc.stderr))
        if proc.returncode != 0:
            out["stderr_tail"] = proc.stderr[-600:]
        out["passed_preflight"] = bool(table) and not any("memory: this run needs about" in x for x in said)
        out["peak_gib"] = round(peak["less_cache"] / GiB, 3)
        out["peak_at_s"] = round(peak.get("t", 0.0), 1)
        out["peak_by_process_mib"] = {k: {n: round(v / 2**20, 1) for n, v in x.items()}
                                      for k, x in peak.get("procs", {}).items()}
        out["peak_beats"] = peak.get("beats", {})
        if table:
            t = table[0]
            gib = {k: round(v / GiB, 3) for k, v in t["parts"].items()}
            out.update(estimate_gib=round(t["estimate"] / GiB, 3), per_rank_gib=round(t["per_rank"] / GiB, 3),
                       parts_gib=gib, shared_gib={k: round(v / GiB, 3) for k, v in t["shared"].items()},
                       picked=t["picked"])
            if t["at_check"]:
                at = t["at_check"]["less_cache"]
                out["at_check_gib"] = round(at / GiB, 3)
                out["grown_gib"] = round((peak["less_cache"] - at) / GiB, 3)
                out["ratio"] = round(t["estimate"] / max(peak["less_cache"] - at, 1), 3)
                phases = _by_phase(series, events)
                out["grown_by_phase_gib"] = {k: round((v - at) / GiB, 3) for k, v in phases.items() if k != "backwards"}
                out["backwards_seen"] = phases["backwards"]
    except subprocess.TimeoutExpired:
        out["rc"] = "timeout"
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


def main(argv: list[str]) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="450m_pf0_1.75,450m_pf0_2.25,1.1b_3.75", help=f"among {', '.join(ROWS)}")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--nvme-path", default="/var/tmp")
    ap.add_argument("--timeout", type=float, default=1500)
    args = ap.parse_args(argv)
    for name in args.rows.split(","):
        if name not in ROWS:
            raise SystemExit(f"error: --rows: {name!r} is not a row; valid: {', '.join(ROWS)}")
    for name in args.rows.split(","):  # one line per row as it ends: a long run reports as it goes
        print(json.dumps(run_row(name, nvme=args.nvme_path, steps=args.steps, timeout_s=args.timeout)), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["app"]:
        app_mode(sys.argv[2:])
    else:
        main(sys.argv[1:])
