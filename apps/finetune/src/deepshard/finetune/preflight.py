"""Before any worker starts: will the run fit in the memory its workers will have?

The working set of one rank (``models/working_set.py``: model states, swap buffers, gathered units,
activations, the worker's own pages) times the ranks on this host, plus what the job's processes
share once (``process_memory``: the forkserver's image, the launcher's growth after this check), is
compared with the memory they will have: the memory cgroup's limit less what the group already uses
(v2 ``memory.max``, v1 ``memory.limit_in_bytes``: this launcher is in it), else the host's
``MemAvailable``.  A run that cannot fit is refused with
one line naming the estimate, the limit and the knobs that would make it fit; one within 10% of
the limit gets one warning line.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from deepshard.finetune.models.working_set import (
    RunShape,
    WorkingSet,
    knobs_to_fit,
    working_set,
)
from deepshard.finetune.process_memory import JobBaseline, job_baseline

if TYPE_CHECKING:
    from deepshard.finetune.config import Settings

CLOSE = 0.9  # above this share of the limit: one warning line


def run_shape(s: Settings) -> RunShape:
    """The settings the working set depends on."""
    import torch

    from deepshard.finetune.models.vocab_tiling import tile_rows

    e, o, par = s.engine, s.offload, s.parallel
    sp = getattr(par, "sp", 1)
    return RunShape(stage=e.zero.stage, dp=par.dp * sp, dtype=e.precision.dtype, offload=o.device, params=o.params,
                    buffer_count=o.buffer_count, buffer_size=o.buffer_size, sub_group_size=o.sub_group_size,
                    param_buffer_count=o.param_buffer_count, param_prefetch=o.param_prefetch,
                    micro_batch_size=s.train.micro_batch_size, seq_len=s.data.seq_len // sp, ac=e.ac,
                    prefetch=e.zero.prefetch, reduce_bucket_size=e.zero.reduce_bucket_size,
                    tile_rows=tile_rows(s.model, zero_stage=e.zero.stage, tp=par.tp, pp=par.pp, sp=sp),
                    on_device=torch.cuda.is_available(), sp=sp, mlp_tiles=s.model.mlp_tiles,
                    ac_offload=e.ac_offload)


def working_set_of(s: Settings, *, baseline: int | None = None, shape: RunShape | None = None) -> WorkingSet:
    """One rank's working set for these settings (``baseline`` None: a forked worker's own pages)."""
    from deepshard.finetune.models.memory_plan import count_frozen, count_params

    par = s.parallel
    num = count_params(s.model, s.peft) // (par.tp * par.pp)
    baseline = job_baseline(1, image=0).per_rank if baseline is None else baseline
    return working_set(s.model, num, shape or run_shape(s), baseline=baseline, frozen=count_frozen(s.model, s.peft))


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


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_memory(s: Settings, nproc: int, base: JobBaseline | None = None) -> str | None:
    """ValueError (one line) when ``nproc`` ranks of ``s`` cannot fit in the memory they will have;
    the warning line when they come close; None otherwise.  Each rank counts a worker's own pages,
    the job once what its processes share (``base``: ``process_memory.job_baseline``, read now)."""
    base = base or job_baseline(nproc)
    shape = run_shape(s)
    ws = working_set_of(s, baseline=base.per_rank, shape=shape)
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


# offload.params=nvme's buffers, most first: (buffer_count, param_buffer_count, param_prefetch,
# sub_group_size): the last, the deferred update's piece in elements, None where it stays as set
BUFFER_CHOICES = ((3, 4, 2, None), (2, 3, 2, None), (2, 3, 1, None), (2, 3, 1, 2**22), (1, 3, 2, 2**22),
                  (1, 2, 1, 2**22), (1, 2, 1, 2**21))
DEFAULT_PIECE = 2**24  # offload.sub_group_size's default (deepshard.offload.OffloadConfig)


def with_buffers(s: Settings, choice: tuple[int, int, int, int | None]) -> Settings:
    """``s`` with one of :data:`BUFFER_CHOICES` (a piece size only where ``sub_group_size`` was not given)."""
    count, pool, prefetch, piece = choice
    changes = dict(buffer_count=count, param_buffer_count=pool, param_prefetch=prefetch)
    if piece is not None and s.offload.sub_group_size == DEFAULT_PIECE:
        changes["sub_group_size"] = piece
    return with_offload(s, **changes)


def fit_buffers(s: Settings, nproc: int, base: JobBaseline | None = None) -> tuple[Settings, str | None]:
    """ZeRO-Infinity's buffers chosen for the memory the run has: where ``offload.buffer_count``,
    ``param_buffer_count`` and ``param_prefetch`` are at their defaults (taken as not given), the
    most buffers that fit, then smaller pieces for the deferred update (``sub_group_size``, where it
    too is at its default: the same bytes move, in more requests); the choice said in one line.
    Explicit values are kept (and refused by :func:`check_memory` if they cannot fit)."""
    if s.offload.params != "nvme" or not _buffers_as_default(s):
        return s, None
    have = room()
    if have is None:
        return s, None
    base = base or job_baseline(nproc)
    for i, choice in enumerate(BUFFER_CHOICES):
        tried = with_buffers(s, choice)
        need = _need(tried, nproc, base)
        if i == len(BUFFER_CHOICES) - 1 and need > CLOSE * have[0]:
            return tried, None  # the smallest buffers; check_memory says the rest (refused or close)
        if need <= CLOSE * have[0]:
            o = tried.offload
            piece = f" offload.sub_group_size={o.sub_group_size}" if o.sub_group_size != s.offload.sub_group_size else ""
            line = None if i == 0 else (
                f"offload: picked offload.buffer_count={o.buffer_count} offload.param_buffer_count="
                f"{o.param_buffer_count} offload.param_prefetch={o.param_prefetch}{piece} for the {_gib(have[0])} "
                f"{have[1]} leaves (about {_gib(need)} needed); set them to override")
            return tried, line
    return s, None  # not reached


def _need(s: Settings, nproc: int, base: JobBaseline) -> int:
    shape = run_shape(s)
    return nproc * working_set_of(s, baseline=base.per_rank, shape=shape).ram(shape.on_device) + base.shared_total


def fit_ac(s: Settings, nproc: int, base: JobBaseline | None = None) -> tuple[Settings, str | None]:
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
    smallest = s
    if s.offload.params == "nvme" and _buffers_as_default(s):
        smallest = with_buffers(s, BUFFER_CHOICES[-1])
    without = _need(smallest, nproc, base)
    if without <= CLOSE * have[0]:
        return s, None
    full = dataclasses.replace(s, engine=dataclasses.replace(s.engine, ac="full"))
    with_full = _need(dataclasses.replace(smallest, engine=full.engine), nproc, base)
    if with_full > have[0]:  # it would not fit either: check_memory refuses, naming every knob
        return s, None
    return full, (f"memory: picked ac=full (every block's activations recomputed in backward) for the "
                  f"{_gib(have[0])} {have[1]} leaves: about {_gib(with_full)} needed with it, {_gib(without)} "
                  "without; set ac=none (or full, every_2) to override")


def _buffers_as_default(s: Settings) -> bool:
    o = s.offload
    return (o.buffer_count, o.param_buffer_count, o.param_prefetch) == BUFFER_CHOICES[0][:3]


def preflight_memory(s: Settings, nproc: int, *, forked: bool = True) -> Settings:
    """The app's check before starting workers: activation checkpointing and the buffers chosen,
    then refuse (ValueError) or warn on stderr; returns the settings the workers get.  ``forked``:
    the workers will fork from this launcher's forkserver (else this process is one of the ranks)."""
    base = job_baseline(nproc, forked=forked)  # read once, before the checks import more
    s, picked_ac = fit_ac(s, nproc, base)
    if picked_ac:
        print(picked_ac, file=sys.stderr)
    s, picked = fit_buffers(s, nproc, base)
    if picked:
        print(picked, file=sys.stderr)
    line = check_memory(s, nproc, base)
    if line:
        print(line, file=sys.stderr)
    return s


def with_offload(s: Settings, **changes: int) -> Settings:
    """``s`` with some offload values replaced (the buffer choice tries candidates)."""
    return dataclasses.replace(s, offload=dataclasses.replace(s.offload, **changes))
