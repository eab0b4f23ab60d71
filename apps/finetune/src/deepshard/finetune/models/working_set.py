"""The whole of a rank's memory for a run, not only its model states: what ``tools/estimate`` prints
and what the app compares with the memory its workers will have before starting them.

Per rank, in two columns (host: the process's own RAM; device: the accelerator's memory, which on
a CPU-only host is the same RAM):

- model states by residence (``memory_plan.estimate``: the README's ZeRO table, offload moving
  them to host buffers or swap files),
- the swap buffers at the sizes the stores allocate them (optimizer groups, the parameter pool,
  the deferred step's buffers),
- ZeRO-3's gathered units: the unit in use and ``zero.prefetch`` ahead, in the compute dtype, and
  its unsharded gradient; stages 0-2 their gradient buckets,
- activations for ``data.seq_len`` x ``train.micro_batch_size`` under ``ac`` (the family's
  ``activation_memory``), and the loss's
  logits chunk and gradient accumulators (a vocabulary tile under tiling),
- a worker's own pages before training (``process_memory``: what the host's processes hold once,
  the forkserver's image among them, is counted by the caller, once per host).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepshard.finetune.models.memory_plan import estimate, infinity_buffers, largest_unit
from deepshard.finetune.models.registry import spec_of
from deepshard.finetune.process_memory import WORKER_OWN

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class RunShape:
    """What the working set depends on, besides the model config (narrow: built from the settings)."""

    stage: int
    dp: int
    dtype: str = "fp32"
    offload: str = "none"  # optimizer state: none | cpu | nvme
    params: str = "none"  # none | cpu | nvme
    buffer_count: int = 3
    buffer_size: int = 2**24
    sub_group_size: int = 2**24
    param_buffer_count: int = 4
    param_prefetch: int = 2
    micro_batch_size: int = 1
    seq_len: int = 256
    ac: str = "none"
    prefetch: int = 1  # zero.prefetch: blocks all-gathered ahead
    reduce_bucket_size: int = 5 * 10**8
    tile_rows: int = 0  # vocabulary tiling (gathered rows per tile), 0: off
    on_device: bool = False  # an accelerator holds the device column (else both columns are host RAM)
    sp: int = 1  # parallel.sp: seq_len above is already a rank's seq_len / sp tokens
    mlp_tiles: int = 1  # model.mlp_tiles: one tile's [tokens, ffn_hidden] at a time
    ac_offload: bool = False  # checkpointed block inputs in host memory (the host column)


@dataclass
class WorkingSet:
    host: dict[str, int] = field(default_factory=dict)
    device: dict[str, int] = field(default_factory=dict)

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    def ram(self, on_device: bool) -> int:
        """What the host's RAM must hold: the host column, plus the device column on a CPU-only host."""
        return self.host_total + (0 if on_device else self.device_total)


def _loss(cfg, s: RunShape) -> int:
    """The fused linear + cross-entropy: a [chunk, vocab] fp32 logits block (a [chunk, tile] one under
    tiling; measured on CPU: one block at a time), the hidden states' gradient, and without tiling the
    head's fp32 gradient accumulator."""
    tokens = s.micro_batch_size * s.seq_len
    chunk = min(tokens, cfg.loss_chunk_size or tokens)
    if s.tile_rows:
        tile = s.tile_rows * cfg.dim
        return chunk * s.tile_rows * 4 + tokens * cfg.dim * 4 + 2 * tile * (4 + BYTES[s.dtype])
    return chunk * cfg.vocab_size * 4 + tokens * cfg.dim * 4 + cfg.vocab_size * cfg.dim * 4


def working_set(cfg, num_params: int, s: RunShape, *, baseline: int | None = None, frozen: int = 0) -> WorkingSet:
    """``cfg``: a family's model config (its spec gives the activations); ``num_params``: trainable
    parameters per rank before dp sharding."""
    from deepshard.offload.aio import align_up

    ws = WorkingSet()
    b = BYTES[s.dtype]
    infinity = 0
    if s.params == "nvme":  # what ParamSwap (pool), the deferred step (4 regions a piece) and the tiles allocate
        infinity = infinity_buffers(cfg, world=s.dp, param_buffer_count=s.param_buffer_count,
                                    buffer_count=s.buffer_count, tiled=bool(s.tile_rows),
                                    sub_group_size=s.sub_group_size, buffer_size=s.buffer_size,
                                    tile_rows=s.tile_rows).peak
    groups = min(s.sub_group_size, max(num_params // s.dp, 1))
    nvme_buffers = min(s.buffer_count, -(-max(num_params // s.dp, 1) // groups)) * 4 * align_up(groups * 4) \
        if s.offload == "nvme" and s.params != "nvme" else 0
    e = estimate(num_params, stage=s.stage, dp=s.dp, dtype=s.dtype, offload=s.offload,
                 offload_params={"cpu": True, "nvme": "nvme"}.get(s.params, False), nvme_buffer_bytes=nvme_buffers,
                 frozen_params=frozen, param_buffer_bytes=infinity)
    ws.device["model states"] = e.device
    if s.params == "nvme":
        ws.host["swap buffers"] = infinity
    else:
        if s.offload == "nvme":
            ws.host["swap buffers"] = nvme_buffers
        ws.host["model states (offloaded)"] = e.host - (nvme_buffers if s.offload == "nvme" else 0)
    block = largest_unit(cfg, tiled=bool(s.tile_rows))
    if s.stage == 3:  # the unit in use and those prefetched, gathered; its gradient unsharded (fp32)
        ws.device["gathered units"] = (1 + s.prefetch) * block * b + block * 4
    else:  # autograd's fp32 gradients before the reducer folds them into its buckets (measured: one
        # full gradient at the peak), and at dp > 1 a packing buffer of about a bucket
        ws.device["gradients in flight"] = 4 * num_params + (
            4 * min(s.reduce_bucket_size, num_params) if s.dp > 1 and s.stage > 0 else 0)
    ws.device["activations"], offloaded, transient = spec_of(cfg).activation_memory(cfg, s)
    if offloaded:
        ws.host["activations (offloaded inputs)"] = offloaded
    ws.device["loss"] = max(0, _loss(cfg, s) - transient)  # beyond the backward transient it never meets
    ws.host["process baseline"] = WORKER_OWN if baseline is None else baseline
    return ws


def knobs_to_fit(s: RunShape) -> list[str]:
    """The settings that shrink the working set, in the order worth trying."""
    out = []
    if s.stage < 3:
        out.append("+zero=stage3")
    if s.offload == "none":
        out.append("+offload=cpu (or +offload=nvme offload.params=nvme)")
    elif s.params != "nvme" and s.offload == "nvme":
        out.append("offload.params=nvme")
    if s.params == "nvme" and (s.buffer_count > 1 or s.param_buffer_count > 2):
        out.append("offload.buffer_count=1 offload.param_buffer_count=2 offload.param_prefetch=1")
    if s.params == "nvme" and min(s.sub_group_size, s.buffer_size) > 2**22:
        out.append("offload.sub_group_size=4194304 (the deferred update's pieces: 16 B x that per buffer)")
    if s.ac == "none":
        out.append("ac=full")
    if s.micro_batch_size > 1:
        out.append(f"train.micro_batch_size={s.micro_batch_size // 2} (with train.grad_accum x2)")
    out.append("fewer ranks per host (launcher.nproc_per_node)")
    return out
