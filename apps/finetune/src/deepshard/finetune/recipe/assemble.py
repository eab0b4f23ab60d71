"""Run assembly: from the validated ``Settings`` to one rank's :class:`~deepshard.finetune.recipe.loop.TrainingLoop`.

This is the one place that reads the whole ``Settings``; every component is built from its own
section (the model from ``model``/``peft``, ZeRO and precision from ``engine``, offload from
``offload``, the checkpointer from ``checkpoint``, the profiler from ``profile``, the guard from
``train``...).  The model is assembled by its family's one recipe (the registry's ``ModelSpec.parallelize``:
TP, activation checkpointing, precision, ZeRO), which both the engine and the pipeline take.  No
family is named here: the config's class picks the spec (``registry.spec_of``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
from torch.utils.data import Dataset

from deepshard.core import build_mesh, init_distributed, initialize
from deepshard.core.checkpoint import progress as save_progress
from deepshard.core.compile import configure_compile
from deepshard.core.mesh import local_device
from deepshard.core.zero import ParamOffload
from deepshard.finetune.config import Settings
from deepshard.finetune.data.build import build_datasets
from deepshard.finetune.data.chat import resolve_template
from deepshard.finetune.data.collate import batch_collator
from deepshard.finetune.data.resumable import ResumableStream
from deepshard.finetune.data.tokenizer import load_tokenizer
from deepshard.finetune.models import registry
from deepshard.finetune.models.lora import apply_lora, init_adapters
from deepshard.finetune.models.materialize import to_empty_tied
from deepshard.finetune.recipe import chaos
from deepshard.finetune.recipe.checkpointing import agree_run_dir, start_checkpointing
from deepshard.finetune.recipe.divergence import DivergenceGuard
from deepshard.finetune.recipe.faults import step_hooks_from_env
from deepshard.finetune.recipe.liveness import BeatingProfiler
from deepshard.finetune.recipe.loop import SampleConfig, TrainingLoop
from deepshard.finetune.recipe.metrics import RunLogger
from deepshard.finetune.recipe.mfu import StepFlops, flops_per_token, param_counts
from deepshard.finetune.recipe.profiling import build_profiler
from deepshard.finetune.recipe.steppers import EngineStepper, PipelineStepper
from deepshard.launch.heartbeat import Heartbeat
from deepshard.launch.local import worker_threads
from deepshard.offload import ParamSwap, make_store_factory, param_offload


def run_id() -> str:
    """Names this run's scratch (NVMe swap dirs): the launcher's run id, shared by all ranks."""
    return os.environ.get("TORCHELASTIC_RUN_ID", "local")


def init_model(model: nn.Module, s: Settings) -> None:
    """The run's seeded init, or for model=hf its buffers and then the HF weights (works on ZeRO-3 and
    TP shards too): the checkpoint writes every base weight, and a whole random draw per tensor first
    would be the load's host peak (a family's ``init_weights`` takes ``weights=False`` for that)."""
    if s.model_name == "hf":
        model.init_weights(seed=s.train.seed, weights=False)
        registry.spec_of(s.model).hf.load_weights(model, s.model_path)
    else:
        model.init_weights(seed=s.train.seed)
    if s.peft is not None:  # the adapters: PEFT's init (B = 0: the run starts as the base), or a PEFT folder's
        init_adapters(model, seed=s.train.seed)
        if s.peft.init_from:
            from deepshard.finetune.models.peft_adapter import load_peft_adapter

            load_peft_adapter(model, s.peft.init_from)


def build_model(s: Settings, device: torch.device, *, materialize: bool = True) -> nn.Module:
    """On the meta device first (no memory); then, unless ZeRO-3 will shard it first, materialized."""
    model = registry.build_meta(s.model)
    if s.peft is not None:  # +peft=lora: frozen base + adapters, before any parallelism is applied
        p = s.peft
        apply_lora(model, r=p.r, alpha=p.alpha, dropout=p.dropout, target_modules=p.target_modules,
                   modules_to_save=p.modules_to_save, seed=None)
    if materialize:
        to_empty_tied(model, device)
        init_model(model, s)
    return model


def _materializer(s: Settings, offload_params: ParamOffload | None):
    """The ZeRO-3 init; with offload.params=nvme through the swap, which writes each block to NVMe
    as soon as it is initialized (the model is never whole in memory)."""
    init = lambda m: init_model(m, s)  # noqa: E731
    return offload_params.materializer(init) if isinstance(offload_params, ParamSwap) else init


def build_stepper(s: Settings, mesh, *, rank: int, pad_id: int = 0) -> EngineStepper | PipelineStepper:
    """The engine (ZeRO on dp, TP on tp) or the pipeline engine (pp > 1), each assembled by the
    family's one recipe (``spec.parallelize``), behind the steppers' one protocol."""
    spec = registry.spec_of(s.model)
    device = local_device()
    store_factory = make_store_factory(s.offload, rank, run_id())
    offload_params = param_offload(s.offload, store_factory)  # None, CPU offload or the NVMe param swap
    t, e = s.train, s.engine
    if s.uses_pipeline:
        model = build_model(s, device, materialize=False)  # on meta (+peft=lora: with its adapters)
        p = s.pipeline
        # each stage copies its part of the full model as the engine path builds it (HF weights, seeded
        # init, adapters): the stages together equal the unsplit model
        init_fn = spec.stage_init(t.seed, full=lambda: build_model(s, torch.device("cpu")))
        engine = spec.pipeline(model, mesh, e, schedule=p.schedule, microbatches=s.micro_batches_per_step,
                               partition=p.partition, virtual_stages=p.virtual_stages or None,
                               init_fn=init_fn, store_factory=store_factory,
                               offload_params=offload_params, device=device)
        return PipelineStepper(engine, mesh, microbatches=s.micro_batches_per_step, device=device,
                               micro_batch_size=t.micro_batch_size, seq_len=s.data.seq_len, pad_id=pad_id)
    nf4 = s.peft is not None and s.peft.base_quant == "nf4"
    # no rank ever holds the whole model (DeepSpeed's zero.Init); QLoRA quantizes each full weight first
    sharded_init = e.zero.stage == 3 and not nf4
    recipe = partial(spec.parallelize, mesh=mesh, zero=e.zero, dtype=e.precision.dtype, ac=e.ac,
                     offload_params=offload_params, ac_offload=e.ac_offload, compile=e.compile)
    model = build_model(s, device, materialize=not sharded_init)
    if nf4:  # the frozen block weights as NF4, before ZeRO-3 shards them (models/qlora.py)
        from deepshard.finetune.models.qlora import apply_nf4

        apply_nf4(model, world=mesh["dp"].size())
    engine = initialize(model, e, mesh=mesh,
                        parallelize_fn=recipe, store_factory=store_factory, offload_params=offload_params,
                        materialize=_materializer(s, offload_params) if sharded_init else None)
    return EngineStepper(engine, grad_accum=t.grad_accum, device=device, micro_batch_size=t.micro_batch_size)


def run_meta(s: Settings) -> dict:
    """What a checkpoint's manifest records of the run (``meta``): the family and its architecture
    (``registry.from_meta`` reads them back), the whole config, and for LoRA the adapters' settings
    and the base by reference."""
    meta = {"family": registry.spec_of(s.model).name, "model": dataclasses.asdict(s.model),
            "config": dataclasses.asdict(s)}
    if s.peft is not None:
        meta["peft"] = dataclasses.asdict(s.peft)
        meta["base"] = {"model": s.model_name, "path": s.model_path, "seed": s.train.seed}
        if s.peft.base_quant != "none":  # the ZeRO-3 ranks its NF4 scales were blocked for (export --merge)
            meta["nf4"] = {"world": s.parallel.dp}
    return meta


def model_flops(s: Settings, dp_size: int = 1) -> StepFlops:
    """``recipe/mfu.py``'s count for this model (LoRA's frozen base included), shared by the
    ``dp_size`` x tp x pp x sp ranks of the run: a step's FLOPs come from the positions it computed."""
    cfg, par = s.model, s.parallel
    model = build_model(s, torch.device("meta"), materialize=False)  # with LoRA's frozen base and adapters
    active = getattr(cfg, "num_experts_per_tok", 1) / getattr(cfg, "num_experts", 1)
    trainable, frozen = param_counts(model, experts_active=active)
    attention = flops_per_token(trainable=0, frozen=0, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                                head_dim=cfg.head_dim, seq_len=1)
    return StepFlops(dense=6 * trainable + 4 * frozen, attention=attention, ranks=dp_size * par.tp * par.pp * par.sp)


def step_flops(s: Settings) -> int:
    """Model FLOPs of one optimizer step of full-length rows (``data.seq_len``) on one rank: the step's
    micro-batches split over the tp, pp and sp ranks that share them."""
    tokens = s.train.micro_batch_size * s.data.seq_len * s.micro_batches_per_step
    return model_flops(s).per_rank(tokens, tokens * s.data.seq_len)


def header(s: Settings, world: int, num_params: int, num_windows: int) -> str:
    """The run's first line: ranks and layout, ZeRO stage, offload, precision, parameters, data."""
    off, par = s.offload, s.parallel
    offload = f", offload optimizer={off.device} params={off.params}" if off.device != "none" or off.params != "none" else ""
    split = par.pp > 1 or par.tp > 1
    sp = f" x sp {par.sp}" if par.sp > 1 else ""  # sequence parallel: the sp ranks share every row
    layout = f" (pp {par.pp} x dp {par.dp} x tp {par.tp}{sp})" if split or sp else ""
    params_scope = " per pp/tp rank" if split else ""  # each pp/tp rank holds a part
    return (f"deepshard: {world} rank(s){layout}, zero stage {s.engine.zero.stage}{offload}, "
            f"{s.engine.precision.dtype}{', compiled blocks' if s.engine.compile else ''}, {num_params / 1e6:.2f}M {'trainable (LoRA) ' if s.peft else ''}"
            f"params{params_scope}, {num_windows} windows of {s.data.seq_len} tokens")


def assemble(settings: Settings, run_dir: str, datasets: tuple[Dataset, Dataset | None] | None = None
             ) -> TrainingLoop:
    """Process group, mesh, model (the recipe), data (``datasets``: the launcher's, already tokenized),
    the resume from the newest checkpoint, logging, profiling and the divergence guard."""
    s, t = settings, settings.train
    # torchdata 0.11 calls a torch API that 2.13 deprecated, on every epoch: known, harmless
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    rank, world = init_distributed(timeout_s=s.launcher.timeout_s)
    if torch.cuda.is_available() and os.environ.get("OMP_NUM_THREADS") == "1":  # torchrun's default starves
        torch.set_num_threads(worker_threads(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), cuda=True))  # host Adam
    beat = Heartbeat.from_env(rank)  # step and phase, for the launcher's hang watchdog
    save_progress.set_listener(chaos.listener(beat.progress))  # and a save's written bytes: a slow save is no hang
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    run_dir = agree_run_dir(run_dir)  # under torchrun every process's Hydra stamps its own: rank 0's wins
    mesh = build_mesh(s.parallel)
    dp = mesh["dp"]
    if s.engine.compile:  # inductor's cache in the run dir (a restart reuses it) unless the env names one
        configure_compile(cache_dir=os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(run_dir, "compile_cache"))
    torch.manual_seed(t.seed)
    tokenizer = load_tokenizer(s.model_path)
    stepper = build_stepper(s, mesh, rank=rank, pad_id=tokenizer.pad_token_id or 0)
    engine = stepper.engine
    dataset, eval_set = datasets or build_datasets(s.data, tokenizer, s.model.vocab_size)
    # the data position, step, weights and optimizer come back from the newest checkpoint (checkpoint.resume)
    batches = ResumableStream(dataset, dp_rank=dp.get_local_rank(), dp_size=dp.size(),
                              micro_batch_size=t.micro_batch_size, seed=t.seed, collate_fn=batch_collator(s.data))
    ckpt, start_step = start_checkpointing(s.checkpoint, run_dir=run_dir, engine=engine, data=batches,
                                           tokens_per_step=s.tokens_per_step(dp.size()), meta=run_meta(s),
                                           tokenizer=tokenizer, micro_batches_per_step=s.micro_batches_per_step)
    logger = RunLogger(run_dir, enabled=rank == 0, total_steps=t.max_steps, initial_step=start_step,
                       tb_dir=t.tensorboard_dir)
    flops = model_flops(s, dp.size())  # each step's FLOPs from the positions it computed (the loop)
    prof = build_profiler(s.profile, engine, trace_dir=os.path.join(run_dir, "profile"),
                          rank=rank, device=local_device())
    stepper.prof = BeatingProfiler(prof, beat)
    scaler = engine.optimizer.scaler
    guard = DivergenceGuard(max_bad_steps=t.max_bad_steps, max_param_growth=t.max_param_growth,
                            dynamic=scaler.dynamic, min_scale=scaler.min_scale,
                            scale_window=s.engine.precision.loss_scale_window, say=logger.print)
    guard.reference(engine.optimizer.param_norm())  # the state it starts from (init or resumed) is good
    chat = resolve_template(tokenizer, s.data.chat_template) if t.sample_prompt and s.data.name == "chat" else None
    sample = SampleConfig(prompt=t.sample_prompt, num_tokens=t.sample_tokens, max_seq_len=s.model.max_seq_len,
                          chat_template=chat)
    loop = TrainingLoop(train=t, every_steps=s.checkpoint.every_steps, stepper=stepper, batches=batches,
                        eval_set=eval_set, ckpt=ckpt, logger=logger, prof=prof, beat=beat, guard=guard,
                        tokenizer=tokenizer, sample=sample, start_step=start_step, world=world,
                        run_dir=run_dir, zero_stage=s.engine.zero.stage, flops=flops,
                        step_hooks=[*step_hooks_from_env(os.environ), *chaos.step_hooks(os.environ)], compiled=s.engine.compile)
    logger.print(header(s, world, engine.num_params, len(dataset)))
    logger.print(registry.path_line(s.model))  # native family or transformers' own code
    return loop


# what a worker imports during its run rather than at this module's import (a launcher reading a config
# skips them): the pipeline package (torch.distributed.pipelining; every model family's recipe module
# imports it) and rank 0's TensorBoard writer; a launcher's forkserver holds them once for all its ranks
# instead of each rank importing them after the fork (~0.3-0.5 s of CPU each, per rank and launch)
WORKER_IMPORTS = ("deepshard.pipeline", "torch.utils.tensorboard")


def train_worker(settings: Settings, run_dir: str, datasets: tuple[Dataset, Dataset | None] | None = None) -> dict:
    """Train on this rank; returns the run's summary (identical on every rank).  ``settings``: the
    validated ``config.Settings``; ``datasets`` are the (train, eval) sets the launcher built in its
    checks; without them (torchrun) each rank builds its own."""
    try:
        return assemble(settings, run_dir, datasets).fit()
    except BaseException as e:
        # record the cause first: tearing the group down makes the peers fail at once ("Connection
        # closed by peer"), and the agent may SIGTERM this rank before its own error file is written
        if isinstance(e, Exception):
            ErrorHandler().record_exception(e)
        # then tear the process group down before the error leaves the worker: left to interpreter exit,
        # gloo's threads can abort the process (SIGABRT), and a signal would then hide the real cause
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
