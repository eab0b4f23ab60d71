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


def cgroup_room() -> tuple[int, str] | None:
    """(bytes left under this process's memory cgroup limit, where it was read), None without a limit."""
    for line in (_read(Path("/proc/self/cgroup")) or "").splitlines():
        _, controllers, rel = line.split(":", 2)
        rel = rel.lstrip("/")
        if controllers == "":  # v2
            base = Path("/sys/fs/cgroup") / rel
            limit, usage = _read(base / "memory.max"), _read(base / "memory.current")
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / rel
            limit, usage = _read(base / "memory.limit_in_bytes"), _read(base / "memory.usage_in_bytes")
        else:
            continue
        if limit and limit != "max" and usage is not None and int(limit) < 2**60:
            return int(limit) - int(usage), f"memory cgroup {base} (limit {int(limit) / 2**30:.2f} GiB)"
    return None


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
