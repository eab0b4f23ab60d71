"""transformers' ``Trainer`` on deepshard's engine when ``args.deepspeed`` is set.

transformers' own loop runs unchanged; the overrides only swap what it drives:

- ``create_optimizer`` builds the engine (ZeRO 0-3 and offload from the ds_config, "auto" values
  filled from the arguments) and the optimizer Trainer steps is the engine's update;
  ``create_scheduler`` reports the engine's rate; ``_wrap_model`` hands the loop the engine's
  module wrapper instead of accelerate's DDP.
- ``training_step`` backpropagates through the engine with the step's token count
  (``num_items_in_batch``): the gradient of the token sum over micro-batches and ranks divided by
  the global count, the same as one large batch.
- the engine clips and measures the gradient norm inside its step; the logs take its number.
- ``save_model`` streams HF safetensors one gathered tensor at a time (save.py); checkpoints hold the engine's sharded state
  (``checkpoint-N/global_stepN``, DeepSpeed's layout) next to transformers' trainer state and RNG.

Without ``args.deepspeed`` every method is transformers' own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers.trainer_utils import _is_peft_model

from . import auto, checkpoints
from .arguments import TrainingArguments
from .bridge import EngineOptimizer, EngineSchedule, build_engine, hf_schedule
from .save import params_in_memory, trainable_state, write_streaming


class Trainer(transformers.Trainer):
    """``transformers.Trainer``; with ``TrainingArguments(deepspeed=...)`` it trains on deepshard's engine."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ds_engine: Any = None
        self._num_training_steps = 0
        self._schedule: tuple[Any, int] | None = None  # (k -> lr, its number of steps) of the first train()
        self._pending_save: tuple[Path, Path, int | None] | None = None  # (run dir, checkpoint-N, limit)
        if not self.args.deepspeed:
            return
        if not isinstance(self.args, TrainingArguments):
            raise ValueError("Trainer(args=transformers.TrainingArguments(deepspeed=...)): use "
                             "deepshard.compat.transformers.TrainingArguments")
        if self.optimizer is not None or self.lr_scheduler is not None or self.optimizer_cls_and_kwargs:
            raise ValueError("Trainer(optimizers=...) with deepspeed=: not supported; the optimizer is the engine's "
                             "AdamW (the ds_config's optimizer section or the AdamW arguments)")

    @property
    def _on_engine(self) -> bool:
        return bool(self.args.deepspeed)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``resume_from_checkpoint=True`` takes the newest ``checkpoint-N`` that verifies (transformers
        takes the newest by name, sealed or not)."""
        if self._on_engine and resume_from_checkpoint is True:
            found = checkpoints.newest_good(self.args.output_dir)
            if found is None:
                raise ValueError(f"resume_from_checkpoint=True: no checkpoint-N in {self.args.output_dir} verifies")
            resume_from_checkpoint = str(found)
        out = super().train(resume_from_checkpoint, *args, **kwargs)
        if self._on_engine:
            self.seal_pending_save()  # train() returns with its last checkpoint sealed
        return out

    # --- building the engine in place of the optimizer, scheduler and accelerate's wrapping
    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        self._num_training_steps = max_steps  # the engine's schedule and the ds_config's "auto" need it
        prepared = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if self._on_engine:
            self._schedule_from(max_steps)
        return prepared

    def _schedule_from(self, max_steps: int) -> None:
        """The schedule counts this ``train()`` call's steps, as transformers' new scheduler per call
        does: a later call on the same Trainer keeps the weights and Adam's moments and step count
        (transformers keeps its optimizer) and restarts the rate at step 0 (``state.global_step``,
        or the resumed checkpoint's)."""
        opt = self.ds_engine.engine.optimizer
        if self._schedule is None:  # the first call: the schedule build_engine made for max_steps
            self._schedule = (opt.lr_at, max_steps)
        base, steps = self._schedule
        if steps != max_steps:
            if "scheduler" in auto.read(self.args.deepspeed):
                raise ValueError(f"Trainer.train() again with {max_steps} steps (the first call had {steps}): the "
                                 f"ds_config's scheduler section was filled for {steps}; build a new Trainer")
            base = hf_schedule(self.args, self.ds_engine.engine.config.optim.lr, max_steps)
        offset = opt.num_updates - self.state.global_step  # updates made before this call's step 0
        opt.lr_at = base if offset == 0 else (lambda k: base(k - offset))

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if not self._on_engine:
            return super().create_optimizer(model)
        if self.ds_engine is None:
            self.ds_engine = build_engine(self.args, self.model, world_size=self.args.world_size,
                                          num_training_steps=self._num_training_steps,
                                          decay_names=self.get_decay_parameter_names(self.model))
            self.optimizer = EngineOptimizer(self.ds_engine.engine, counters=self.ds_engine)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        if not self._on_engine:
            return super().create_scheduler(num_training_steps, optimizer)
        self.lr_scheduler = EngineSchedule(self._engine_optimizer())
        self._created_lr_scheduler = True
        return self.lr_scheduler

    def _engine_optimizer(self) -> EngineOptimizer:
        opt = self.optimizer
        while not isinstance(opt, EngineOptimizer):  # accelerate's AcceleratedOptimizer wraps it
            opt = opt.optimizer
        return opt

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if self._on_engine and self.ds_engine is not None:
            return self.ds_engine  # forward through the engine; never accelerate's DDP
        return super()._wrap_model(model, training, dataloader)

    # --- one micro-batch
    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        if not self._on_engine:
            return super().training_step(model, inputs, num_items_in_batch)
        engine = self.ds_engine.engine
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        accum = engine.config.grad_accum
        if self.accelerator.gradient_state.sync_gradients and (engine.micro_step + 1) % accum:
            engine.micro_step += accum - 1 - engine.micro_step % accum  # an epoch's short last accumulation
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or \
                self.compute_loss_func is not None
        if scaled and num_items_in_batch is not None:
            # compute_loss gave this rank's token sum / the step's count (times the world size when the
            # count is global): hand the engine the sum and the global count
            count = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=loss.device)
            if self.args.average_tokens_across_devices:
                engine.backward(loss * count / self.accelerator.num_processes, num_items=count)
            else:
                engine.backward(loss * count, num_items=engine.global_num_items(count))
            return loss.detach()
        engine.backward(loss)  # a mean per micro-batch: DeepSpeed's mean of means
        return loss.detach() / self.current_gradient_accumulation_steps

    # --- the engine clips and measures the norm inside its step
    def _clip_grad_norm(self, model: nn.Module) -> Any:
        return None if self._on_engine else super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        return None if self._on_engine else super()._get_grad_norm(model, grad_norm)

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, grad_norm: Any, *args: Any, **kwargs: Any) -> None:
        if self._on_engine and self.ds_engine is not None and self._engine_optimizer().last is not None:
            grad_norm = self._engine_optimizer().last.grad_norm
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    # --- saving and resuming
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """HF safetensors that ``from_pretrained`` loads, gathered one tensor at a time (never the whole
        model on one rank); a PEFT model writes its adapter (its trainable tensors, gathered)."""
        if not (self._on_engine and self.ds_engine is not None):
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.ds_engine.engine.gather_params()
        with params_in_memory(getattr(self.ds_engine, "offload_params", None)):  # NVMe params: read back first
            if _is_peft_model(self.model):
                self._save(output_dir, state_dict=trainable_state(self.model, is_main=self.args.should_save))
            else:  # transformers writes config, generation config, tokenizer, arguments; then the weights stream
                self._save(output_dir, state_dict={})
                write_streaming(self.model, output_dir, is_main=self.args.should_save)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """transformers' save with its rotation replaced by ours (checkpoints.py): the newest
        ``save_total_limit`` that verify are kept, only our own ``checkpoint-N`` are removed."""
        if not self._on_engine:
            return super()._save_checkpoint(model, trial)
        self.seal_pending_save()  # the previous asynchronous save, before this one starts
        limit = self.args.save_total_limit
        self.args.save_total_limit = None  # transformers' rotation counts directories, good or not
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        run_dir = Path(self._get_output_dir(trial=trial))
        self._pending_save = (run_dir, run_dir / f"checkpoint-{self.state.global_step}", limit)
        if not getattr(getattr(self.ds_engine, "compat", None), "async_save", False):
            self.seal_pending_save()

    def seal_pending_save(self) -> None:
        """Wait for the engine's asynchronous save in flight (ds_config ``checkpoint.writer.decoupled``;
        every rank; its failure is raised as one line), then rotate: a checkpoint counts for
        ``save_total_limit`` only once it is sealed.  Runs at the next save and at the end of ``train()``."""
        if self._pending_save is None:
            return
        run_dir, written, limit = self._pending_save
        self._pending_save = None
        wait = getattr(self.ds_engine, "wait_for_checkpoint", None)
        if wait is not None:
            wait()
        if self.args.should_save and limit:
            checkpoints.rotate(run_dir, limit, keep=written, protect=[self.state.best_model_checkpoint])

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._on_engine:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.ds_engine.save_checkpoint(output_dir, tag=f"global_step{self.state.global_step}")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._on_engine:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path, _ = self.ds_engine.load_checkpoint(checkpoint)
        if path is None:
            raise ValueError(f"resume_from_checkpoint={checkpoint}: no engine state (global_stepN/) in it")

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if self._on_engine:  # the engine's state (params, masters, Adam) loads once the engine exists
            if not Path(resume_from_checkpoint, "latest").is_file():
                raise ValueError(f"resume_from_checkpoint={resume_from_checkpoint}: not a deepshard checkpoint-N "
                                 f"(no 'latest' file)")
            return None
        return super()._load_from_checkpoint(resume_from_checkpoint, model)
