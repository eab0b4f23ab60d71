"""The whole of a rank's memory for a run, not only its model states: what ``tools/estimate`` prints
and what the app's preflight compares with the memory its workers will have before starting them.
Each part is stated by the package that allocates it; this module only adds them up for a run.

Per rank, in two columns (host: the process's own RAM; device: the accelerator's memory, which on
a CPU-only host is the same RAM):

- model states by residence (core's ``memory.residence``: the README's ZeRO table, offload moving
  them to host buffers or swap files),
- the offload stores' host buffers (offload's ``memory.host_buffers``: optimizer groups, the
  parameter pool, the deferred step's pieces, the tiles),
- ZeRO-3's gathered units (core's ``gathered_unit_bytes``); stages 0-2 their gradients in flight,
- activations for ``data.seq_len`` x ``train.micro_batch_size`` under ``ac`` (the family's
  ``activation_memory``), and the loss's logits chunk and gradient accumulators (a vocabulary tile
  under tiling),
- a worker's own pages before training (launch's ``memory.job_baseline``: what the host's processes
  hold once, the forkserver's image among them, is counted by the caller, once per host), and the
  kernel's page tables for the rest (launch's ``memory.page_table_bytes``),
- ``model=hf``: the checkpoint read (``load_peak``), beyond the activations it never meets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deepshard.core.memory import DTYPE_BYTES, gathered_unit_bytes, grads_in_flight_bytes, residence
from deepshard.finetune.models.memory_plan import ModelCounts, model_counts
from deepshard.finetune.models.registry import spec_of
from deepshard.launch.memory import page_table_bytes
from deepshard.offload import OffloadConfig
from deepshard.offload.memory import host_buffers

if TYPE_CHECKING:
    from deepshard.finetune.config import Settings


@dataclass(frozen=True)
class RunShape:
    """What the working set depends on, besides the model config (narrow: built from the settings)."""

    stage: int
    dp: int
    dtype: str = "fp32"
    offload: OffloadConfig = field(default_factory=OffloadConfig)  # resolved: every value given
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
    loads_checkpoint: bool = False  # model=hf: the weights are read from safetensors at start
    params_are_masters: bool = False  # optim.state_dtype=bf16 with bf16 params: no fp32 master copy
    ep: int = 1  # parallel.ep: experts 1/ep per rank, ZeRO over dp / ep; the dispatch's buffers
    doc_mask: bool = False  # data.pack with data.doc_mask: rows carry doc_ids (attention masked per document)


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


def _loss(cfg: Any, s: RunShape) -> int:
    """The fused linear + cross-entropy: a [chunk, vocab] fp32 logits block (a [chunk, tile] one under
    tiling; measured on CPU: one block at a time), the hidden states' gradient, and without tiling the
    head's fp32 gradient accumulator."""
    tokens = s.micro_batch_size * s.seq_len
    chunk = min(tokens, cfg.loss_chunk_size or tokens)
    if s.tile_rows:
        tile = s.tile_rows * cfg.dim
        return chunk * s.tile_rows * 4 + tokens * cfg.dim * 4 + 2 * tile * (4 + DTYPE_BYTES[s.dtype])
    return chunk * cfg.vocab_size * 4 + tokens * cfg.dim * 4 + cfg.vocab_size * cfg.dim * 4


def working_set(cfg: Any, counts: ModelCounts, s: RunShape, *, baseline: int) -> WorkingSet:
    """``cfg``: a family's model config (its spec gives the activations); ``counts``: its parameters
    per rank before dp sharding and its units (:func:`~.memory_plan.model_counts`); ``baseline``: a
    worker's own pages."""
    ws = WorkingSet()
    o, num = s.offload, counts.num_params
    hb = host_buffers(o, state_numel=num // s.dp, units=counts.units, gathered=counts.gathered,
                      tile_rows=s.tile_rows, tile_width=cfg.dim, world=s.dp)
    buffers = hb.peak
    e = residence(num, stage=s.stage, dp=s.dp, dtype=s.dtype, offload=o.device,
                  offload_params={"cpu": True, "nvme": "nvme"}.get(o.params, False),
                  nvme_buffer_bytes=buffers if o.params != "nvme" else 0, frozen_params=counts.frozen,
                  param_buffer_bytes=buffers if o.params == "nvme" else 0, states=counts.optimizer_states,
                  params_are_masters=s.params_are_masters, experts=counts.experts, ep=s.ep,
                  expert_states=counts.expert_states)
    ws.device["model states"] = e.device
    if counts.nf4:  # QLoRA's NF4 base, ZeRO-3 shards: 0.5 B/param + scales (models/qlora.py)
        from deepshard.finetune.models.qlora import nf4_bytes

        ws.device["model states"] += nf4_bytes(counts.nf4) // s.dp
    if o.params == "nvme":  # the deferred step's forward-only buffers: below, against backward's units
        ws.host["swap buffers"] = buffers - hb.forward_only
    else:
        if o.device == "nvme":
            ws.host["swap buffers"] = buffers
        ws.host["model states (offloaded)"] = e.host - (buffers if o.device == "nvme" else 0)
    if s.stage == 3:
        backward = gathered_unit_bytes(counts.largest_unit, prefetch=s.prefetch, dtype=s.dtype)
        ws.device["gathered units"] = backward
        # the larger phase, not the sum: the forward holds the deferred step's buffers beside its own units,
        # the backward its units and gradient (bench/bench_memory_table.py)
        forward = gathered_unit_bytes(counts.largest_unit, prefetch=s.prefetch, dtype=s.dtype, phase="forward")
        if o.params == "nvme" and hb.forward_only:
            ws.host["deferred update (forward, beyond backward's units)"] = max(0, hb.forward_only - (backward - forward))
    else:
        ws.device["gradients in flight"] = grads_in_flight_bytes(num, stage=s.stage, dp=s.dp,
                                                                 reduce_bucket_size=s.reduce_bucket_size)
    ws.device["activations"], offloaded, transient = spec_of(cfg).activation_memory(cfg, s)
    if offloaded:
        ws.host["activations (offloaded inputs)"] = offloaded
    ws.device["loss"] = max(0, _loss(cfg, s) - transient)  # beyond the backward transient it never meets
    if s.loads_checkpoint:  # the read slice is host memory; on a CPU-only host the activations come later
        _, read = load_peak(counts, s)
        ws.host["checkpoint read"] = read if s.on_device else max(0, read - ws.device["activations"] - ws.device["loss"])
    ws.host["process baseline"] = baseline
    ws.host["page tables"] = page_table_bytes(ws.ram(s.on_device) - baseline)  # the kernel's, for what it maps
    return ws


def load_peak(counts: ModelCounts, s: RunShape) -> tuple[int, int]:
    """A rank's host peak while it loads a HF checkpoint, as (the parameters it keeps, fp32; the slice
    it reads at once): ``models/hf.read_local`` reads one tensor at a time and of it only this rank's
    rows, so the peak is about checkpoint/world + the largest tensor / world at ZeRO-3 (stages 0-2
    keep whole parameters: checkpoint + the largest tensor).  Counted at 4 bytes per element (an fp32
    checkpoint; a bf16 one needs less); the optimizer states and activations do not exist yet."""
    shards = s.dp if s.stage == 3 else 1
    return 4 * (counts.num_params + counts.frozen + counts.nf4) // shards, 4 * counts.largest_tensor // shards


def run_shape(s: Settings) -> RunShape:
    """The settings the working set depends on (``s.offload`` resolved: see ``preflight``)."""
    import torch

    from deepshard.finetune.models.vocab_tiling import tile_rows

    e, par = s.engine, s.parallel
    sp = getattr(par, "sp", 1)
    return RunShape(stage=e.zero.stage, dp=par.dp * sp, dtype=e.precision.dtype, offload=s.offload,
                    micro_batch_size=s.train.micro_batch_size, seq_len=s.data.seq_len // sp, ac=e.ac,
                    prefetch=e.zero.prefetch, reduce_bucket_size=e.zero.reduce_bucket_size,
                    tile_rows=tile_rows(s.model, zero_stage=e.zero.stage, tp=par.tp, pp=par.pp, sp=sp),
                    on_device=torch.cuda.is_available(), sp=sp, mlp_tiles=s.model.mlp_tiles,
                    ac_offload=e.ac_offload, loads_checkpoint=s.model_name == "hf",
                    params_are_masters=e.optim.state_dtype == "bf16" and e.precision.dtype != "fp32",
                    ep=getattr(par, "ep", 1), doc_mask=s.data.pack and s.data.doc_mask)


def counts_of(s: Settings, shape: RunShape) -> ModelCounts:
    """The model's counts for this run's layout (the meta model built once)."""
    par = s.parallel
    return model_counts(s.model, s.peft, tp=par.tp, pp=par.pp, world=shape.dp, tiled=bool(shape.tile_rows),
                        optim=s.engine.optim, ep=shape.ep)


def working_set_of(s: Settings, *, baseline: int, shape: RunShape | None = None,
                   counts: ModelCounts | None = None) -> WorkingSet:
    """One rank's working set for these settings (``shape``/``counts``: already computed for them)."""
    shape = shape or run_shape(s)
    return working_set(s.model, counts or counts_of(s, shape), shape, baseline=baseline)
