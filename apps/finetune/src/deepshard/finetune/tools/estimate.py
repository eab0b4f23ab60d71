"""``python -m deepshard.finetune.tools.estimate [overrides]``: per-rank memory for model states, before a run.

Like DeepSpeed's ``estimate_zero2_model_states_mem_needs_all_live`` / ``..._zero3_...``, but for our
layouts (core's ``memory.expected_bytes``, the README's ZeRO table) and the app's own overrides:
``model=small``, ``precision=bf16``, ``launcher.nproc_per_node=8``, ``parallel.tp=2``, ``+offload=cpu``.
Parameters are counted on the meta device (no memory, any size).  Activations and temporary
buffers (gathered ZeRO-3 blocks, communication buckets) are not model states and not counted.
"""

from __future__ import annotations

import sys
from pathlib import Path

from deepshard.finetune.models.memory_plan import (
    Estimate,
    all_estimates,
    count_frozen,
    count_params,
    infinity_buffers,
)


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


def report(cfg: dict) -> tuple[str, list[Estimate], int, int]:
    """The printed table, the estimates, the parameter count per rank and the dp size."""
    from deepshard.finetune.config import validate

    settings = validate(cfg)
    world, dims = settings.world_size, settings.parallel
    total = count_params(settings.model, settings.peft)
    frozen = count_frozen(settings.model, settings.peft)
    per_rank = total // (dims.tp * dims.pp)
    dtype = settings.engine.precision.dtype
    buffers = settings.offload.buffer_count * settings.offload.buffer_size * 16
    off = settings.offload  # params=nvme: the pools are sized by the largest unit (a block or the root)
    param_buffers = infinity_buffers(settings.model, world=dims.dp, param_buffer_count=off.param_buffer_count,
                                     buffer_count=off.buffer_count).peak
    rows = all_estimates(per_rank, dp=dims.dp, dtype=dtype, nvme_buffer_bytes=buffers, frozen_params=frozen,
                         param_buffer_bytes=param_buffers)
    lines = [f"Estimated memory for model states (params, grads, fp32 master + Adam) per rank: "
             f"{(total + frozen) / 1e6:.2f}M params ({settings.model_name}), world size {world} "
             f"(dp={dims.dp}, tp={dims.tp}, pp={dims.pp}), {dtype}"
             + (f"; LoRA r={settings.peft.r}: {total / 1e6:.3f}M trainable (grads + Adam state), "
                f"{frozen / 1e6:.2f}M frozen base (params only)" if settings.peft else ""),
             f"{'device':>10} {'host':>10} {'nvme':>10}   options"]
    lines += [f"{_fmt(r.device):>10} {_fmt(r.host):>10} {_fmt(r.nvme):>10}   {r.options}" for r in rows]
    lines.append("(model states only; the working set of this run's own layout follows)")
    lines += working_set_lines(settings)
    return "\n".join(lines), rows, per_rank, dims.dp


def working_set_lines(settings) -> list[str]:
    """One rank's whole working set for the composed layout: host and device columns by part."""
    from deepshard.finetune.preflight import run_shape, working_set_of

    shape = run_shape(settings)
    ws = working_set_of(settings, shape=shape)
    out = [f"Working set per rank for this run ({'device: the accelerator' if shape.on_device else 'host = device: RAM'}):",
           f"{'host':>10} {'device':>10}   part"]
    out += [f"{_fmt(ws.host.get(k, 0)):>10} {_fmt(ws.device.get(k, 0)):>10}   {k}" for k in {**ws.host, **ws.device}]
    out.append(f"{_fmt(ws.host_total):>10} {_fmt(ws.device_total):>10}   total"
               + ("" if shape.on_device else f" ({_fmt(ws.ram(False))} of RAM per rank)"))
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        text, *_ = report(compose(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
