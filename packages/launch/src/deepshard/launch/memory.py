"""The memory a host gives a job, and what the job's processes hold before training: read before any
worker starts, by whoever plans the run (the app's preflight, ``tools/estimate``).

- The room: the memory cgroup's limit less what the group already uses (v2 ``memory.max`` /
  ``memory.current``, v1 ``memory.limit_in_bytes`` / ``memory.usage_in_bytes``: the launcher is in
  it), else the host's ``MemAvailable``.
- The process baseline of a local run: a launcher, multiprocessing's forkserver (which imports torch
  and the application once) and one worker per rank forked from it.  The cgroup charges a page once,
  however many processes map it, so the job's baseline is not ranks x one process's resident size:
  the forkserver's image once (this process's own anonymous memory, read now, plus what the server
  preloads beyond it), each worker's own pages beyond that image, and what the launcher and rank 0
  add after the check.  Those sizes belong to the application that runs in the processes: it passes
  them as :class:`ProcessSizes`, measured by its own bench.  A process started by torchrun (no
  forkserver) imports everything itself: each other local rank is a whole image.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def memory_group() -> tuple[Path, str] | None:
    """This process's memory cgroup directory and its version ("v1" or "v2"), None where there is none."""
    for line in (_read(Path("/proc/self/cgroup")) or "").splitlines():
        _, controllers, rel = line.split(":", 2)
        rel = rel.lstrip("/")
        if controllers == "" and (Path("/sys/fs/cgroup") / rel / "memory.max").exists():  # v2
            return Path("/sys/fs/cgroup") / rel, "v2"
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / rel, "v1"
    return None


def _limit_usage(group: tuple[Path, str]) -> tuple[int | None, int | None]:
    base, version = group
    names = ("memory.max", "memory.current") if version == "v2" else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    limit, usage = (_read(base / n) for n in names)
    limit_n = int(limit) if limit and limit != "max" and int(limit) < 2**60 else None
    return limit_n, int(usage) if usage is not None and usage.isdigit() else None


def cgroup_room() -> tuple[int, str] | None:
    """(bytes left under this process's memory cgroup limit, where it was read), None without a limit."""
    group = memory_group()
    if group is None:
        return None
    limit, usage = _limit_usage(group)
    if limit is None or usage is None:
        return None
    return limit - usage, f"memory cgroup {group[0]} (limit {limit / 2**30:.2f} GiB)"


def mem_available() -> int | None:
    """The host's ``MemAvailable`` in bytes, None where /proc/meminfo lacks it."""
    for line in (_read(Path("/proc/meminfo")) or "").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def room() -> tuple[int, str] | None:
    """The memory the workers will have: the cgroup's room, or the host's available memory."""
    found = cgroup_room()
    if found is not None:
        return found
    avail = mem_available()
    return None if avail is None else (avail, "MemAvailable")


def rollup(pid: int | str = "self") -> dict[str, int]:
    """``/proc/PID/smaps_rollup`` in bytes (Rss, Pss, Private_Dirty, Anonymous, ...); {} where absent."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            out[key] = int(fields[0]) * 1024
    return out


def own_image() -> int:
    """This process's anonymous memory now (what a process with the same imports holds of its own)."""
    roll = rollup()
    if "Anonymous" in roll:
        return roll["Anonymous"]
    try:  # no smaps_rollup (old kernels): the resident size, an over-count by the shared libraries
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass(frozen=True)
class ProcessSizes:
    """An application's process sizes beyond what :func:`own_image` reads at its check, in bytes."""

    server_imports: int  # the forkserver's preloads that the launcher lacks at its check
    worker_own: int  # a forked worker's own pages before training
    rank0_extra: int  # what rank 0 alone adds (its logger's imports)
    launcher_after: int  # the launcher's growth after the check (its input checks), trimmed


@dataclass(frozen=True)
class JobBaseline:
    """The baseline of a run's processes beyond what the room already excludes: ``per_rank`` in each
    rank's working set, ``shared`` (by name) once for the whole host."""

    per_rank: int
    shared: dict[str, int]

    @property
    def shared_total(self) -> int:
        return sum(self.shared.values())


def job_baseline(nproc: int, sizes: ProcessSizes, *, forked: bool = True, image: int | None = None) -> JobBaseline:
    """The baseline of ``nproc`` local ranks, read in the launcher at its check (``image``: that
    process's own memory, measured now when None).  ``forked``: workers fork from a forkserver that
    this launcher starts; else (torchrun, one inline rank) this process is one rank, in the room
    already, and each other local rank imports its own."""
    image = own_image() if image is None else image
    if forked:
        return JobBaseline(per_rank=sizes.worker_own, shared={"forkserver image": image + sizes.server_imports,
                                                              "launcher after checks": sizes.launcher_after,
                                                              "rank 0 logger": sizes.rank0_extra})
    others = max(nproc - 1, 0)  # this rank also grows as the launcher does after the check (its inputs)
    return JobBaseline(per_rank=0, shared={"this rank after the check": sizes.launcher_after,
                                           "other local ranks' images": others * image})


PAGE = 4096
PTE_BYTES = 8  # x86-64 and arm64: one 8-byte entry per 4 KiB page in the last level of the page tables


def page_table_bytes(resident: int) -> int:
    """The kernel's page tables for ``resident`` bytes a process maps in 4 KiB pages: 1/512 of them (the
    upper levels add a 512th of that).  A memory cgroup v1 with kernel accounting charges them to the
    group, so they count against its limit (bench/bench_memory_table.py: 2.7 MiB for a TinyLlama-shape
    rank's 1.3 GiB, the gap between its estimate and its peak); the per-worker baseline, measured on a
    tiny run, holds only its own."""
    return -(-resident // PAGE) * PTE_BYTES


OOM_SCORE_ADJ = 500  # added to each worker's: the kernel's OOM killer takes a worker, never the launcher


def raise_oom_score(adj: int = OOM_SCORE_ADJ) -> None:
    """Make this process (a worker) the OOM killer's choice before its launcher, which must live to say
    why its worker died; raising one's own score needs no privilege."""
    try:
        with open("/proc/self/oom_score_adj", "r+") as f:
            now = int(f.read().strip() or 0)
            f.seek(0)
            f.write(str(min(1000, max(now, now + adj))))
    except (OSError, ValueError):
        pass


def _oom_kills(group: tuple[Path, str]) -> int | None:
    """How many processes the group's OOM killer has killed (v1 ``memory.oom_control``, v2 ``memory.events``)."""
    base, version = group
    text = _read(base / ("memory.events" if version == "v2" else "memory.oom_control")) or ""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def _peak(group: tuple[Path, str]) -> int | None:
    value = _read(group[0] / ("memory.peak" if group[1] == "v2" else "memory.max_usage_in_bytes"))
    return int(value) if value and value.isdigit() else None


class OomWatch:
    """Whether a worker killed by SIGKILL was killed for memory: the memory cgroup's OOM-kill count grew
    since the launch (or, where the kernel keeps no count, the group's peak usage reached its limit).
    Read at the start of a launch and when a worker died."""

    def __init__(self) -> None:
        self.group = memory_group()
        self.before = _oom_kills(self.group) if self.group else None

    def limit(self) -> int | None:
        """The group's memory limit in bytes, None without one."""
        return _limit_usage(self.group)[0] if self.group else None

    def explains(self, error_type: str) -> bool:
        """Whether a worker that died of ``error_type`` (a signal's name) was killed for memory."""
        return error_type == "SIGKILL" and self.fired()

    def fired(self) -> bool:
        if self.group is None or self.limit() is None:
            return False  # without a limit the host's OOM killer decides, and leaves no count of ours
        if self.before is not None:
            after = _oom_kills(self.group)
            return after is not None and after > self.before
        peak = _peak(self.group)
        return peak is not None and peak >= 0.98 * self.limit()
