"""The chaos soak: a seeded run of the app under ``deepshard --max_restarts`` through many faults of every
kind, then a clean run of the same config; the two must end bit-identical (fp32).

    python bench/bench_chaos.py [--seed 0] [--steps 300] [--per_kind 5,4,4,4,4,5,4] [--doc docs/chaos.md]

The first half of the steps saves synchronously, the second asynchronously (each a launch of the same
command but for ``train.max_steps`` and ``checkpoint.async_save``; ``scheduler=warmup`` does not depend on
``max_steps``).  Checkpoints go to a tmpfs of their own (root: the ENOSPC fault fills it).  Faults fire at
events inside the workers (``deepshard.finetune.recipe.chaos``: a step's start, a save's first bytes, a
load); the harness does what a cluster would: kills or preempts the launcher and relaunches the same
command, corrupts the newest checkpoint and frees the disk while the job is down.  The report (JSON on
stdout, a table in ``--doc``): faults by kind, restarts, the step each launch or restart resumed from, the
time lost per fault (from the fault until a step past it is logged again, less one step), and goodput
(the time of the steps that count over the wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAIN = ROOT / "apps/finetune/main.py"
DEEPSHARD = str(Path(sys.executable).with_name("deepshard"))
TINY = ["+zero=stage3", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_hidden=128", "data.seq_len=64", "data.num_docs=600", "scheduler=warmup", "train.log_every=25"]
KINDS = ("sigkill", "sigstop", "enospc", "corrupt", "sigterm_async", "launcher_kill", "load_kill")
EVERY = 5  # checkpoint.every_steps
HANG_S = 6
MAX_RESTARTS = 50


def make_plan(seed: int, steps: int, per_kind: dict[str, int]) -> list[dict]:
    """Faults at distinct steps from ``seed``; save faults at save steps (async ones in the second half),
    each ``load_kill`` after a distinct earlier fault."""
    rng = random.Random(seed)
    half = steps // 2
    taken: set[int] = set()

    def pick(lo: int, hi: int, save: bool) -> int:
        for _ in range(10_000):
            s = rng.randrange(lo, hi)
            s = s - s % EVERY if save else s
            if s >= lo and all(abs(s - t) >= 4 for t in taken):
                taken.add(s)
                return s
        raise SystemExit(f"error: --steps={steps}: too few steps for the faults asked (4 apart, saves every {EVERY})")

    faults = []
    for kind in KINDS[:-1]:
        for _ in range(per_kind[kind]):
            # a corrupted newest checkpoint needs an older good one: three saves done first
            lo = half + EVERY if kind == "sigterm_async" else 3 * EVERY + 1 if kind == "corrupt" else 2 * EVERY
            hi = steps - EVERY
            phase = "save" if kind in ("enospc", "sigterm_async") else "step"
            faults.append({"kind": kind, "phase": phase, "step": pick(lo, hi, phase == "save"),
                           "rank": rng.randrange(2)})
    faults.sort(key=lambda f: f["step"])
    for i, f in enumerate(faults):
        f["id"] = i
    for after in rng.sample(range(len(faults)), per_kind["load_kill"]):
        faults.append({"id": len(faults), "kind": "load_kill", "phase": "load", "step": -1, "after": after,
                       "rank": rng.randrange(2)})
    return faults


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie (its parent has not reaped it yet) is gone too
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def wait_gone(pid: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def corrupt_newest(ckpt: Path) -> str:
    """Flip 64 bytes in the middle of the newest checkpoint's largest shard file (its checksum catches it)."""
    newest = max((p for p in ckpt.glob("step-*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        data = f.read(64)
        f.seek(-len(data), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in data))
    return str(shard.relative_to(ckpt))


class Job:
    """The launches of one run (soak or clean): each segment is relaunched until it ends with 0."""

    def __init__(self, work: Path, name: str, ckpt: Path, chaos_dir: Path | None) -> None:
        self.run_dir, self.ckpt, self.chaos = work / name, ckpt, chaos_dir
        self.logs = work / f"{name}-logs"
        self.logs.mkdir(parents=True)
        self.launches: list[dict] = []
        self.events: list[dict] = []
        self.wall_s = 0.0
        self._seen = 0

    def command(self, max_steps: int, async_save: bool) -> list[str]:
        return [DEEPSHARD, f"--max_restarts={MAX_RESTARTS}", f"--hang_s={HANG_S}", str(MAIN), *TINY,
                f"train.max_steps={max_steps}", f"checkpoint.every_steps={EVERY}", "checkpoint.keep_last=3",
                f"checkpoint.async_save={str(async_save).lower()}", f"checkpoint.dir={self.ckpt}",
                f"hydra.run.dir={self.run_dir}"]

    def segment(self, max_steps: int, async_save: bool, deadline: float) -> None:
        cmd = self.command(max_steps, async_save)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.chaos is not None:
            env["DEEPSHARD_CHAOS_PLAN"] = str(self.chaos / "plan.json")
        while True:
            n = len(self.launches)
            log = self.logs / f"launch{n}.log"
            start = time.time()
            with open(log, "w") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=self.run_dir.parent, env=env,
                                        start_new_session=True)
                signalled = self._watch(proc, deadline)
            self.wall_s += time.time() - start
            text = log.read_text()
            self.launches.append({"launch": n, "max_steps": max_steps, "async_save": async_save,
                                  "exit": proc.returncode, "seconds": round(time.time() - start, 1),
                                  "restarts": text.count("restarting the workers"), "ended_by": signalled})
            if proc.returncode == 0 and signalled is None:
                return
            if signalled is None:
                raise RuntimeError(f"launch {n} failed with {proc.returncode}: {text[-3000:]}")

    def _watch(self, proc: subprocess.Popen, deadline: float) -> str | None:
        """Act on the workers' fault events until the launch ends; the harness's own signal, if it sent one."""
        signalled = None
        while proc.poll() is None:
            if time.time() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise RuntimeError("the soak ran past its deadline")
            for ev in self._new_events():
                if ev["event"] != "fault":
                    continue
                kind = ev["kind"]
                if kind == "launcher_kill":
                    os.kill(proc.pid, signal.SIGKILL)  # the workers die with it (parent-death signal)
                    signalled = kind
                elif kind == "sigterm_async":
                    os.killpg(proc.pid, signal.SIGTERM)  # a scheduler's preemption: every process of the job
                    signalled = kind
                elif kind in ("corrupt", "enospc"):
                    wait_gone(ev["pid"])
                    if kind == "corrupt":
                        ev["corrupted"] = corrupt_newest(self.ckpt)
                    else:
                        (self.ckpt.parent / "filler").unlink()
                    (self.chaos / "hold").unlink()
                ev["handled"] = time.time()
            time.sleep(0.02)
        try:  # nothing of this launch may outlive it (the relaunch takes the same locks)
            deadline_kill = time.monotonic() + 30
            while time.monotonic() < deadline_kill:
                os.killpg(proc.pid, 0)
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._new_events()
        return signalled

    def _new_events(self) -> list[dict]:
        path = self.chaos / "events.jsonl" if self.chaos is not None else None
        if path is None or not path.exists():
            return []
        lines = path.read_text().splitlines()
        new = []
        for line in lines[self._seen:]:
            if not line.endswith("}"):
                break  # being written
            new.append(json.loads(line))
        self._seen += len(new)
        self.events += new
        return new


def loss_events(run_dir: Path) -> list[tuple[str, float, int, float]]:
    """Every logged ``train/loss`` as (event file, wall time, step, value), from all launches' files."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    out = []
    for f in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        for raw in RawEventFileLoader(str(f)).Load():
            ev = Event.FromString(raw)
            for v in ev.summary.value:
                if v.tag == "train/loss":
                    out.append((f.name, ev.wall_time, ev.step, v.simple_value))
    return out


def step_times(events: list[tuple[str, float, int, float]]) -> dict[int, float]:
    """Seconds of each step's last run (the one that counts): the gap to the step before it in the same file."""
    last: dict[int, tuple[str, float]] = {}
    for name, wall, step, _ in sorted(events, key=lambda e: e[1]):
        last[step] = (name, wall)
    gaps = {s: last[s][1] - last[s - 1][1] for s in last if s - 1 in last and last[s - 1][0] == last[s][0]
            and last[s][1] > last[s - 1][1]}
    typical = statistics.median(gaps.values()) if gaps else 0.0
    return {s: gaps.get(s, typical) for s in last}


def compare(soak: Job, clean: Job, steps: int) -> dict:
    """Final weights and optimizer state bit for bit; every logged loss of the soak against the clean run's."""
    import torch

    from deepshard.core.checkpoint.consolidate import iter_full_tensors

    a, b = soak.ckpt / f"step-{steps:08d}", clean.ckpt / f"step-{steps:08d}"
    clean_tensors = {info.key: t for info, t in iter_full_tensors(b)}
    compared = len(clean_tensors)
    differ = [info.key for info, t in iter_full_tensors(a)
              if info.key not in clean_tensors or not torch.equal(t, clean_tensors.pop(info.key))]
    differ += sorted(clean_tensors)  # in the clean run only
    base = {step: v for _, _, step, v in loss_events(clean.run_dir)}
    logged = loss_events(soak.run_dir)
    unequal = sorted({step for _, _, step, v in logged if base.get(step) != v})
    return {"tensors_compared": compared, "tensors_differing": differ,
            "state_bit_identical": not differ, "loss_records_compared": len(logged),
            "steps_logged": len({e[2] for e in logged}), "steps_with_unequal_loss": unequal,
            "losses_equal": not unequal and sorted({e[2] for e in logged}) == sorted(base) == list(range(1, steps + 1))}


def lost_time(job: Job, events: list[tuple[str, float, int, float]], per_step: float) -> list[dict]:
    """Per fault: from its event until, after the resume that follows it, a step past the furthest one done
    before that resume is logged, less one step."""
    by_time = sorted(events, key=lambda e: e[1])
    faults = {f["id"]: f for f in json.loads((job.chaos / "plan.json").read_text())["faults"]}
    out = []
    for ev in job.events:
        if ev["event"] != "fault":
            continue
        # the furthest step done before the recovery (an async save's failure surfaces steps later)
        again = next((e for e in job.events if e["event"] == "resumed" and e["time"] > ev["time"]), None)
        until = again["time"] if again is not None else ev["time"]
        at = max([ev["step"] - 1 if ev["phase"] == "step" else ev["step"]] +
                 [s for _, w, s, _ in by_time if w <= until])
        back = next((w for _, w, s, _ in by_time if w > until and s > at), None)
        resumed = None if again is None else again["step"]
        row = {"id": ev["id"], "kind": ev["kind"], "phase": ev["phase"], "step": ev["step"], "rank": ev["rank"],
               "resumed_from": resumed, "lost_s": None if back is None else round(back - ev["time"] - per_step, 2)}
        if ev["kind"] == "load_kill":
            row["during_recovery_from"] = faults[ev["id"]]["after"]
        if "corrupted" in ev:
            row["corrupted"] = ev["corrupted"]
        out.append(row)
    return out


def run(args: argparse.Namespace) -> dict:
    per_kind = dict(zip(KINDS, (int(n) for n in args.per_kind.split(",")), strict=True))
    work = Path(tempfile.mkdtemp(prefix="deepshard-chaos-"))
    disk = work / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.disk_mb}m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        raise SystemExit(f"error: cannot mount a tmpfs for the checkpoints (root needed): {mounted.stderr.strip()}")
    try:
        chaos_dir = work / "chaos"
        chaos_dir.mkdir()
        plan = make_plan(args.seed, args.steps, per_kind)
        (chaos_dir / "plan.json").write_text(json.dumps({"faults": plan, "fill": str(disk / "filler"),
                                                         "pause_s": 5.0}))
        (disk / "soak").mkdir()
        clean_dir = work / "clean-ckpt"
        soak = Job(work, "soak", disk / "soak", chaos_dir)
        clean = Job(work, "clean", clean_dir, None)
        deadline = time.time() + args.timeout_s
        for job in (soak, clean):
            job.segment(args.steps // 2, False, deadline)
            job.segment(args.steps, True, deadline)
        soak_events, clean_events = loss_events(soak.run_dir), loss_events(clean.run_dir)
        per_step = statistics.median(step_times(clean_events).values())
        faults = lost_time(soak, soak_events, per_step)
        useful = sum(step_times(soak_events).values())
        report = {
            "seed": args.seed, "steps": args.steps, "world_size": 2, "every_steps": EVERY, "keep_last": 3,
            "hang_s": HANG_S, "max_restarts": MAX_RESTARTS, "planned": len(plan), "faults_fired": len(faults),
            "faults_by_kind": {k: sum(f["kind"] == k for f in faults) for k in KINDS},
            "faults_by_phase": {p: sum(f["phase"] == p for f in faults) for p in ("step", "save", "load")},
            "launches": len(soak.launches), "restarts": sum(x["restarts"] for x in soak.launches),
            "resumed_from": [e["step"] for e in soak.events if e["event"] == "resumed"],
            "wall_s": round(soak.wall_s, 1), "useful_step_s": round(useful, 1),
            "goodput": round(useful / soak.wall_s, 3),
            "clean": {"wall_s": round(clean.wall_s, 1), "useful_step_s": round(sum(step_times(clean_events).values()), 1),
                      "goodput": round(sum(step_times(clean_events).values()) / clean.wall_s, 3),
                      "step_s": round(per_step, 4)},
            "lost_s_total": round(sum(f["lost_s"] or 0 for f in faults), 1),
            **compare(soak, clean, args.steps), "faults": faults, "launch_log": soak.launches,
        }
        report["survived"] = (report["state_bit_identical"] and report["losses_equal"]
                              and len(faults) == len(plan))
        return report
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
        if not args.keep:
            subprocess.run(["rm", "-rf", str(work)], check=False)


def write_doc(r: dict, path: Path) -> None:
    """The report as markdown (docs/chaos.md): the figures, then one row per fault."""
    rows = "\n".join(f"| {f['id']} | {f['kind']} | {f['phase']} | {f['step']} | {f['rank']} | {f['resumed_from']} | "
                     f"{f['lost_s']} |" for f in r["faults"])
    kinds = ", ".join(f"{k} {n}" for k, n in r["faults_by_kind"].items())
    path.write_text(f"""# The chaos soak

`python bench/bench_chaos.py --seed {r['seed']} --steps {r['steps']} --doc docs/chaos.md` (root: the checkpoints live on a
tmpfs of their own). The app's tiny Llama at ZeRO-3 on 2 CPU workers under `deepshard --max_restarts={r['max_restarts']}
--hang_s={r['hang_s']}`, a save every {r['every_steps']} steps (`keep_last={r['keep_last']}`), steps 1-{r['steps'] // 2}
with synchronous saves, {r['steps'] // 2 + 1}-{r['steps']} with `checkpoint.async_save=true`; then a clean run of the
same config. Faults fire at events inside the workers (`deepshard.finetune.recipe.chaos`, active only under
`DEEPSHARD_CHAOS_PLAN`: a step's start, a save's first written bytes, a checkpoint's load); the harness does what a
cluster would (relaunches a killed or preempted launcher with the same command, corrupts the newest checkpoint and
frees the disk while the job is down).

| | |
|---|---|
| faults fired / planned | {r['faults_fired']} / {r['planned']} ({kinds}) |
| faults by phase | {", ".join(f"{k} {n}" for k, n in r['faults_by_phase'].items())} |
| launches / agent restarts | {r['launches']} / {r['restarts']} |
| final weights + optimizer state | {"bit-identical" if r['state_bit_identical'] else "DIFFERENT"} to the clean run's ({r['tensors_compared']} tensors, fp32) |
| logged losses | {"equal" if r['losses_equal'] else "NOT equal"} step for step ({r['loss_records_compared']} records of {r['steps_logged']} steps, replays included) |
| wall time, soak / clean | {r['wall_s']} s / {r['clean']['wall_s']} s |
| goodput (useful step time / wall time), soak / clean | {r['goodput']} / {r['clean']['goodput']} |
| time lost to faults (sum) | {r['lost_s_total']} s |

Time lost per fault: from the fault until, after the resume that follows it, a step past the furthest one done
before (an asynchronous save's failure surfaces steps later) is logged, less one step
({r['clean']['step_s']} s); a fault during the recovery from another (`load_kill`) is counted in both. Goodput: the
seconds of the steps that count (each step's last run) over the soak's wall time, launches and restarts included.

| id | kind | phase | step | rank | resumed from | lost (s) |
|---|---|---|---|---|---|---|
{rows}

Every launch or restart resumed from: {r['resumed_from']}

What the soak found on its way (both fixed with it): the launcher's hang watchdog watched once per
launcher, so under `--max_restarts` the second SIGSTOP of a run hung it for good (it now keeps watching and never
judges the files of workers that are gone: `tests/launch/test_watchdog_restarts.py`); and TensorBoard's writer
flushed only every 2 minutes, so a killed rank 0 lost logged steps that no resume replays (the app now flushes at
each checkpoint; the soak's loss comparison over all 300 steps is its check).  Where the time goes: a restart costs about 4-6 s here (the workers' start, `import torch`, the
model and the load) against a {r['clean']['step_s']} s step, a SIGSTOP adds `--hang_s`, and a SIGTERM during an async
save holds the save 5 s (the hook's pause, so that the signal lands while it is in flight).
""")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--per_kind", default="5,4,4,4,4,5,4", help=f"faults of each kind, in this order: {','.join(KINDS)}")
    p.add_argument("--disk_mb", type=int, default=96, help="the checkpoints' tmpfs")
    p.add_argument("--timeout_s", type=float, default=2400)
    p.add_argument("--doc", default=None, help="also write the report as markdown here (docs/chaos.md)")
    p.add_argument("--keep", action="store_true", help="keep the work dir (logs, events, checkpoints)")
    args = p.parse_args()
    counts = args.per_kind.split(",")
    if len(counts) != len(KINDS) or not all(c.isdigit() and int(c) >= 1 for c in counts):
        raise SystemExit(f"error: --per_kind={args.per_kind}: {len(KINDS)} positive counts, for {','.join(KINDS)}")
    if args.steps < 40 or args.steps % (2 * EVERY):
        raise SystemExit(f"error: --steps={args.steps}: a multiple of {2 * EVERY}, at least 40")
    report = run(args)
    print(json.dumps(report, indent=1))
    if args.doc:
        write_doc(report, Path(args.doc))


if __name__ == "__main__":
    main()
