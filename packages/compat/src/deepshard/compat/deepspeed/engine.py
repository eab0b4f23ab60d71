"""``DeepSpeedEngine``: DeepSpeed's engine calls on top of core's ``Engine`` (public API only).

DeepSpeed's contracts kept: ``step()`` is called after every micro-batch and updates on the
accumulation boundary; ``backward(loss)`` takes the micro-batch's *mean* loss (HF models' ``.loss``)
and divides it by ``gradient_accumulation_steps``, ranks averaged (a mean of means).  The exact
token-weighted loss is one keyword away: ``n = engine.global_num_items(local_valid_tokens)`` once per
step, then ``engine.backward(loss_sum, num_items=n)`` (README, "As a library").
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deepshard.core import Engine
from deepshard.core.checkpoint.async_save import AsyncCheckpointer
from deepshard.core.checkpoint.json_state import rng_state, set_rng_state
from deepshard.core.mesh import local_device
from deepshard.core.optim import StepStats

from .checkpoint import full_state_dict, load_ds_style, rank0_tag, save_16bit, save_ds_style
from .config import CompatConfig
from .ds_files import check_tag
from .queries import DeepSpeedQueries, ModuleAttributes
from .schedule import load_group_rate, load_scheduler_state, scheduler_state, step_scheduler
from .timer import ThroughputTimer


class DeepSpeedEngine(ModuleAttributes, nn.Module, DeepSpeedQueries):
    """What DeepSpeed users call on ``model_engine``; ``.engine`` is the deepshard Engine underneath.
    DeepSpeed's config queries (``fp16_enabled()``...) come from :class:`DeepSpeedQueries`."""

    def __init__(self, engine: Engine, config: CompatConfig, ds_config: dict | None = None,
                 lr_scheduler: Any = None) -> None:
        super().__init__()
        self.engine = engine
        self.module = engine.model
        self.compat = config
        self.config = dict(ds_config or {})  # the ds_config as a dict (DeepSpeed keeps what it was given)
        self.lr_scheduler = lr_scheduler  # a client scheduler (stepped on applied updates), else the config's view
        self.tput_timer = ThroughputTimer(batch_size=config.train_batch_size)
        self.global_steps = 0  # optimizer boundaries passed (DeepSpeed counts skipped fp16 steps too)
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._writer: AsyncCheckpointer | None = None  # asynchronous saves (checkpoint.writer.decoupled)
        self._boundary: bool | None = None  # set_gradient_accumulation_boundary's (accelerate's), else counted

    # --- identity and batch arithmetic
    @property
    def world_size(self) -> int:
        return self.engine.mesh["dp"].size()

    @property
    def dp_world_size(self) -> int:
        return self.world_size

    def is_gradient_accumulation_boundary(self) -> bool:
        """True for the micro-batch whose ``step()`` will update (DeepSpeed's definition)."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.compat.grad_accum == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's (accelerate calls it before each backward, and ``step()`` only on a boundary): the
        caller decides; an epoch's short last accumulation updates with the micro-batches it had."""
        self._boundary = bool(is_boundary)
        core, accum = self.engine, self.compat.grad_accum
        if is_boundary and (core.micro_step + 1) % accum:
            core.micro_step += accum - 1 - core.micro_step % accum

    def empty_partition_cache(self) -> None:
        """Release gathered ZeRO-3 parameters (FSDP2 reshards every unit) and the allocator's cache."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, **kwargs: Any) -> Any:
        """The module's (an HF model's) own, with ``use_reentrant=False`` (reentrant checkpointing under
        FSDP2 and our gradient hooks trains silently wrong, so True is refused)."""
        enable = getattr(self.module, "gradient_checkpointing_enable", None)
        if enable is None:
            raise AttributeError(f"{type(self.module).__name__} has no gradient_checkpointing_enable; use the "
                                 f"ds_config's activation_checkpointing section")
        ckpt = {"use_reentrant": False, **(gradient_checkpointing_kwargs or {})}
        if ckpt["use_reentrant"]:
            raise ValueError("gradient_checkpointing_enable(use_reentrant=True): not supported (it trains silently "
                             "wrong under ZeRO's gradient hooks); use use_reentrant=False")
        return enable(gradient_checkpointing_kwargs=ckpt, **kwargs)

    def compile(self, backend: str = "inductor", compile_kwargs: dict | None = None, schedule: Any = None,
                **kwargs: Any) -> None:
        """DeepSpeed's ``engine.compile()``: here ``torch.compile`` of each block (fullgraph, inductor),
        ZeRO's collectives staying in their hooks around the blocks.  DeepCompile's ``schedule`` (its
        graph passes) is refused, with the reason, as the ds_config's ``deepcompile`` is."""
        from deepshard.compat.deepspeed import find_blocks
        from deepshard.compat.ds_compile import DEEPCOMPILE_REFUSED
        from deepshard.core.compile import apply_compile

        if schedule is not None:
            raise ValueError(f"engine.compile(schedule=...): {DEEPCOMPILE_REFUSED}")
        if backend != "inductor":
            raise ValueError(f"engine.compile(backend={backend!r}): only 'inductor' is supported")
        if compile_kwargs or kwargs:
            raise ValueError(f"engine.compile(compile_kwargs={compile_kwargs or kwargs!r}): not supported; blocks "
                             "compile with fullgraph=True and inductor's defaults")
        blocks = find_blocks(self.module)
        if len(blocks) == 0:
            raise ValueError(f"engine.compile(): model={type(self.module).__name__} has no nn.ModuleList of blocks "
                             "to compile; compile inside the model instead")
        apply_compile(blocks)
        self._compiled = True

    @property
    def is_compiled(self) -> bool:
        """DeepSpeed's: whether the model's blocks are compiled (``compile()`` or the config's compile)."""
        return bool(self.__dict__.get("_compiled")) or self.engine.config.compile

    def train_batch(self, data_iter: Any = None) -> Any:
        raise ValueError("engine.train_batch(): the pipeline engine's call; build the model as "
                         "deepspeed.pipe.PipelineModule(layers=[...], num_stages=N) to get it, or use "
                         "loss = engine(batch); engine.backward(loss); engine.step()")

    def eval_batch(self, data_iter: Any = None, **kwargs: Any) -> Any:
        raise ValueError("engine.eval_batch(): the pipeline engine's call; build the model as "
                         "deepspeed.pipe.PipelineModule, or run engine.eval() and engine(batch) under torch.no_grad()")


    @property
    def optimizer(self) -> Any:
        return self.engine.optimizer

    @property
    def last_stats(self) -> StepStats | None:
        return self.engine.last_stats

    # --- the loop
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.module.training:
            self.tput_timer.start()
        out = self.engine(*args, **kwargs)
        if not torch.is_grad_enabled():  # no backward will reshard: release what the forward gathered, as
            release_gathered(self.module)  # DeepSpeed does (every rank then reads ds_status NOT_AVAILABLE)
        return out

    def global_num_items(self, local_count: int | torch.Tensor) -> torch.Tensor:
        return self.engine.global_num_items(local_count)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True, *,
                 num_items: torch.Tensor | float | None = None) -> torch.Tensor:
        """DeepSpeed's contract (mean loss, divided by the accumulation steps); ``num_items``: ours."""
        if retain_graph:
            raise ValueError("backward(retain_graph=True): not supported (each micro-batch is backpropagated once)")
        if not scale_wrt_gas and num_items is None:
            loss = loss * self.compat.grad_accum  # the engine divides by the accumulation steps
        self.engine.backward(loss, num_items=num_items)
        # until the next engine.backward, a backward through this module (DeepSpeedExamples' GAN: the
        # generator's loss through the discriminator) leaves local gradients, reduced by nothing, as
        # in DeepSpeed; the script's module.zero_grad() then drops them
        self.engine.stage.set_grad_sync(False)
        return loss

    def step(self) -> None:
        """Call after every micro-batch: updates (and advances the LR schedule) on the boundary."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        self.global_samples += self.compat.micro_batch_size * self.world_size
        if boundary:
            stats = self.engine.step()
            assert stats is not None, "the core engine's accumulation count disagrees with micro_steps"
            self.global_steps += 1
            self.skipped_steps += 0 if stats.applied else 1
            if stats.applied and getattr(self.lr_scheduler, "optimizer", None) is not None:  # a client's
                step_scheduler(self.lr_scheduler)  # after the update, as DeepSpeed orders them
        self.tput_timer.stop(global_step=boundary)

    def zero_grad(self) -> None:
        """Gradients are cleared by every update; between micro-batches they must accumulate."""
        if self.micro_steps % self.compat.grad_accum == 0 and self.engine.micro_step % self.compat.grad_accum == 0:
            self.engine.stage.zero_grad()

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        self.module.train(mode)
        return self

    def eval(self) -> DeepSpeedEngine:
        return self.train(False)

    def sync_masters_from_params(self, params: list[nn.Parameter]) -> None:
        """zero.GatheredParameters(modifier_rank=...) changed weights: the fp32 masters follow."""
        mine = {id(p) for p in self.module.parameters()}
        if any(id(p) in mine for p in params):
            sync_masters(self.engine)

    # --- checkpoints
    def counters(self) -> dict[str, int]:
        return {"global_steps": self.global_steps, "global_samples": self.global_samples,
                "micro_steps": self.micro_steps, "skipped_steps": self.skipped_steps}

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None,
                        client_state: dict | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """``save_dir/tag/`` (default tag ``global_stepN``) and, with ``save_latest``, ``save_dir/latest``.

        ``client_state`` must be JSON (DeepSpeed pickles it; our checkpoints execute nothing on load).
        ``exclude_frozen_parameters`` (transformers passes it for PEFT models): the trained parameters and
        their optimizer state only; ``load_checkpoint(load_module_strict=False)`` restores them.
        """
        source = f"save_checkpoint({str(save_dir)!r})"
        tag = check_tag(rank0_tag(str(tag or f"global_step{self.global_steps}"), source, self.compat.tag_validation),
                        source)
        writer = None
        if self.compat.async_save:
            self.wait_for_checkpoint()  # one save in flight at a time (DeepSpeed's decoupled writer commits too)
            writer = self._async_writer()
        save_ds_style(self.engine, Path(save_dir), str(tag), client_state=dict(client_state or {}),
                      counters=self.counters(), save_latest=save_latest, extra=scheduler_state(self.lr_scheduler),
                      writer=writer, exclude_frozen=exclude_frozen_parameters)
        return True

    def _async_writer(self) -> AsyncCheckpointer:
        """Made at the first asynchronous save (every rank reaches it: it creates the writer's gloo group)."""
        if self._writer is None:
            self._writer = AsyncCheckpointer(device=local_device())
            atexit.register(_finish_at_exit, self._writer)  # the writer, not the engine: gone by then
        return self._writer

    def wait_for_checkpoint(self) -> str | None:
        """Block until the asynchronous save in flight (ds_config ``checkpoint.writer.decoupled: true``) is
        sealed on every rank, and ``latest`` names it; its path, or None when none was in flight.  Raises
        its CheckpointSaveError (one line) if it failed.  Call it on every rank (it ends with a barrier).

        ``save_checkpoint``, ``load_checkpoint``, ``destroy`` and interpreter exit call it; so should code
        that reads a checkpoint directory this engine may still be writing (e.g. a Trainer's rotation)."""
        if self._writer is None or not self._writer.in_flight:
            return None
        outcome = self._writer.wait()
        torch.distributed.barrier()
        assert outcome is not None
        if outcome.error is not None:
            raise outcome.error
        return str(outcome.path)

    def destroy(self) -> None:
        """DeepSpeed's ``engine.destroy()``: here, finish the asynchronous save in flight."""
        self.wait_for_checkpoint()

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, dict | None]:
        """``(path, client_state)``; ``(None, None)`` when ``load_dir`` holds no checkpoint (DeepSpeed's
        answer).  ``load_dir`` may also be one of our checkpoints (``ds_import``'s output).
        ``load_module_strict=False``: a checkpoint saved with ``exclude_frozen_parameters`` restores the
        trained parameters and leaves the frozen ones as they are (DeepSpeed's meaning)."""
        self.wait_for_checkpoint()
        # DeepSpeed's load leaves the process's RNGs alone (core's restores the saved ones): a script that
        # draws its data from them after loading (HelloDeepSpeed's numpy masks) gets what it gets there
        generators = rng_state()
        found = load_ds_style(self.engine, Path(load_dir), tag,
                              optimizer_states=load_optimizer_states and not load_module_only,
                              lr_scheduler_states=load_lr_scheduler_states and not load_module_only,
                              strict=load_module_strict)
        set_rng_state(generators)
        if found is None:
            return None, None
        path, app = found
        for key, value in app.get("counters", {}).items():
            setattr(self, key, int(value))
        if load_optimizer_states and not load_module_only:  # DeepSpeed's order: the optimizer, then the scheduler
            load_group_rate(self.engine.optimizer, app)
        if load_lr_scheduler_states and not load_module_only:
            load_scheduler_state(self.lr_scheduler, app)
        if self.global_rank == 0:  # one line, so a job restarted by its launcher says where it resumed
            print(f"deepshard.compat: resumed from {path} at step {self.global_steps}", file=sys.stderr, flush=True)
        return str(path), app.get("client_state", {})

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """DeepSpeed's query of ``zero_optimization.stage3_gather_16bit_weights_on_model_save`` (accelerate
        and transformers save the consolidated weights only when it is set, as with DeepSpeed)."""
        zero = self.config.get("zero_optimization") or {}
        return bool(zero.get("stage3_gather_16bit_weights_on_model_save", zero.get(
            "gather_16bit_weights_on_model_save",  # DeepSpeed's field name, which its config takes too
            zero.get("stage3_gather_fp16_weights_on_model_save", False))))

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """DeepSpeed's: the full state dict in the compute dtype on rank 0 (ZeRO-3 shards gathered; every
        rank takes part), empty on the others.  transformers' save and accelerate's ``get_state_dict``."""
        return full_state_dict(self.module, exclude_frozen=exclude_frozen_parameters)

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The full model in its compute dtype on rank 0 (ZeRO-3 shards gathered): ``.bin`` is a torch
        state dict, ``.safetensors`` a safetensors file."""
        save_16bit(self.module, Path(save_dir) / save_filename, exclude_frozen=exclude_frozen_parameters)
        return True


def release_gathered(module: nn.Module) -> None:
    """Reshard the ZeRO-3 units FSDP2 keeps gathered after a forward (the root and the last block wait for
    a backward).  Without it a later rank-local ``state_dict()`` (DeepSpeed-Chat's ``save_hf_format`` on
    rank 0) reshards one rank only, and scripts that gather by ``p.ds_status`` deadlock."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def sync_masters(engine: Engine) -> None:
    """The optimizer's fp32 masters from the current parameter shards (after an outside change)."""
    store = engine.optimizer.store
    state = store.state_dict()
    masters = [p.detach().float() for p in engine.stage.local_params()]
    store.load_state_dict({"master": masters, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]})


def _finish_at_exit(writer: AsyncCheckpointer) -> None:
    """At interpreter exit (or a launched worker's end) a save still being written is finished: its thread
    is a daemon and would die with the process, leaving the checkpoint unsealed."""
    if not writer.in_flight:
        return
    outcome = writer.wait()
    if outcome is not None and outcome.error is not None:
        print(f"error: the asynchronous checkpoint in flight at exit was not sealed: {outcome.error}", file=sys.stderr)
