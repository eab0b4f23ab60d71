"""Before any worker starts: will the run fit in the memory its workers will have?  The policy only:
which values to pick where the user left them out, and when to refuse or warn.

The working set of one rank (``models/working_set.py``, adding up what core, offload and the model
family state of their own memory) times the ranks on this host, plus what the job's processes
share once (launch's ``memory.job_baseline``: the forkserver's image, the launcher's growth after
this check), is compared with the memory they will have (launch's ``memory.room``: the memory
cgroup's limit less its usage, else ``MemAvailable``).  A run that cannot fit is refused with one
line naming the estimate, the limit and the knobs that would make it fit; one within 10% of the
limit gets one warning line.  Values the user gave are never changed: only ``ac=auto`` and the
offload keys left out (``Settings.offload_picks``) are picked, and the settings returned have
nothing left to pick.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING

from deepshard.finetune.models.memory_plan import ModelCounts
from deepshard.finetune.models.working_set import RunShape, counts_of, run_shape, working_set_of
from deepshard.launch import memory
from deepshard.launch.memory import JobBaseline, ProcessSizes, room

if TYPE_CHECKING:
    from deepshard.finetune.config import Settings

CLOSE = 0.9  # above this share of the limit: one warning line
MiB = 2**20
# The app's processes beyond what the launcher holds at this check, measured by
# bench/bench_process_baseline.py (per process Private_Dirty from /proc/PID/smaps_rollup, default tiny
# run, 2 workers, CPU; tests/offload/test_process_baseline.py holds them against a real cgroup): they do
# not grow with the model, whose bytes the working set's other lines count.
APP_PROCESSES = ProcessSizes(
    server_imports=48 * MiB,  # dynamo, DTensor, the tokenizer's transformers modules (server 251 MiB
    # anonymous, a fresh launcher-like process 202 MiB)
    worker_own=32 * MiB,  # measured 22-30 MiB at the gc-frozen server
    rank0_extra=20 * MiB,  # tensorboard's SummaryWriter and its imports (measured 18 MiB)
    launcher_after=64 * MiB)  # the launcher through check_inputs/check_data_fits, trimmed (measured 56 MiB)


def job_baseline(nproc: int, *, forked: bool = True, image: int | None = None) -> JobBaseline:
    """The app's processes for ``nproc`` local ranks (launch's ``job_baseline`` with :data:`APP_PROCESSES`)."""
    return memory.job_baseline(nproc, APP_PROCESSES, forked=forked, image=image)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _need(s: Settings, nproc: int, base: JobBaseline, counts: ModelCounts | None = None,
          shape: RunShape | None = None) -> int:
    shape = shape or run_shape(s)
    ws = working_set_of(s, baseline=base.per_rank, shape=shape, counts=counts)
    return nproc * ws.ram(shape.on_device) + base.shared_total


def check_memory(s: Settings, nproc: int, base: JobBaseline | None = None,
                 counts: ModelCounts | None = None) -> str | None:
    """ValueError (one line) when ``nproc`` ranks of ``s`` cannot fit in the memory they will have;
    the warning line when they come close; None otherwise.  Each rank counts a worker's own pages,
    the job once what its processes share (``base``: :func:`job_baseline`, read now)."""
    base = base or job_baseline(nproc)
    shape = run_shape(s)
    ws = working_set_of(s, baseline=base.per_rank, shape=shape, counts=counts)
    per_rank = ws.ram(shape.on_device)
    need = nproc * per_rank + base.shared_total
    have = room()
    if have is None:
        return None
    limit, where = have
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in {**ws.host, **ws.device}.items() if v)
    shared = ", ".join(f"{k} {_gib(v)}" for k, v in base.shared.items() if v)
    parts += f"; once: {shared}" if shared else ""
    if need > limit:
        raise ValueError(f"memory: this run needs about {_gib(need)} ({nproc} rank(s) x {_gib(per_rank)}: {parts}) "
                         f"but {where} leaves {_gib(limit)}; to fit, try: {'; '.join(knobs_to_fit(shape))}")
    if need > CLOSE * limit:
        return (f"warning: memory: this run needs about {_gib(need)} of the {_gib(limit)} {where} leaves "
                f"({need / limit:.0%}); peaks above the estimate may be OOM-killed")
    return None


def knobs_to_fit(s: RunShape) -> list[str]:
    """The settings that shrink the working set, in the order worth trying."""
    out, o = [], s.offload
    if s.stage < 3:
        out.append("+zero=stage3")
    if o.device == "none":
        out.append("+offload=cpu (or +offload=nvme offload.params=nvme)")
    elif o.params != "nvme" and o.device == "nvme":
        out.append("offload.params=nvme")
    if o.params == "nvme" and (o.buffer_count > 1 or o.param_buffer_count > 2):
        out.append("offload.buffer_count=1 offload.param_buffer_count=2 offload.param_prefetch=1")
    if o.params == "nvme" and min(o.sub_group_size, o.buffer_size) > 2**22:
        out.append("offload.sub_group_size=4194304 (the deferred update's pieces: 16 B x that per buffer)")
    if s.ac == "none":
        out.append("ac=full")
    if s.micro_batch_size > 1:
        out.append(f"train.micro_batch_size={s.micro_batch_size // 2} (with train.grad_accum x2)")
    out.append("fewer ranks per host (launcher.nproc_per_node)")
    return out


# offload.params=nvme's buffers, most first: (buffer_count, param_buffer_count, param_prefetch,
# sub_group_size): the last, the deferred update's piece in elements, None where it stays as set
BUFFER_CHOICES = ((3, 4, 2, None), (2, 3, 2, None), (2, 3, 1, None), (2, 3, 1, 2**22), (1, 3, 2, 2**22),
                  (1, 2, 1, 2**22), (1, 2, 1, 2**21))
_CHOICE_KEYS = ("buffer_count", "param_buffer_count", "param_prefetch", "sub_group_size")


def with_buffers(s: Settings, choice: tuple[int, int, int, int | None]) -> Settings:
    """``s`` with one of :data:`BUFFER_CHOICES`, for the keys the user left out only."""
    changes = {k: v for k, v in zip(_CHOICE_KEYS, choice) if v is not None and k in s.offload_picks}
    return dataclasses.replace(s, offload=dataclasses.replace(s.offload, **changes))


def fit_buffers(s: Settings, nproc: int, base: JobBaseline | None = None,
                counts: ModelCounts | None = None) -> tuple[Settings, str | None]:
    """ZeRO-Infinity's buffers chosen for the memory the run has, where the user left them out: the
    most buffers that fit, then smaller pieces for the deferred update (``sub_group_size``: the same
    bytes move, in more requests); the choice said in one line.  Given values are kept (and refused
    by :func:`check_memory` if they cannot fit)."""
    if s.offload.params != "nvme" or not set(_CHOICE_KEYS) & set(s.offload_picks):
        return s, None
    have = room()
    if have is None:
        return s, None
    base = base or job_baseline(nproc)
    for i, choice in enumerate(BUFFER_CHOICES):
        tried = with_buffers(s, choice)
        need = _need(tried, nproc, base, counts)
        if i == len(BUFFER_CHOICES) - 1 and need > CLOSE * have[0]:
            return tried, None  # the smallest buffers; check_memory says the rest (refused or close)
        if need <= CLOSE * have[0]:
            o = tried.offload
            picked = " ".join(f"offload.{k}={getattr(o, k)}" for k in _CHOICE_KEYS[:3] if k in s.offload_picks)
            if o.sub_group_size != s.offload.sub_group_size:
                picked += f" offload.sub_group_size={o.sub_group_size}"
            line = None if i == 0 else (f"offload: picked {picked.strip()} for the {_gib(have[0])} {have[1]} "
                                        f"leaves (about {_gib(need)} needed); set them to override")
            return tried, line
    return s, None  # not reached


def fit_ac(s: Settings, nproc: int, base: JobBaseline | None = None,
           counts: ModelCounts | None = None) -> tuple[Settings, str | None]:
    """``ac=auto``: activation checkpointing of every block where the run fits only with it.

    Without it a block keeps all its activations until backward (at 1536 wide and 1024 tokens a
    rank, 14 blocks hold 1.5 GiB); with ``ac=full`` only each block's input is kept and one block is
    recomputed at a time: the same gradients, about a third more compute.  Judged with the smallest
    offload buffers the run may pick (:func:`fit_buffers` then chooses among those that fit)."""
    if not s.ac_auto:
        return s, None
    have = room()
    if have is None:
        return s, None
    base = base or job_baseline(nproc)
    smallest = with_buffers(s, BUFFER_CHOICES[-1]) if s.offload.params == "nvme" else s
    without = _need(smallest, nproc, base, counts)
    if without <= CLOSE * have[0]:
        return s, None
    full = dataclasses.replace(s, engine=dataclasses.replace(s.engine, ac="full"))
    with_full = _need(dataclasses.replace(smallest, engine=full.engine), nproc, base, counts)
    if with_full > have[0]:  # it would not fit either: check_memory refuses, naming every knob
        return s, None
    return full, (f"memory: picked ac=full (every block's activations recomputed in backward) for the "
                  f"{_gib(have[0])} {have[1]} leaves: about {_gib(with_full)} needed with it, {_gib(without)} "
                  "without; set ac=none (or full, every_2) to override")


def preflight_memory(s: Settings, nproc: int, *, forked: bool = True) -> Settings:
    """The app's check before starting workers: activation checkpointing and the buffers chosen,
    then refuse (ValueError) or warn on stderr; returns the settings the workers get, with nothing
    left to pick.  ``forked``: the workers will fork from this launcher's forkserver (else this
    process is one of the ranks)."""
    return plan_memory(s, nproc, forked=forked)[0]


def plan_memory(s: Settings, nproc: int, *, forked: bool = True) -> tuple[Settings, int]:
    """:func:`preflight_memory`, and the estimate it judged (bytes of the host's ranks and the job's
    processes), which a worker killed for memory is reported against."""
    base = job_baseline(nproc, forked=forked)  # read once, before the checks import more
    counts = counts_of(s, run_shape(s))  # the model's counts: ac and buffers change none of them
    s, picked_ac = fit_ac(s, nproc, base, counts)
    if picked_ac:
        print(picked_ac, file=sys.stderr)
    s, picked = fit_buffers(s, nproc, base, counts)
    if picked:
        print(picked, file=sys.stderr)
    line = check_memory(s, nproc, base, counts)
    if line:
        print(line, file=sys.stderr)
    return dataclasses.replace(s, offload_picks=()), _need(s, nproc, base, counts)


def killed_for_memory(line: str, s: Settings, estimate: int, limit: int | None) -> str:
    """The launcher's "rank R was killed for memory at step S" with the estimate, the limit it met and
    the knobs that shrink the working set."""
    met = _gib(limit) if limit is not None else "the host's memory"
    return f"{line} (estimate {_gib(estimate)}, limit {met}; try {'; '.join(knobs_to_fit(run_shape(s)))})"
