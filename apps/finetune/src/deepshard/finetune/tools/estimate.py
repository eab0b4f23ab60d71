"""``python -m deepshard.finetune.tools.estimate [overrides]``: per-rank memory for model states, before a run.

Like DeepSpeed's ``estimate_zero2_model_states_mem_needs_all_live`` / ``..._zero3_...``, but for our
layouts (core's ``memory.expected_bytes``, the README's ZeRO table) and the app's own overrides:
``model=small``, ``precision=bf16``, ``launcher.nproc_per_node=8``, ``parallel.tp=2``, ``+offload=cpu``.
Parameters are counted on the meta device (no memory, any size).  The table of model states is
followed by the run's whole working set (activations for data.seq_len under parallel.sp, ac,
ac_offload and model.mlp_tiles included).  ``--fit-memory 2GiB`` prints instead the largest
``data.seq_len`` (a multiple of parallel.sp) whose working set fits that much per rank.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the estimates import torch; --help and a bad argument need none of it
    from deepshard.core.memory import Residence

OFFLOADS = ("none", "cpu", "nvme")


def options(r: Residence) -> str:
    """The app's overrides that choose this residence."""
    out = f"+zero=stage{r.stage}"
    if r.offload != "none":
        out += f" +offload={r.offload}"
    params = {True: "cpu", False: "none"}.get(r.offload_params, r.offload_params)
    return out + (f" offload.params={params}" if params != "none" else "")


def all_estimates(num_params: int, *, dp: int, dtype: str, nvme_buffer_bytes: int = 0,
                  frozen_params: int = 0, param_buffer_bytes: int = 0, experts: int = 0, ep: int = 1) -> list[Residence]:
    """Every stage x offload choice (optimizer offload needs stage >= 1, parameter offload stage 3);
    ``experts``: this rank's expert parameters under ``parallel.ep`` (in ``num_params``, sharded over dp / ep)."""
    from deepshard.core.memory import residence

    out = []
    for stage in range(4):
        for offload in OFFLOADS:
            if offload != "none" and stage == 0:
                continue
            choices: tuple = (False, True) if stage == 3 and offload != "none" else (False,)
            for params in choices + (("nvme",) if stage == 3 and offload == "nvme" else ()):
                out.append(residence(num_params, stage=stage, dp=dp, dtype=dtype, offload=offload,
                                     offload_params=params, nvme_buffer_bytes=nvme_buffer_bytes,
                                     frozen_params=frozen_params, param_buffer_bytes=param_buffer_bytes,
                                     experts=experts, ep=ep))
    return out


def conf_dir() -> Path:
    """The repository's conf/ (next to apps/), or ./conf."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "conf" / "config.yaml").exists():
            return parent / "conf"
    return Path.cwd() / "conf"


def compose(overrides: list[str]) -> dict:
    """The app's config for these overrides, composed exactly as main.py would (with ``+deepspeed=``)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from deepshard.finetune.config import register
    from deepshard.finetune.config.ds_config import merge_argv

    register()
    overrides = merge_argv(["estimate", *overrides])[0][1:]
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True)


def _fmt(n: int) -> str:
    for unit, size in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n}B"


def report(cfg: dict) -> tuple[str, list[Residence], int, int]:
    """The printed table, the estimates, the parameter count per rank and the dp size."""
    from deepshard.finetune.config import validate
    from deepshard.finetune.models.memory_plan import count_frozen, count_params, offload_buffers

    settings = validate(cfg)
    world, dims = settings.world_size, settings.parallel
    total = count_params(settings.model, settings.peft)
    frozen = count_frozen(settings.model, settings.peft)
    per_rank = total // (dims.tp * dims.pp)
    dtype = settings.engine.precision.dtype
    buffers = settings.offload.buffer_count * settings.offload.buffer_size * 16
    off = settings.offload  # params=nvme: the pools are sized by the largest unit (a block or the root)
    param_buffers = offload_buffers(settings.model, dataclasses.replace(off, params="nvme"), world=dims.dp).peak
    experts, ep = 0, getattr(dims, "ep", 1)
    if ep > 1:  # one rank's num_experts / ep experts, ZeRO over the dp / ep ranks left
        from deepshard.finetune.models.memory_plan import model_counts

        counts = model_counts(settings.model, world=dims.dp, ep=ep)
        per_rank, experts = counts.num_params, counts.experts
    rows = all_estimates(per_rank, dp=dims.dp, dtype=dtype, nvme_buffer_bytes=buffers, frozen_params=frozen,
                         param_buffer_bytes=param_buffers, experts=experts, ep=ep)
    lines = [f"Estimated memory for model states (params, grads, fp32 master + Adam) per rank: "
             f"{(total + frozen) / 1e6:.2f}M params ({settings.model_name}), world size {world} "
             f"(dp={dims.dp}, tp={dims.tp}, pp={dims.pp}{f', ep={ep}' if ep > 1 else ''}), {dtype}"
             + (f"; LoRA r={settings.peft.r}: {total / 1e6:.3f}M trainable (grads + Adam state), "
                f"{frozen / 1e6:.2f}M frozen base (params only)" if settings.peft else ""),
             f"{'device':>10} {'host':>10} {'nvme':>10}   options"]
    lines += [f"{_fmt(r.device):>10} {_fmt(r.host):>10} {_fmt(r.nvme):>10}   {options(r)}" for r in rows]
    lines.append("(model states only; the working set of this run's own layout follows)")
    lines += working_set_lines(settings)
    return "\n".join(lines), rows, per_rank, dims.dp


def working_set_lines(settings) -> list[str]:
    """One rank's whole working set for the composed layout: host and device columns by part."""
    from deepshard.finetune.models.working_set import run_shape, working_set_of
    from deepshard.finetune.preflight import job_baseline

    shape = run_shape(settings)
    base = job_baseline(settings.world_size, forked=settings.world_size > 1)  # as the app's preflight reads it
    ws = working_set_of(settings, baseline=base.per_rank, shape=shape)
    out = [f"Working set per rank for this run ({'device: the accelerator' if shape.on_device else 'host = device: RAM'}):",
           f"{'host':>10} {'device':>10}   part"]
    out += [f"{_fmt(ws.host.get(k, 0)):>10} {_fmt(ws.device.get(k, 0)):>10}   {k}" for k in {**ws.host, **ws.device}]
    out.append(f"{_fmt(ws.host_total):>10} {_fmt(ws.device_total):>10}   total"
               + ("" if shape.on_device else f" ({_fmt(ws.ram(False))} of RAM per rank)"))
    if shape.loads_checkpoint:
        from deepshard.finetune.models.working_set import counts_of, load_peak

        kept, read = load_peak(counts_of(settings, shape), shape)
        out.append(f"Loading model.path: about {_fmt(kept + read)} per rank above the baseline at its peak "
                   f"({_fmt(kept)} of parameters kept + {_fmt(read)}: its slice of the largest tensor, read one at a time)")
    return out + shared_lines(base, settings.world_size, ws.ram(shape.on_device))


def shared_lines(base, nproc: int, per_rank: int) -> list[str]:
    """What a local run's processes hold once for the host (launch's ``memory.JobBaseline``), and the host's total."""
    out = [f"Once for the host's {nproc} local rank(s) (the app's own process is not counted: it is in the "
           "memory's usage when the app checks):"]
    out += [f"{_fmt(v):>10} {'':>10}   {k}" for k, v in base.shared.items() if v]
    out.append(f"{_fmt(nproc * per_rank + base.shared_total):>10} {'':>10}   host total ({nproc} x per rank + once)")
    return out


_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tb": 2**40, "tib": 2**40}


def parse_size(text: str) -> int:
    """``2GiB``, ``1536MB``, ``2e9``: bytes (KB/MB/GB are binary here, as the table prints them)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"--fit-memory={text}: not a memory size; give bytes or a number with KiB/MiB/GiB/TiB "
                         "(e.g. --fit-memory 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def fit_seq_len(settings, memory: int) -> tuple[int, int]:
    """The largest ``data.seq_len`` (a multiple of parallel.sp, at least sp x model.mlp_tiles) whose
    working set fits ``memory`` per rank, and that working set's size; (0, size at the smallest) when
    none does.  Counted against the device column on an accelerator, else the RAM (host + device);
    each rank carries its share of the processes' once-per-host baseline (``preflight.job_baseline``)."""
    from deepshard.finetune.models.working_set import run_shape, working_set_of
    from deepshard.finetune.preflight import job_baseline

    nproc = settings.world_size  # the ranks of one host, as the app starts them: each its share of the once-items
    job = job_baseline(nproc)
    shape, base = run_shape(settings), job.per_rank + job.shared_total // nproc
    sp = shape.sp

    def need(k: int) -> int:  # seq_len = k x sp: each rank holds k tokens of a row
        ws = working_set_of(settings, baseline=base, shape=dataclasses.replace(shape, seq_len=k))
        return ws.device_total if shape.on_device else ws.ram(False)

    lo = max(1, shape.mlp_tiles)
    if need(lo) > memory:
        return 0, need(lo)
    hi = lo
    while hi < 2**31 and need(hi * 2) <= memory:
        hi *= 2
    top = hi * 2  # need(top) > memory (or the cap)
    while top - hi > 1:
        mid = (hi + top) // 2
        hi, top = (mid, top) if need(mid) <= memory else (hi, mid)
    return hi * sp, need(hi)


def fit_line(cfg: dict, memory: int) -> str:
    """The one line ``--fit-memory`` prints."""
    from deepshard.finetune.config import validate
    from deepshard.finetune.models.working_set import run_shape

    settings = validate(cfg)
    shape = run_shape(settings)
    where = "device memory" if shape.on_device else "RAM (host + device)"
    seq, size = fit_seq_len(settings, memory)
    layout = (f"parallel.sp={shape.sp}, train.micro_batch_size={shape.micro_batch_size}, ac={shape.ac}"
              f"{' ac_offload=true' if shape.ac_offload else ''}, model.mlp_tiles={shape.mlp_tiles}")
    if not seq:
        return (f"nothing fits {_fmt(memory)} of {where} per rank ({layout}): the shortest seq_len already "
                f"needs {_fmt(size)}")
    line = (f"largest data.seq_len that fits {_fmt(memory)} of {where} per rank: {seq} "
            f"({seq // shape.sp} tokens per rank; {layout}; working set {_fmt(size)})")
    if seq > settings.model.max_seq_len:
        line += f"; raise model.max_seq_len={settings.model.max_seq_len} to use it"
    return line


def main(argv: list[str] | None = None, *, prog: str = "python -m deepshard.finetune.tools.estimate") -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(f"usage: {prog} [--fit-memory SIZE] [overrides ...]\n\n{__doc__.split(': ', 1)[1]}", end="")
        return 0
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from deepshard.finetune.config.hydra_errors import error_line

    memory = None
    try:
        for i, a in enumerate(args):
            if a == "--fit-memory" or a.startswith("--fit-memory="):
                if "=" not in a and i + 1 >= len(args):
                    raise ValueError("--fit-memory needs a size (e.g. --fit-memory 2GiB)")
                memory = parse_size(a.split("=", 1)[1] if "=" in a else args[i + 1])
                del args[i:i + (1 if "=" in a else 2)]
                break
        cfg = compose(args)
        text = fit_line(cfg, memory) if memory is not None else report(cfg)[0]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (HydraException, OmegaConfBaseException) as e:  # a bad override: Hydra's refusal as the app's one line
        print(f"error: {error_line(e, [prog, *args])}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
