"""``python -m deepshard.finetune.estimate [overrides]``: per-rank memory for model states, before a run.

Like DeepSpeed's ``estimate_zero2_model_states_mem_needs_all_live`` / ``..._zero3_...``, but for our
layouts (core's ``memory.expected_bytes``, the README's ZeRO table) and the app's own overrides:
``model=small``, ``precision=bf16``, ``launcher.nproc_per_node=8``, ``parallel.tp=2``, ``+offload=cpu``.
Parameters are counted on the meta device (no memory, any size).  Activations and temporary
buffers (gathered ZeRO-3 blocks, communication buckets) are not model states and not counted.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from deepshard.core.memory import expected_bytes

OFFLOADS = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class Estimate:
    """Per-rank bytes of model states by residence, for one stage and offload choice."""

    stage: int
    offload: str
    offload_params: bool | str  # False/'none', True/'cpu' (FSDP2 CPU offload), 'nvme' (ZeRO-Infinity)
    device: int
    host: int
    nvme: int

    @property
    def options(self) -> str:
        out = f"+zero=stage{self.stage}"
        if self.offload != "none":
            out += f" +offload={self.offload}"
        params = {True: "cpu", False: "none"}.get(self.offload_params, self.offload_params)
        return out + (f" offload.params={params}" if params != "none" else "")


def count_params(model_cfg, lora=None) -> int:
    """Trainable parameters of the model config, built on the meta device (``lora``: a LoraConfig,
    then the adapters and the modules to save only)."""
    from deepshard.finetune.models.llama import Llama
    from deepshard.finetune.models.lora import count_lora_params

    with torch.device("meta"):
        model = Llama(model_cfg)
    if lora is not None:
        return count_lora_params(model, lora)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def largest_unit(model_cfg) -> int:
    """Parameters of the largest ZeRO-3 unit: one block, or the root (embeddings, final norm, head)."""
    from deepshard.finetune.models.llama import Llama

    with torch.device("meta"):
        model = Llama(model_cfg)
    block = sum(p.numel() for p in model.layers[0].parameters()) if len(model.layers) else 0
    return max(block, sum(p.numel() for p in model.parameters()) - len(model.layers) * block)


def unit_shards(model_cfg, world: int) -> list[int]:
    """Elements of each ZeRO-3 unit's shard on one rank (the root, then each block) as
    ``offload.params=nvme`` lays them out: FSDP2 pads every param's dim 0 to a multiple of ``world``,
    and the swap places the padded shards (``slot_offsets``)."""
    from deepshard.finetune.models.llama import Llama
    from deepshard.offload.unit_swap import slot_offsets

    with torch.device("meta"):
        model = Llama(model_cfg)
    in_blocks = {id(p) for block in model.layers for p in block.parameters()}
    units = [[p for p in model.parameters() if id(p) not in in_blocks]] + [list(b.parameters()) for b in model.layers]
    out = []
    for params in units:
        rows = [p.shape[0] if p.dim() else 1 for p in params]
        _, pos = slot_offsets(-(-r // world) * (p.numel() // max(r, 1)) for p, r in zip(params, rows))
        if pos:  # a root that owns no params itself is no FSDP unit
            out.append(pos)
    return out


class InfinityBuffers(NamedTuple):
    """Host buffers of ``offload.params=nvme`` per rank, in bytes, as allocated (untouched pages of a
    pool buffer may never become resident: an upper bound on what they cost)."""

    pool: int  # param_buffer_count buffers of 4 B per element of the largest unit: read-aheads, grad writes
    deferred: int  # the deferred AdamW step's min(buffer_count, units) buffers of 16 B per element

    @property
    def peak(self) -> int:
        """Both at once: the step's updates are owed from ``step()`` through the next forward (each runs
        at its unit's unshard), so the forward holds the deferred buffers beside the pool; they are
        freed at the first unit's backward (kept throughout when ``buffer_count >= units``)."""
        return self.pool + self.deferred


def infinity_buffers(model_cfg, *, world: int, param_buffer_count: int, buffer_count: int) -> InfinityBuffers:
    """What ``ParamSwap`` (pool) and ``InfinityStore``/``DeferredStep`` (param, exp_avg, exp_avg_sq
    and grad regions per buffer) allocate: every buffer is sized by the largest unit's shard, each
    region rounded up to the O_DIRECT alignment."""
    from deepshard.offload.aio import align_up

    shards = unit_shards(model_cfg, world)
    region = align_up(max(shards, default=1) * 4)
    return InfinityBuffers(param_buffer_count * region, min(buffer_count, len(shards)) * 4 * region)


def count_frozen(model_cfg, lora) -> int:
    """Under LoRA: the base parameters that are frozen (no grads, no optimizer state); 0 otherwise."""
    if lora is None:
        return 0
    from deepshard.finetune.models.llama import Llama
    from deepshard.finetune.models.lora import apply_lora

    with torch.device("meta"):
        model = Llama(model_cfg)
        apply_lora(model, r=lora.r, alpha=lora.alpha, target_modules=lora.target_modules,
                   modules_to_save=lora.modules_to_save, seed=None)
    return sum(p.numel() for p in model.parameters() if not p.requires_grad)


def estimate(num_params: int, *, stage: int, dp: int, dtype: str, offload: str = "none",
             offload_params: bool | str = False, nvme_buffer_bytes: int = 0, frozen_params: int = 0,
             param_buffer_bytes: int = 0) -> Estimate:
    """Where a rank's params, grads and optimizer state live for this choice (``num_params`` trainable
    per rank before data-parallel sharding, i.e. already divided by tp and pp).  ``param_buffer_bytes``:
    the host buffers of ``offload.params=nvme`` at their peak, the forward (:class:`InfinityBuffers`):
    the param pool plus the deferred step's buffers, whatever the model's size.  ``frozen_params``
    (a LoRA base): params only, in the compute dtype at stages 0-2, fp32 shards at stage 3 (FSDP2)."""
    e = expected_bytes(stage, num_params, dp, dtype)
    frozen = 4 * frozen_params // dp if stage == 3 else (4 if dtype == "fp32" else 2) * frozen_params
    e.params += frozen
    device, host, nvme = e.params + e.grads + e.optimizer, 0, 0
    # offloaded: an fp32 master + two moments per sharded element (12 bytes; on a CPU-only host an fp32
    # master may alias the param, so that is an upper bound there)
    offloaded = 12 * num_params // dp
    if offload == "cpu":  # the Adam step runs on the host
        device, host = device - e.optimizer, host + offloaded
    elif offload == "nvme":  # in swap files, streamed through a few host buffers
        device, nvme, host = device - e.optimizer, nvme + offloaded, host + min(nvme_buffer_bytes, offloaded)
    if offload_params == "nvme":  # params (the fp32 masters), grads and moments in swap files: 16 B/elt
        states = 16 * num_params // dp + 4 * frozen_params // dp
        return Estimate(stage, offload, "nvme", 0, param_buffer_bytes, states)
    if offload_params:  # FSDP2 CPUOffloadPolicy: sharded params and their grads rest on the host
        device, host = device - e.params - e.grads, host + e.params + e.grads
    return Estimate(stage, offload, offload_params, device, host, nvme)


def all_estimates(num_params: int, *, dp: int, dtype: str, nvme_buffer_bytes: int = 0,
                  frozen_params: int = 0, param_buffer_bytes: int = 0) -> list[Estimate]:
    """Every stage x offload choice (optimizer offload needs stage >= 1, parameter offload stage 3)."""
    out = []
    for stage in range(4):
        for offload in OFFLOADS:
            if offload != "none" and stage == 0:
                continue
            choices: tuple = (False, True) if stage == 3 and offload != "none" else (False,)
            for params in choices + (("nvme",) if stage == 3 and offload == "nvme" else ()):
                out.append(estimate(num_params, stage=stage, dp=dp, dtype=dtype, offload=offload,
                                    offload_params=params, nvme_buffer_bytes=nvme_buffer_bytes,
                                    frozen_params=frozen_params, param_buffer_bytes=param_buffer_bytes))
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
    from deepshard.finetune.ds_config import merge_argv

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
    lines.append("(activations and temporary buffers are not included)")
    return "\n".join(lines), rows, per_rank, dims.dp


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
