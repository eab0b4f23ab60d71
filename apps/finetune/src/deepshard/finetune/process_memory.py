"""The memory a run's processes hold before training, as the preflight counts it against the room.

A local run is a launcher, multiprocessing's forkserver (it imports torch and the app once) and one
worker per rank forked from it.  The memory cgroup charges a page once, however many processes
map it, so the job's baseline is not ranks x one process's resident size:

- the launcher: already in the group's usage when the preflight reads the room; it grows only by
  what its input checks load afterwards (the tokenizer's library, the tokenized documents), which
  it trims before it waits (``app``, ``trim_heap``): ``launcher after checks``;
- the forkserver's image, once: the workers share it copy-on-write.  It imports what this process
  has imported by the preflight (torch and the app) and a few modules more, so this process's own
  anonymous memory plus those modules' is its measure (``forkserver image``);
- each worker's own pages beyond that image (gloo's buffers and threads, its stacks and heap, the
  pages its first writes copy): ``process baseline``, per rank; rank 0 adds its TensorBoard writer's
  imports (``rank 0 logger``).

The constants were measured by ``bench/bench_process_baseline.py`` (per process ``Private_Dirty`` from
``/proc/PID/smaps_rollup``, default tiny run, 2 workers, CPU): they do not grow with the model,
whose bytes the working set's other lines count.  A process started by torchrun (no forkserver)
imports everything itself: each other local rank is a whole image.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20
SERVER_IMPORTS = 48 * MiB  # the server's preloads the launcher lacks at its preflight: dynamo, DTensor, the
# tokenizer's transformers modules (measured: server 251 MiB anonymous, a fresh launcher-like process 202 MiB)
WORKER_OWN = 32 * MiB  # a worker's own pages before training (measured 22-30 MiB at the gc-frozen server)
RANK0_LOGGER = 20 * MiB  # tensorboard's SummaryWriter and its imports, on rank 0 only (measured 18 MiB)
LAUNCHER_CHECKS = 64 * MiB  # the launcher's growth through check_inputs/check_data_fits, trimmed (measured 56 MiB)


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
class JobBaseline:
    """The baseline of a run's processes beyond what the room already excludes: ``per_rank`` in each
    rank's working set, ``shared`` (by name) once for the whole host."""

    per_rank: int
    shared: dict[str, int]

    @property
    def shared_total(self) -> int:
        return sum(self.shared.values())


def job_baseline(nproc: int, *, forked: bool = True, image: int | None = None) -> JobBaseline:
    """The baseline of ``nproc`` local ranks, read in the launcher at its preflight (torch and the app
    imported; ``image``: that process's own memory, measured now when None).  ``forked``: workers fork
    from a forkserver that this launcher starts (the app's local launch); else (torchrun, one inline
    rank) this process is one rank, in the room already, and each other local rank imports its own."""
    image = own_image() if image is None else image
    if forked:
        return JobBaseline(per_rank=WORKER_OWN, shared={"forkserver image": image + SERVER_IMPORTS,
                                                        "launcher after checks": LAUNCHER_CHECKS,
                                                        "rank 0 logger": RANK0_LOGGER})
    others = max(nproc - 1, 0)  # this rank also loads the tokenizer and its data after the check
    return JobBaseline(per_rank=0, shared={"this rank's tokenizer and data": LAUNCHER_CHECKS,
                                           "other local ranks' images": others * image})
