"""The training recipe: one rank's training loop, the same code for 1 or N ranks and for every layout.

:class:`TrainingLoop` holds what ``assemble`` built and runs named steps: ``forward_backward_step``,
``optimizer_step``, ``log``, ``check``, ``evaluate``, ``checkpoint``.  The engine (ZeRO and TP) and
the pipeline sit behind the steppers' one protocol (``steppers.py``), so the loop in :meth:`fit`
never asks which it holds.  ``step_hooks`` run at the start of every step: the seam through which
tests inject faults (``faults.py``) without a line of test code in the loop.

Tokens/s and MFU count the positions each step's batches really carried (``steppers.computed_positions``,
summed over the dp ranks inside the loss's own all-reduce, so every step's figure is the whole job's
and no collective is added): with ``data.pad_to_multiple_of`` the batches are shorter than
``data.seq_len`` and so are the counts; with packed or full-length rows they equal
``Settings.tokens_per_step``.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from deepshard.core.compile import compile_stats
from deepshard.core.mesh import local_device
from deepshard.finetune.recipe.checkpointing import RunCheckpoints
from deepshard.finetune.recipe.divergence import DivergenceGuard, TrainingDiverged
from deepshard.finetune.recipe.evaluate import evaluate
from deepshard.finetune.recipe.metrics import RunLogger, memory_line, memory_scalars
from deepshard.finetune.recipe.mfu import StepFlops
from deepshard.finetune.recipe.profiling import StepProfiler
from deepshard.finetune.recipe.sample import greedy_sample
from deepshard.finetune.recipe.steppers import EngineStepper, PipelineStepper, StepOutput
from deepshard.launch.heartbeat import Heartbeat


@dataclass(frozen=True)
class SampleConfig:
    """The greedy sample at the end of a run (``train.sample_prompt``; none when ``prompt`` is empty)."""

    prompt: str | None = None
    num_tokens: int = 16
    max_seq_len: int = 2048
    chat_template: str | None = None  # data=chat: the prompt is a user turn rendered by it


@dataclass
class TrainingLoop:
    """One rank's training, built by :func:`deepshard.finetune.recipe.assemble.assemble`; ``fit()`` runs it."""

    train: Any  # the config's train section (max_steps, log_every, eval_every)
    every_steps: int  # checkpoint.every_steps: when a save is due (the checkpointer decides the rest)
    stepper: EngineStepper | PipelineStepper
    batches: Any  # the resumable batch stream
    eval_set: Dataset | None
    ckpt: RunCheckpoints
    logger: RunLogger
    prof: StepProfiler
    beat: Heartbeat
    guard: DivergenceGuard
    tokenizer: Any
    sample: SampleConfig
    start_step: int
    world: int
    run_dir: str
    zero_stage: int
    step_hooks: Sequence[Callable[[int, Any], None]] = ()
    compiled: bool = False  # compile=true: the compile cost and recompiles are logged
    flops: StepFlops | None = None  # the model's FLOPs count (assemble.model_flops); None: no MFU
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)  # positions computed per step, all dp ranks
    step_flops: list[int] = field(default_factory=list)  # this rank's model FLOPs per step
    graphs_after_first: int = 0  # graphs compiled by the end of the first step (the rest are recompiles)
    evals: dict[str, float] = field(default_factory=dict)

    @property
    def engine(self):
        return self.stepper.engine

    def fit(self) -> dict:
        """The steps from the resumed one to ``train.max_steps``, then the summary (same on every rank)."""
        t = self.train
        start = time.perf_counter()
        for step in range(self.start_step + 1, t.max_steps + 1):
            last = step == t.max_steps
            step_start = time.perf_counter()
            self.begin_step(step)
            loss = self.forward_backward_step()
            memory = self.engine.memory()["measured"] if step == self.start_step + 1 else None
            tokens, attended = self.stepper.step_counts()
            flops = self.flops.per_rank(tokens, attended) if self.flops is not None else 0
            out = StepOutput(loss, self.optimizer_step(), memory, tokens=tokens, flops=flops)
            self.log(step, out, time.perf_counter() - step_start)
            self.check(step, out, last=last)
            if self.eval_set is not None and ((t.eval_every and step % t.eval_every == 0) or last):
                self.evaluate(step)
            if self.checkpoint(step, last=last):  # preempted (SIGTERM/SIGINT): saved, or withheld; stop
                break
        return self.finish(time.perf_counter() - start)

    def begin_step(self, step: int) -> None:
        self.prof.begin_step(step)
        self.beat.mark("forward", step)
        for hook in self.step_hooks:
            hook(step, self.engine.model)

    def forward_backward_step(self) -> float:
        """Every micro-batch of the step, forward and backward (the engine's accumulation, or the
        pipeline's schedule); the step's token-weighted loss."""
        return self.stepper.forward_backward(self.batches).item()

    def optimizer_step(self):
        """Clip, update and re-gather (ZeRO); the step's stats (lr, grad norm, applied, param norm)."""
        return self.stepper.step()

    def log(self, step: int, out: StepOutput, seconds: float) -> None:
        """TensorBoard scalars, the progress bar, and a line every ``train.log_every`` steps."""
        logger, stats = self.logger, out.stats
        self.losses.append(out.loss)
        self.step_seconds.append(seconds)
        self.step_tokens.append(out.tokens)
        self.step_flops.append(out.flops)
        tok_s = out.tokens / seconds
        logger.scalars(step, self.prof.end_step(step, seconds, out.flops))
        mfu = f"  mfu {self.prof.mfu:.1%}" if self.prof.mfu is not None else ""
        if self.compiled:
            self.log_compile(step, seconds)
        if out.memory is not None:  # every rank's model state and, on CUDA, device peaks (one all-gather)
            mem = memory_scalars(out.memory, world=self.world, device=local_device())
            logger.scalars(step, mem)
            if (line := memory_line(mem, self.world)) is not None:
                logger.print(line)
        logger.scalars(step, {"train/loss": out.loss, "train/perplexity": math.exp(min(out.loss, 50.0)),
                              "train/lr": stats.lr, "train/grad_norm": stats.grad_norm,
                              "train/loss_scale": stats.loss_scale, "train/tokens_per_s": tok_s,
                              "train/tokens": out.tokens,
                              "train/step_applied": float(stats.applied), "train/skipped_steps": self.guard.skipped})
        if stats.param_norm is not None:  # under a deferred update (NVMe params): at the step it measures
            logger.scalars(stats.param_norm_step or step, {"train/param_norm": stats.param_norm})
        if (moe := getattr(self.engine.model, "router_stats", None)) is not None:  # MoE: rank 0's last micro-batch
            logger.scalars(step, moe.scalars())
        logger.progress({"loss": f"{out.loss:.3f}", "tok/s": f"{tok_s:,.0f}"})
        if step % self.train.log_every == 0 or step == self.train.max_steps:
            logger.print(f"step {step:>5}  loss {out.loss:.4f}  lr {stats.lr:.2e}  grad_norm {stats.grad_norm:.3f}"
                         f"  scale {stats.loss_scale:g}  tok/s {tok_s:,.0f}{mfu}")

    def log_compile(self, step: int, seconds: float) -> None:
        """compile=true: the first step's compile cost once, then every step's graph and recompile counts."""
        c = compile_stats()
        if step == self.start_step + 1:
            self.graphs_after_first = c.graphs
            self.logger.print(f"compile: {c.graphs} graph(s) in {c.compile_s:.1f}s of inductor, first step "
                              f"{seconds:.1f}s (cache: {os.environ.get('TORCHINDUCTOR_CACHE_DIR', 'default')})")
        self.logger.scalars(step, {"compile/graphs": c.graphs, "compile/seconds": c.compile_s,
                                   "compile/recompiles": c.graphs - self.graphs_after_first})

    def check(self, step: int, out: StepOutput, *, last: bool) -> None:
        """``train.max_bad_steps`` bad steps in a row (non-finite, or a blown-up state) stop the run
        (TrainingDiverged), and so does a bad last step."""
        s = out.stats
        norm, of = s.param_norm, s.param_norm_step
        if s.applied and of is not None and (last or (self.every_steps and step % self.every_steps == 0)):
            norm, of = self.engine.optimizer.measured_norm(settle=True)  # NVMe params: this step's update, before a save
        try:
            self.guard.check(step, out.loss, applied=s.applied, loss_scale=s.loss_scale, param_norm=norm,
                             param_norm_step=of, newest_checkpoint=self.ckpt.newest_good or "none written yet",
                             last=last)
        except TrainingDiverged:
            self.logger.close()
            raise

    def evaluate(self, step: int) -> None:
        """The held-out loss over every rank's slice, through the same stepper."""
        self.beat.mark("eval", step)
        dp = self.engine.mesh["dp"]
        self.evals = evaluate(self.stepper, self.eval_set, dp_rank=dp.get_local_rank(), dp_size=dp.size(),
                              group=dp.get_group(), device=local_device())
        self.logger.scalars(step, self.evals)
        self.logger.print(f"eval  {step:>5}  loss {self.evals['eval/loss']:.4f}  "
                          f"perplexity {self.evals['eval/perplexity']:.2f}")

    def checkpoint(self, step: int, *, last: bool) -> bool:
        """Tokens and SIGTERM/SIGINT every step; a save when due, never during bad steps (it may be the
        diverged state).  True: preempted, stop now."""
        if last or (self.every_steps and step % self.every_steps == 0):
            self.beat.mark("checkpoint", step)
            self.logger.flush()  # the steps a resume from this checkpoint will not replay stay logged
        stop = self.ckpt.after_step(step, last=last, bad_steps=self.guard.streak, tokens=self.step_tokens[-1])
        for saved, scalars in self.ckpt.timings:  # checkpoint/blocked_s, checkpoint/write_s, at the saved step
            self.logger.scalars(saved, scalars)
        self.ckpt.timings.clear()
        return stop

    def run_mfu(self) -> float | None:
        """The run's MFU: this rank's model FLOPs over the steps' time, the first step (compile, warm-up)
        left out when there are others; None without a peak (an unknown GPU and no profile.peak_tflops)."""
        skip = 1 if len(self.step_seconds) > 1 else 0
        times, flops = self.step_seconds[skip:], sum(self.step_flops[skip:])
        if not (flops and self.prof.peak > 0 and times):
            return None
        return flops / sum(times) / (self.prof.peak * 1e12)

    def finish(self, elapsed: float) -> dict:
        """Close checkpoints and logs, sample if asked, print the summary line; returns the summary."""
        losses, ckpt, guard, sample = self.losses, self.ckpt, self.guard, self.sample
        ckpt.close()
        self.beat.close()
        self.logger.close()
        ran = len(losses)
        k = max(1, min(10, ran // 2))
        summary = {"steps": self.start_step + ran, "first_loss": sum(losses[:k]) / k,
                   "final_loss": sum(losses[-k:]) / k, "losses": losses, "seconds": elapsed,
                   "tokens": sum(self.step_tokens), "tokens_per_s": sum(self.step_tokens) / max(elapsed, 1e-9),
                   "world_size": self.world,
                   "zero_stage": self.zero_stage, "run_dir": self.run_dir, **self.evals,
                   "start_step": self.start_step, "preempted": ckpt.preempted, "checkpoint": ckpt.last_saved,
                   "skipped_steps": guard.skipped, "mfu": self.run_mfu()}
        if self.compiled:
            c = compile_stats()
            summary.update(compile_graphs=c.graphs, compile_s=c.compile_s,
                           recompiles=c.graphs - self.graphs_after_first)
        if sample.prompt:  # eager even under compile: its length grows by a token per forward
            with torch.compiler.set_stance("force_eager") if self.compiled else contextlib.nullcontext():
                summary["sample"] = greedy_sample(self.stepper, self.tokenizer, sample.prompt,
                                                  num_tokens=sample.num_tokens, max_seq_len=sample.max_seq_len,
                                                  chat_template=sample.chat_template)
            self.logger.print(f"sample: {sample.prompt!r} -> {summary['sample']!r}")
        what = "preempted" if ckpt.preempted else "done"
        self.logger.print(
            f"{what}: steps {self.start_step + 1}-{self.start_step + ran} in {elapsed:.1f}s, loss "
            f"{summary['first_loss']:.3f} -> {summary['final_loss']:.3f} (mean of first/last {k}), "
            f"{summary['tokens_per_s']:,.0f} tok/s (positions computed, padding included), {mfu_text(summary['mfu'])}{compile_text(summary)}"
            f"{f'{guard.skipped} step(s) skipped (non-finite), ' if guard.skipped else ''}logs in {self.run_dir}"
            f"{unsaved(ckpt)}")
        dist.destroy_process_group()
        return summary


def mfu_text(mfu: float | None) -> str:
    return "" if mfu is None else f"MFU {mfu:.1%}, "


def compile_text(summary: dict) -> str:
    if "compile_graphs" not in summary:
        return ""
    return (f"compiled ({summary['compile_graphs']} graphs, {summary['compile_s']:.1f}s, "
            f"{summary['recompiles']} recompiles after step 1), ")


def unsaved(ckpt: RunCheckpoints) -> str:
    """The end of the summary line when the run's end was not saved: which save, why, and where the
    newest good checkpoint is (empty when it was saved)."""
    newest = f"newest good checkpoint: {ckpt.newest_good or 'none'}"
    if ckpt.withheld:
        return f"; nothing saved at the preemption (the state was not finite); {newest}"
    if ckpt.save_failed is not None:
        step, reason = ckpt.save_failed
        return f"; the final save (step {step}) failed: {reason}; {newest}"
    return ""
