"""What each process of a local app run holds before training: the launcher, multiprocessing's
resource tracker and forkserver, and each worker, from ``/proc/PID/smaps_rollup`` (Private_Dirty,
Pss, Anonymous, Rss in MiB), with the memory cgroup's usage, at three moments:

- ``workers_started``: the first sample where every rank's heartbeat file exists (the workers have
  forked and joined their group, nothing built yet),
- ``before_step1``: the last sample where every rank is still in its ``startup`` phase,
- ``end``: the last sample before the launcher exits; and the group's peak, and each kind of
  process's largest Private_Dirty over the run (``max_private_dirty``).

It also prints the preflight's estimate of the baseline (``preflight.job_baseline`` read in a
fresh process with torch and the app imported, as the launcher is at its preflight) and its ratio to
the group's growth at ``workers_started`` over the launcher's usage at its preflight.

    python bench/bench_process_baseline.py [--tree DIR] [--label NAME] -- <app overrides...>

``--tree``: run the app of another checkout (e.g. ``git worktree add /tmp/before HEAD~1``) to get
the untrimmed figures in the same session.  Needs root and the cgroup v1 memory controller.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.* and tests.* by package path
from bench.bench_infinity import memory_cgroup  # noqa: E402

KEYS = ("Private_Dirty", "Pss", "Anonymous", "Rss")


def _rollup(pid: str) -> dict[str, int] | None:
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
    except OSError:
        return None
    d = {ln.split(":")[0]: int(ln.split()[1]) >> 10 for ln in lines if ln.split()[1].isdigit()}
    return {k: d.get(k, 0) for k in KEYS}


def _role(pid: str, launcher: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return "gone"
    if int(pid) == launcher:
        return "launcher"
    if "resource_tracker" in cmd:
        return "resource_tracker"
    if "forkserver" in cmd and ppid == launcher:
        return "forkserver"
    return f"worker{pid}"


def _sample(group: Path, launcher: int) -> dict:
    procs = {}
    for pid in (group / "cgroup.procs").read_text().split():
        roll = _rollup(pid)
        if roll is not None:
            procs[_role(pid, launcher)] = roll
    return {"usage": int((group / "memory.usage_in_bytes").read_text()) >> 20, "procs": procs}


def _phases(beat_dir: Path, nproc: int) -> list[str] | None:
    try:
        files = sorted(beat_dir.glob("rank*.json"))
        return [json.loads(f.read_text())["phase"] for f in files] if len(files) == nproc else None
    except (OSError, ValueError):
        return None


def _env(tree: Path | None) -> dict:
    env = dict(os.environ)
    if tree is not None:
        src = [str(p) for p in sorted((tree / "packages").glob("*/src"))] + [str(tree / "apps/finetune/src")]
        env["PYTHONPATH"] = os.pathsep.join(src + [env.get("PYTHONPATH", "")])
    return env


def estimate(tree: Path | None, nproc: int) -> dict | None:
    """The preflight's baseline, read in a fresh process importing what the launcher has imported."""
    code = ("import json, os, deepshard.finetune.app, deepshard.finetune.preflight as pf\n"
            "if hasattr(pf, 'APP_PROCESSES'):  # the app's sizes beside launch's job_baseline\n"
            "    job_baseline = pf.job_baseline\n"
            "else:  # a tree before them: the app's process_memory\n"
            "    from deepshard.finetune.process_memory import job_baseline\n"
            f"b = job_baseline({nproc})\n"
            "print(json.dumps({'per_rank': b.per_rank >> 20, **{k: v >> 20 for k, v in b.shared.items()}}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(tree))
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None


def measure(args: list[str], *, nproc: int, tree: Path | None = None, limit: int = 20 * 2**30,
            interval_s: float = 0.05) -> dict:
    app = (tree or ROOT) / "apps/finetune/main.py"
    run = Path(tempfile.mkdtemp(prefix="baseline-", dir="/var/tmp"))
    cmd = [sys.executable, str(app), f"hydra.run.dir={run}", f"checkpoint.dir={run}/ckpt", "checkpoint.resume=none",
           f"launcher.nproc_per_node={nproc}", *args]
    out: dict = {}
    with memory_cgroup(limit) as group:
        p = subprocess.Popen(cmd, cwd=run, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(tree),
                             preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))
        first_server = None
        while p.poll() is None:
            snap = _sample(group, p.pid)
            if first_server is None and "forkserver" in snap["procs"]:  # the preflight is behind the launcher
                first_server = snap
                out["at_server_start"] = snap
            phases = _phases(run / "heartbeat", nproc)
            if phases is not None:
                out.setdefault("workers_started", snap)
                if all(ph == "startup" for ph in phases):
                    out["before_step1"] = snap
            out["end"] = snap
            for role, roll in snap["procs"].items():  # each process's largest private part over the run
                kind = "worker" if role.startswith("worker") else role
                top = out.setdefault("max_private_dirty", {})
                top[kind] = max(top.get(kind, 0), roll["Private_Dirty"])
            time.sleep(interval_s)
        err = p.communicate()[1]
        out["peak"] = int((group / "memory.max_usage_in_bytes").read_text()) >> 20
    out["rc"] = p.returncode
    if p.returncode:
        out["stderr"] = err[-2000:]
    subprocess.run(["rm", "-rf", str(run)], check=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", type=Path, default=None)
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    got = measure(a.overrides, nproc=a.nproc, tree=a.tree)
    est = estimate(a.tree, a.nproc)
    if est is not None and "workers_started" in got and "at_server_start" in got:
        launcher_then = got["at_server_start"]["procs"].get("launcher", {}).get("Anonymous", 0)
        predicted = est["per_rank"] * a.nproc + sum(v for k, v in est.items() if k != "per_rank")
        growth = got["workers_started"]["usage"] - launcher_then
        est["ratio_to_growth"] = round(predicted / max(growth, 1), 3)
    print(json.dumps({"label": a.label, "overrides": a.overrides, "estimate_mib": est, **got}, indent=1))


if __name__ == "__main__":
    main()
