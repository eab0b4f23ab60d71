"""The training recipe: one worker's whole life, the same code for 1 or N ranks."""

from __future__ import annotations

import logging
import math
import os
import time
import warnings

import torch
import torch.distributed as dist

from deepshard.core import build_mesh, init_distributed, initialize
from deepshard.core.heartbeat import Heartbeat
from deepshard.core.mesh import local_device
from deepshard.finetune.checkpointing import agree_run_dir, start_checkpointing
from deepshard.finetune.config import Settings, validate
from deepshard.finetune.data.build import build_datasets
from deepshard.finetune.data.chat import resolve_template
from deepshard.finetune.data.tokenizer import load_tokenizer
from deepshard.finetune.divergence import DivergenceGuard, TrainingDiverged, inject_test_fault
from deepshard.finetune.evaluate import evaluate
from deepshard.finetune.liveness import BeatingProfiler
from deepshard.finetune.metrics import RunLogger, memory_line, memory_scalars
from deepshard.finetune.models.hf import load_hf_weights
from deepshard.finetune.models.llama import Llama
from deepshard.finetune.models.lora import apply_lora, init_adapters
from deepshard.finetune.profiling import build_profiler
from deepshard.finetune.sample import greedy_sample
from deepshard.finetune.steppers import EngineStepper, PipelineStepper
from deepshard.offload import make_store_factory

log = logging.getLogger("deepshard.finetune")


def run_id() -> str:
    """Names this run's scratch (NVMe swap dirs): the launcher's run id, shared by all ranks."""
    return os.environ.get("TORCHELASTIC_RUN_ID", "local")


def init_model(model: Llama, s: Settings) -> None:
    """The run's seeded init, then the HF weights for model=hf (works on ZeRO-3 shards too)."""
    model.init_weights(seed=s.train.seed)
    if s.model_name == "hf":
        load_hf_weights(model, s.model_path)
    if s.peft is not None:  # the adapters: PEFT's init (B = 0: the run starts as the base), or a PEFT folder's
        init_adapters(model, seed=s.train.seed)
        if s.peft.init_from:
            from deepshard.finetune.adapter_export import load_peft_adapter

            load_peft_adapter(model, s.peft.init_from)


def build_model(s: Settings, device: torch.device, *, materialize: bool = True) -> Llama:
    """On the meta device first (no memory); then, unless ZeRO-3 will shard it first, materialized."""
    with torch.device("meta"):
        model = Llama(s.model)
    if s.peft is not None:  # +peft=lora: frozen base + adapters, before any parallelism is applied
        p = s.peft
        apply_lora(model, r=p.r, alpha=p.alpha, dropout=p.dropout, target_modules=p.target_modules,
                   modules_to_save=p.modules_to_save, seed=None)
    if materialize:
        model.to_empty(device=device)
        init_model(model, s)
    return model


def build_stepper(s: Settings, mesh, *, rank: int) -> EngineStepper | PipelineStepper:
    """The engine (data parallel) or the pipeline trainer (pp/tp > 1), wrapped as a stepper."""
    device = local_device()
    store_factory = make_store_factory(s.offload, rank, run_id())
    offload_params = s.offload.params == "cpu"
    if s.uses_pipeline:
        from deepshard.finetune.models.parallelize import llama_stage_init, pipeline_llama

        with torch.device("meta"):
            model = Llama(s.model)
        if s.model_name == "hf":
            raise ValueError("model=hf with parallel.pp/tp > 1: not supported yet (use parallel.pp=1 parallel.tp=1)")
        p = s.pipeline
        trainer = pipeline_llama(model, mesh, s.engine, schedule=p.schedule, microbatches=p.microbatches,
                                 partition=p.partition, virtual_stages=p.virtual_stages or None,
                                 init_fn=llama_stage_init(s.train.seed), store_factory=store_factory,
                                 offload_params=offload_params, device=device)
        return PipelineStepper(trainer, mesh, microbatches=p.microbatches, device=device)
    sharded_init = s.engine.zero.stage == 3  # no rank ever holds the whole model (DeepSpeed's zero.Init)
    engine = initialize(build_model(s, device, materialize=not sharded_init), s.engine, mesh=mesh,
                        store_factory=store_factory, offload_params=offload_params,
                        materialize=(lambda m: init_model(m, s)) if sharded_init else None)
    return EngineStepper(engine, grad_accum=s.train.grad_accum, device=device)


def train_worker(cfg: dict, run_dir: str) -> dict:
    """Train on this rank; returns the run's summary (identical on every rank)."""
    settings = validate(cfg)
    # torchdata 0.11 calls a torch API that 2.13 deprecated, on every epoch: known, harmless
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    rank, world = init_distributed(timeout_s=settings.launcher.timeout_s)
    beat = Heartbeat.from_env(rank)  # step and phase, for the launcher's hang watchdog
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    run_dir = agree_run_dir(run_dir)  # under torchrun every process's Hydra stamps its own: rank 0's wins
    mesh = build_mesh(settings.parallel)
    dp = mesh["dp"]
    torch.manual_seed(settings.train.seed)

    tokenizer = load_tokenizer(settings.model_path)
    stepper = build_stepper(settings, mesh, rank=rank)
    engine = stepper.engine
    dataset, eval_set = build_datasets(settings.data, tokenizer, settings.model.vocab_size)
    t = settings.train
    # the data position, step, weights and optimizer come back from the newest checkpoint (checkpoint.resume)
    ckpt, batches, start_step = start_checkpointing(settings, cfg, run_dir=run_dir, engine=engine, dataset=dataset,
                                                    tokenizer=tokenizer)
    logger = RunLogger(run_dir, enabled=rank == 0, total_steps=t.max_steps, initial_step=start_step,
                       tb_dir=t.tensorboard_dir)
    prof = build_profiler(settings, engine, trace_dir=os.path.join(run_dir, "profile"), rank=rank,
                          device=local_device())
    stepper.prof = BeatingProfiler(prof, beat)
    guard = DivergenceGuard.for_run(settings, engine.optimizer.scaler, say=logger.print)
    eval_args = {"dp_rank": dp.get_local_rank(), "dp_size": dp.size(), "group": dp.get_group(),
                 "micro_batch_size": t.micro_batch_size, "device": local_device()}
    evals: dict[str, float] = {}
    off = settings.offload
    offload = f", offload optimizer={off.device} params={off.params}" if off.device != "none" or off.params != "none" else ""
    par = settings.parallel.resolve(world)
    layout = f" (pp {par.pp} x dp {par.dp} x tp {par.tp})" if settings.uses_pipeline else ""
    params_scope = " per pp/tp rank" if settings.uses_pipeline else ""  # each pp/tp rank holds a part
    logger.print(f"deepshard: {world} rank(s){layout}, zero stage {settings.engine.zero.stage}{offload}, "
                 f"{settings.engine.precision.dtype}, {engine.num_params / 1e6:.2f}M "
                 f"{'trainable (LoRA) ' if settings.peft else ''}params{params_scope}, "
                 f"{len(dataset)} windows of {settings.data.seq_len} tokens")

    tokens_per_step = t.micro_batch_size * settings.micro_batches_per_step * settings.data.seq_len * dp.size()
    losses: list[float] = []
    start = time.perf_counter()
    step_start = start
    for step in range(start_step + 1, t.max_steps + 1):
        prof.begin_step(step)
        beat.mark("forward", step)
        inject_test_fault(engine.model, step)
        out = stepper(batches, measure_memory=step == start_step + 1)
        loss_value, stats, memory = out.loss, out.stats, out.memory
        losses.append(loss_value)
        now = time.perf_counter()
        tok_s = tokens_per_step / (now - step_start)
        logger.scalars(step, prof.end_step(step, now - step_start))
        if memory is not None:  # every rank's model state and, on CUDA, device peaks (one all-gather)
            mem = memory_scalars(memory, world=world, device=local_device())
            logger.scalars(step, mem)
            if (line := memory_line(mem, world)) is not None:
                logger.print(line)
        logger.scalars(step, {"train/loss": loss_value, "train/perplexity": math.exp(min(loss_value, 50.0)),
                              "train/lr": stats.lr, "train/grad_norm": stats.grad_norm,
                              "train/loss_scale": stats.loss_scale, "train/tokens_per_s": tok_s,
                              "train/step_applied": float(stats.applied), "train/skipped_steps": guard.skipped})
        logger.progress({"loss": f"{loss_value:.3f}", "tok/s": f"{tok_s:,.0f}"})
        if step % t.log_every == 0 or step == t.max_steps:
            logger.print(f"step {step:>5}  loss {loss_value:.4f}  lr {stats.lr:.2e}  grad_norm {stats.grad_norm:.3f}"
                         f"  scale {stats.loss_scale:g}  tok/s {tok_s:,.0f}")
        try:  # fp32/bf16: max_bad_steps non-finite steps in a row stop the run, nothing saved after the last good
            guard.check(step, loss_value, applied=stats.applied, loss_scale=stats.loss_scale,
                        newest_checkpoint=ckpt.last_saved or (f"the one resumed (step {start_step})" if start_step
                                                              else "none written yet"))
        except TrainingDiverged:
            logger.close()
            raise
        if eval_set is not None and ((t.eval_every and step % t.eval_every == 0) or step == t.max_steps):
            beat.mark("eval", step)
            evals = evaluate(engine, eval_set, **eval_args)
            logger.scalars(step, evals)
            logger.print(f"eval  {step:>5}  loss {evals['eval/loss']:.4f}  perplexity {evals['eval/perplexity']:.2f}")
        if step == t.max_steps or (every := settings.checkpoint.every_steps) and step % every == 0:
            beat.mark("checkpoint", step)  # (no save during a run of bad steps: it may be the diverged state)
        if guard.saving_allowed and ckpt.after_step(step, last=step == t.max_steps):  # SIGTERM/SIGINT: saved, stop
            break
        step_start = time.perf_counter()
    ckpt.close()
    beat.close()
    elapsed = time.perf_counter() - start
    logger.close()
    ran = len(losses)
    k = max(1, min(10, ran // 2))
    summary = {"steps": start_step + ran, "first_loss": sum(losses[:k]) / k, "final_loss": sum(losses[-k:]) / k,
               "losses": losses, "seconds": elapsed, "tokens_per_s": tokens_per_step * ran / max(elapsed, 1e-9),
               "world_size": world, "zero_stage": settings.engine.zero.stage, "run_dir": run_dir, **evals,
               "start_step": start_step, "preempted": ckpt.preempted, "checkpoint": ckpt.last_saved,
               "skipped_steps": guard.skipped}
    if t.sample_prompt:
        chat = resolve_template(tokenizer, settings.data.chat_template) if settings.data.name == "chat" else None
        summary["sample"] = greedy_sample(engine.model, tokenizer, t.sample_prompt, num_tokens=t.sample_tokens,
                                          max_seq_len=settings.model.max_seq_len, device=local_device(),
                                          chat_template=chat)
        logger.print(f"sample: {t.sample_prompt!r} -> {summary['sample']!r}")
    what = "preempted" if ckpt.preempted else "done"
    logger.print(f"{what}: steps {start_step + 1}-{start_step + ran} in {elapsed:.1f}s, loss {summary['first_loss']:.3f} -> "
                 f"{summary['final_loss']:.3f} (mean of first/last {k}), {summary['tokens_per_s']:,.0f} tok/s, "
                 f"{f'{guard.skipped} step(s) skipped (non-finite), ' if guard.skipped else ''}"
                 f"logs in {run_dir}")
    dist.destroy_process_group()
    return summary
