"""The training recipe: one worker's whole life, the same code for 1 or N ranks."""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
from torch.utils.data import Dataset

from deepshard.core import build_mesh, init_distributed, initialize
from deepshard.core.heartbeat import Heartbeat
from deepshard.core.launch import worker_threads
from deepshard.core.mesh import local_device
from deepshard.finetune.checkpointing import agree_run_dir, start_checkpointing
from deepshard.finetune.config import Settings
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
from deepshard.finetune.steppers import EngineStepper, PipelineStepper, StepOutput
from deepshard.offload import make_store_factory, param_offload

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


def _materializer(s: Settings, offload_params: object):
    """The ZeRO-3 init; with offload.params=nvme through the swap, which writes each block to NVMe
    as soon as it is initialized (the model is never whole in memory)."""
    init = lambda m: init_model(m, s)  # noqa: E731
    return offload_params.materializer(init) if hasattr(offload_params, "materializer") else init


def build_stepper(s: Settings, mesh, *, rank: int, pad_id: int = 0) -> EngineStepper | PipelineStepper:
    """The engine (ZeRO on dp, TP on tp) or the pipeline trainer (pp > 1), each assembled by the one
    recipe (``parallelize_llama``), wrapped as a stepper."""
    from deepshard.finetune.models.parallelize import llama_stage_init, parallelize_llama, pipeline_llama

    device = local_device()
    store_factory = make_store_factory(s.offload, rank, run_id())
    offload_params = param_offload(s.offload, store_factory)  # False, True (cpu) or the NVMe param swap
    t = s.train
    if s.uses_pipeline:
        model = build_model(s, device, materialize=False)  # on meta (+peft=lora: with its adapters)
        p = s.pipeline
        # each stage copies its part of the full model as the engine path builds it (HF weights, seeded
        # init, adapters): the stages together equal the unsplit model
        init_fn = llama_stage_init(t.seed, full=lambda: build_model(s, torch.device("cpu")))
        trainer = pipeline_llama(model, mesh, s.engine, schedule=p.schedule, microbatches=s.micro_batches_per_step,
                                 partition=p.partition, virtual_stages=p.virtual_stages or None,
                                 init_fn=init_fn, store_factory=store_factory,
                                 offload_params=offload_params, device=device)
        return PipelineStepper(trainer, mesh, microbatches=s.micro_batches_per_step, device=device,
                               micro_batch_size=t.micro_batch_size, seq_len=s.data.seq_len, pad_id=pad_id)
    sharded_init = s.engine.zero.stage == 3  # no rank ever holds the whole model (DeepSpeed's zero.Init)
    e = s.engine
    recipe = partial(parallelize_llama, mesh=mesh, zero=e.zero, dtype=e.precision.dtype, ac=e.ac,
                     offload_params=offload_params)
    engine = initialize(build_model(s, device, materialize=not sharded_init), e, mesh=mesh,
                        parallelize_fn=recipe, store_factory=store_factory, offload_params=offload_params,
                        materialize=_materializer(s, offload_params) if sharded_init else None)
    return EngineStepper(engine, grad_accum=t.grad_accum, device=device, micro_batch_size=t.micro_batch_size)


@dataclass
class Run:
    """Everything one rank's training needs, built once by :func:`start_run`."""

    settings: Settings
    rank: int
    world: int
    run_dir: str
    stepper: EngineStepper | PipelineStepper
    tokenizer: Any
    dataset: Any
    eval_set: Any
    ckpt: Any  # RunCheckpoints
    batches: Any  # the resumable batch stream
    start_step: int
    logger: RunLogger
    prof: Any  # StepProfiler
    beat: Heartbeat
    guard: DivergenceGuard
    eval_args: dict
    losses: list[float] = field(default_factory=list)
    evals: dict[str, float] = field(default_factory=dict)

    @property
    def engine(self):
        return self.stepper.engine


def start_run(settings: Settings, run_dir: str, datasets: tuple[Dataset, Dataset | None] | None = None) -> Run:
    """Process group, mesh, model + ZeRO (or the pipeline), data (``datasets``: the launcher's, already
    tokenized), and the resume from the newest checkpoint."""
    # torchdata 0.11 calls a torch API that 2.13 deprecated, on every epoch: known, harmless
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    rank, world = init_distributed(timeout_s=settings.launcher.timeout_s)
    if torch.cuda.is_available() and os.environ.get("OMP_NUM_THREADS") == "1":  # torchrun's default starves
        torch.set_num_threads(worker_threads(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), cuda=True))  # host Adam
    beat = Heartbeat.from_env(rank)  # step and phase, for the launcher's hang watchdog
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    run_dir = agree_run_dir(run_dir)  # under torchrun every process's Hydra stamps its own: rank 0's wins
    mesh = build_mesh(settings.parallel)
    dp = mesh["dp"]
    torch.manual_seed(settings.train.seed)
    tokenizer = load_tokenizer(settings.model_path)
    stepper = build_stepper(settings, mesh, rank=rank, pad_id=tokenizer.pad_token_id or 0)
    engine = stepper.engine
    dataset, eval_set = datasets or build_datasets(settings.data, tokenizer, settings.model.vocab_size)
    t = settings.train
    # the data position, step, weights and optimizer come back from the newest checkpoint (checkpoint.resume)
    ckpt, batches, start_step = start_checkpointing(settings, run_dir=run_dir, engine=engine, dataset=dataset,
                                                    tokenizer=tokenizer)
    logger = RunLogger(run_dir, enabled=rank == 0, total_steps=t.max_steps, initial_step=start_step,
                       tb_dir=t.tensorboard_dir)
    prof = build_profiler(settings, engine, trace_dir=os.path.join(run_dir, "profile"), rank=rank,
                          device=local_device())
    stepper.prof = BeatingProfiler(prof, beat)
    guard = DivergenceGuard.for_run(settings, engine.optimizer.scaler, say=logger.print)
    guard.reference(engine.optimizer.param_norm())  # the state it starts from (init or resumed) is good
    eval_args = {"dp_rank": dp.get_local_rank(), "dp_size": dp.size(), "group": dp.get_group(),
                 "device": local_device()}
    run = Run(settings=settings, rank=rank, world=world, run_dir=run_dir, stepper=stepper, tokenizer=tokenizer,
              dataset=dataset, eval_set=eval_set, ckpt=ckpt, batches=batches, start_step=start_step, logger=logger,
              prof=prof, beat=beat, guard=guard, eval_args=eval_args)
    logger.print(header(run))
    return run


def header(run: Run) -> str:
    """The run's first line: ranks and layout, ZeRO stage, offload, precision, parameters, data."""
    s, world = run.settings, run.world
    off = s.offload
    offload = f", offload optimizer={off.device} params={off.params}" if off.device != "none" or off.params != "none" else ""
    par = s.parallel
    split = par.pp > 1 or par.tp > 1
    layout = f" (pp {par.pp} x dp {par.dp} x tp {par.tp})" if split else ""
    params_scope = " per pp/tp rank" if split else ""  # each pp/tp rank holds a part
    return (f"deepshard: {world} rank(s){layout}, zero stage {s.engine.zero.stage}{offload}, "
            f"{s.engine.precision.dtype}, {run.engine.num_params / 1e6:.2f}M "
            f"{'trainable (LoRA) ' if s.peft else ''}params{params_scope}, "
            f"{len(run.dataset)} windows of {s.data.seq_len} tokens")


def train_loop(run: Run) -> float:
    """The steps from the resumed one to ``train.max_steps``; returns the wall seconds they took."""
    t, engine = run.settings.train, run.engine
    start = step_start = time.perf_counter()
    for step in range(run.start_step + 1, t.max_steps + 1):
        last = step == t.max_steps
        run.prof.begin_step(step)
        run.beat.mark("forward", step)
        inject_test_fault(engine.model, step)
        out = run.stepper(run.batches, measure_memory=step == run.start_step + 1)
        run.losses.append(out.loss)
        log_step(run, step, out, time.perf_counter() - step_start)
        check_divergence(run, step, out, last=last)
        if run.eval_set is not None and ((t.eval_every and step % t.eval_every == 0) or last):
            evaluate_step(run, step)
        if last or (every := run.settings.checkpoint.every_steps) and step % every == 0:
            run.beat.mark("checkpoint", step)  # (no save during a run of bad steps: it may be the diverged state)
        # tokens and SIGTERM/SIGINT every step (preempted: saved, or not during bad steps; stop)
        if run.ckpt.after_step(step, last=last, bad_steps=run.guard.streak):
            break
        step_start = time.perf_counter()
    return time.perf_counter() - start


def log_step(run: Run, step: int, out: StepOutput, seconds: float) -> None:
    """TensorBoard scalars, the progress bar, and a line every ``train.log_every`` steps."""
    s, logger, stats = run.settings, run.logger, out.stats
    tok_s = run.ckpt.tokens_per_step / seconds
    logger.scalars(step, run.prof.end_step(step, seconds))
    if out.memory is not None:  # every rank's model state and, on CUDA, device peaks (one all-gather)
        mem = memory_scalars(out.memory, world=run.world, device=local_device())
        logger.scalars(step, mem)
        if (line := memory_line(mem, run.world)) is not None:
            logger.print(line)
    logger.scalars(step, {"train/loss": out.loss, "train/perplexity": math.exp(min(out.loss, 50.0)),
                          "train/lr": stats.lr, "train/grad_norm": stats.grad_norm,
                          "train/loss_scale": stats.loss_scale, "train/tokens_per_s": tok_s,
                          "train/step_applied": float(stats.applied), "train/skipped_steps": run.guard.skipped})
    if stats.param_norm is not None:
        logger.scalars(step, {"train/param_norm": stats.param_norm})
    logger.progress({"loss": f"{out.loss:.3f}", "tok/s": f"{tok_s:,.0f}"})
    if step % s.train.log_every == 0 or step == s.train.max_steps:
        logger.print(f"step {step:>5}  loss {out.loss:.4f}  lr {stats.lr:.2e}  grad_norm {stats.grad_norm:.3f}"
                     f"  scale {stats.loss_scale:g}  tok/s {tok_s:,.0f}")


def check_divergence(run: Run, step: int, out: StepOutput, *, last: bool) -> None:
    """``train.max_bad_steps`` bad steps in a row (non-finite, or a blown-up state) stop the run
    (TrainingDiverged), and so does a bad last step."""
    try:
        s = out.stats
        run.guard.check(step, out.loss, applied=s.applied, loss_scale=s.loss_scale, param_norm=s.param_norm,
                        newest_checkpoint=run.ckpt.newest_good or "none written yet", last=last)
    except TrainingDiverged:
        run.logger.close()
        raise


def evaluate_step(run: Run, step: int) -> None:
    run.beat.mark("eval", step)
    run.evals = evaluate(run.stepper, run.eval_set, **run.eval_args)
    run.logger.scalars(step, run.evals)
    run.logger.print(f"eval  {step:>5}  loss {run.evals['eval/loss']:.4f}  "
                     f"perplexity {run.evals['eval/perplexity']:.2f}")


def finish(run: Run, elapsed: float) -> dict:
    """Close checkpoints and logs, sample if asked, print the summary line; returns the summary."""
    s, t, losses, ckpt, guard = run.settings, run.settings.train, run.losses, run.ckpt, run.guard
    ckpt.close()
    run.beat.close()
    run.logger.close()
    ran = len(losses)
    k = max(1, min(10, ran // 2))
    summary = {"steps": run.start_step + ran, "first_loss": sum(losses[:k]) / k, "final_loss": sum(losses[-k:]) / k,
               "losses": losses, "seconds": elapsed, "tokens_per_s": ckpt.tokens_per_step * ran / max(elapsed, 1e-9),
               "world_size": run.world, "zero_stage": s.engine.zero.stage, "run_dir": run.run_dir, **run.evals,
               "start_step": run.start_step, "preempted": ckpt.preempted, "checkpoint": ckpt.last_saved,
               "skipped_steps": guard.skipped}
    if t.sample_prompt:
        chat = resolve_template(run.tokenizer, s.data.chat_template) if s.data.name == "chat" else None
        summary["sample"] = greedy_sample(run.stepper, run.tokenizer, t.sample_prompt, num_tokens=t.sample_tokens,
                                          max_seq_len=s.model.max_seq_len, chat_template=chat)
        run.logger.print(f"sample: {t.sample_prompt!r} -> {summary['sample']!r}")
    what = "preempted" if ckpt.preempted else "done"
    run.logger.print(
        f"{what}: steps {run.start_step + 1}-{run.start_step + ran} in {elapsed:.1f}s, loss "
        f"{summary['first_loss']:.3f} -> {summary['final_loss']:.3f} (mean of first/last {k}), "
        f"{summary['tokens_per_s']:,.0f} tok/s, "
        f"{f'{guard.skipped} step(s) skipped (non-finite), ' if guard.skipped else ''}logs in {run.run_dir}"
        f"{unsaved(ckpt)}")
    dist.destroy_process_group()
    return summary


def unsaved(ckpt) -> str:
    """The end of the summary line when the run's end was not saved: which save, why, and where the
    newest good checkpoint is (empty when it was saved)."""
    newest = f"newest good checkpoint: {ckpt.newest_good or 'none'}"
    if ckpt.withheld:
        return f"; nothing saved at the preemption (the state was not finite); {newest}"
    if ckpt.save_failed is not None:
        step, reason = ckpt.save_failed
        return f"; the final save (step {step}) failed: {reason}; {newest}"
    return ""


def train_worker(settings: Settings, run_dir: str, datasets: tuple[Dataset, Dataset | None] | None = None) -> dict:
    """Train on this rank; returns the run's summary (identical on every rank).  ``datasets`` are the
    (train, eval) sets the launcher built in its checks; without them (torchrun) each rank builds its own."""
    try:
        run = start_run(settings, run_dir, datasets)
        elapsed = train_loop(run)
        return finish(run, elapsed)
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
