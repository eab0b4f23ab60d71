"""The app's checkpoint policy: when to save, what to resume from, and stopping cleanly on SIGTERM.

Core does the mechanism (sharded, atomic, verified DCP saves that load at any world size and
stage); this file decides the schedule (``checkpoint.every_steps``, ``keep_last``), the resume
choice (``auto`` = newest good checkpoint, a path, or ``none``), what a failed save does
(``on_error``), and what app state rides along: step, tokens seen and the world-size-independent
data position.  Retention never removes the checkpoint just written nor the newest good one;
checkpoints newer than the step resumed belong to an abandoned branch and are renamed aside.
All ranks use rank 0's run dir, and a checkpoint dir some rank cannot see stops the run early.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deepshard.core.checkpoint.async_save import AsyncCheckpointer, SaveOutcome
from deepshard.core.checkpoint.failures import CheckpointSaveError
from deepshard.core.checkpoint.manifest import (
    CheckpointError,
    latest_good,
    read_manifest,
    step_dirs,
    verify_checkpoint,
)
from deepshard.core.checkpoint.retention import prune, set_aside
from deepshard.core.checkpoint.state import (
    find_resume,
    load_checkpoint,
    save_request,
    unsupported_reason,
    write_checkpoint,
)
from deepshard.core.mesh import local_device, zero_mesh
from deepshard.core.training_engine import TrainingEngine
from deepshard.finetune.config.settings import AUTO, CheckpointConfig
from deepshard.finetune.data.resumable import ResumableStream
from deepshard.finetune.recipe import chaos
from deepshard.finetune.recipe.foreign import hf_rename, placed_after

log = logging.getLogger("deepshard.finetune")


class Preemption:
    """SIGTERM/SIGINT set a flag instead of killing: the step finishes, a checkpoint is written."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device if device is not None else local_device()  # nccl reduces device tensors only
        self.requested = False
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.requested:
            # preemption, or the launcher stopping the survivors of a failed rank (the cause then comes last)
            log.warning("received %s: finishing this step, then writing a checkpoint if every rank can",
                        signal.Signals(signum).name)
        self.requested = True

    def agreed(self) -> bool:
        """True on every rank once any rank was signalled (one tiny all-reduce per step)."""
        flag = torch.tensor([1.0 if self.requested else 0.0], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def exit_when_done(self, grace_s: float = 3.0) -> None:
        """A preempted torchelastic worker: exit once its process group is gone, plus a grace period.

        When the launcher itself was signalled it is shutting down and never collects the worker's
        result, and the worker would sit in torchelastic's wait until SIGKILLed 30 s later.  A
        healthy launcher (only the workers were signalled) collects the result within the grace.
        """
        if not (self.requested and "TORCHELASTIC_RUN_ID" in os.environ):
            return

        def watch() -> None:
            while dist.is_initialized():
                time.sleep(0.2)
            time.sleep(grace_s)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)

        threading.Thread(target=watch, daemon=True).start()


def agree_run_dir(run_dir: str) -> str:
    """Rank 0's run dir on every rank: under torchrun each process's Hydra stamps its own time."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return run_dir
    box = [run_dir]
    dist.broadcast_object_list(box, src=0)
    if box[0] != run_dir:
        log.info("run dir: using rank 0's %s (this rank's Hydra chose %s)", box[0], run_dir)
    return box[0]


def check_shared_dir(root: Path, *, key: str = "checkpoint.dir") -> None:
    """Rank 0 writes a probe file under ``root``; every rank must see it (else ValueError on all ranks).

    Every rank writes shards of each checkpoint and reads others' at resume, so a directory on a
    node-local disk would split the checkpoint; this says so before training instead of mid-save.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    box = [f".probe-{uuid.uuid4().hex[:12]}", str(root)]
    dist.broadcast_object_list(box, src=0)
    probe, named = root / box[0], box[1]  # rank 0's path names the directory in every rank's message
    error = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            probe.write_text("deepshard: every rank must see this file\n")
        except OSError as err:
            error = f"{key}={named}: cannot write there ({err})"
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, error)  # also the barrier: the probe exists before anyone looks
    seen: list[Any] = [None] * world
    dist.all_gather_object(seen, probe.is_file())
    if rank == 0:
        probe.unlink(missing_ok=True)
    if errors[0]:
        raise ValueError(errors[0])
    blind = [r for r, ok in enumerate(seen) if not ok]
    if blind:
        raise ValueError(f"{key}={named} is not visible from rank {blind[0]} (node-local disk?): use a shared "
                         f"filesystem that every node mounts at the same path")


class RunCheckpoints:
    """Resume before the loop, ``after_step`` inside it; a few lines in train.py."""

    def __init__(self, settings: CheckpointConfig, *, run_dir: str, engine: TrainingEngine, data: ResumableStream,
                 tokens_per_step: int, meta: dict[str, Any], tokenizer: Any = None) -> None:
        self.settings = settings
        self.root = Path(settings.dir or os.path.join(run_dir, "checkpoints"))
        self.engine = engine
        self.data = data
        self.tokens_per_step = tokens_per_step
        self.meta = meta
        # +peft=lora: adapters and their optimizer state only; the frozen base is rebuilt from meta["base"]
        self.model = None if "peft" in meta else engine.model
        self.tokenizer = tokenizer
        self.tokens_seen = 0
        self.last_saved: str | None = None
        self.resumed_from: str | None = None
        self.saved_step = -1
        self.save_failed: tuple[int, str] | None = None  # (step, reason) when the newest save attempt failed
        self.withheld = False  # preempted during bad steps: no save
        self.good: set[Path] = set()  # checkpoints known to verify (written or loaded by this run)
        self.bad: set[Path] = set()  # and known not to (each is verified once)
        self.preemption = Preemption(local_device())
        self.preempted = False
        self.unsupported = unsupported_reason(engine.optimizer)
        if self.unsupported:  # say so now, not after hours of training
            log.warning("checkpoint: disabled for this run, not supported yet: %s", self.unsupported)
        else:
            check_shared_dir(self.root)
        # checkpoint.async_save: made on every rank here, since it creates the writer's own process group
        self.writer = AsyncCheckpointer(device=local_device(), on_sealed=self._sealed) \
            if settings.async_save and not self.unsupported else None
        self.timings: list[tuple[int, dict[str, float]]] = []  # (step, scalars) of each save, for the logger

    def _resolve(self) -> tuple[Path | None, bool]:
        """The checkpoint to resume from, and whether it was verified already (by a search)."""
        resume = self.settings.resume
        if resume == "none" or (resume in AUTO and self.unsupported):
            return None, False
        if self.unsupported:
            raise CheckpointError(f"checkpoint.resume={resume!r}: not supported yet for {self.unsupported}")
        if resume in AUTO:
            path = find_resume(self.root)
            if path is None and not step_dirs(self.root):
                log.info("checkpoint: none under %s, starting fresh", self.root)
            elif path is None:
                self._none_usable(resume)
            return path, True
        path = Path(resume)
        if not (path / "manifest.json").exists() and step_dirs(path):
            found = find_resume(path)
            if found is None:
                raise CheckpointError(f"checkpoint.resume={resume!r}: no usable checkpoint in that folder")
            return found, True
        return path, False

    def _none_usable(self, resume: str) -> None:
        """Checkpoints under the dir, none usable: an error for ``auto`` (starting over would discard
        them silently), a warning for ``auto_or_fresh``."""
        problems = [" ".join(p.split()) for p in latest_good(self.root)[1]] if dist.get_rank() == 0 else []
        if dist.get_world_size() > 1:  # rank 0 verified them: every rank says the same
            box = [problems]
            dist.broadcast_object_list(box, src=0)
            problems = box[0]
        if resume == "auto_or_fresh":
            log.warning("checkpoint: no usable checkpoint under %s, starting fresh (checkpoint.resume=auto_or_fresh)",
                        self.root)
            return
        raise CheckpointError(f"checkpoint.resume=auto: no usable checkpoint under {self.root}: {'; '.join(problems)} "
                              f"(to start over from step 0 and set them aside: checkpoint.resume=auto_or_fresh; "
                              f"to ignore them: checkpoint.resume=none)")

    def resume(self, *, micro_batches_per_step: int = 1) -> int:
        """Restore everything from the chosen checkpoint; returns the number of steps already done."""
        chaos.before_resume()  # the chaos soak's hooks (bench/bench_chaos.py): no-ops unless its plan is set
        path, verified = self._resolve()
        step = 0
        if path is not None:
            chaos.loading(path)
            check_lora_resume(path, self.meta)  # LoRA into LoRA on the same base, full into full
            dp = zero_mesh(self.engine.mesh)  # the optimizer state's shards: over dp, or dp x sp
            rename = hf_rename(path, self.engine.optimizer.stage.names, self.meta)
            app = load_checkpoint(path, self.engine.optimizer, dp, model=self.model, verify=not verified,
                                  rename=rename, meta=self.meta)
            if "data" not in app:  # written by another front door (compat's engine, a converter)
                app = placed_after(path, self.data, int(self.engine.optimizer.num_updates),
                                   micro_batches_per_step=micro_batches_per_step,
                                   tokens_per_step=self.tokens_per_step, names_mapped=rename is not None)
            self.data.load_state_dict(app["data"])
            self.tokens_seen = int(app["tokens_seen"])
            step = self.saved_step = int(app["step"])
            self.resumed_from = str(path)
            self.good.add(path.resolve())
            log.info("checkpoint: resumed from %s at step %d (%d tokens seen)", path, step, self.tokens_seen)
        if not self.unsupported:
            self._set_aside_newer(step)
        chaos.resumed(step)
        return step

    def _set_aside_newer(self, step: int) -> None:
        """Checkpoints newer than the resumed ``step`` are a branch this run abandons: renamed aside, so
        neither ``resume=auto`` nor retention ever takes them for this run's newest."""
        if dist.get_rank() == 0:
            for old, new in set_aside(self.root, step):
                log.warning("checkpoint: %s is newer than the resumed step %d (a branch this run abandons): "
                            "renamed to %s", old, step, new.name)
        dist.barrier()

    @property
    def newest_good(self) -> str | None:
        """The newest checkpoint of this run's line: saved by it, or the one it resumed from."""
        return self.last_saved or self.resumed_from

    def after_step(self, step: int, *, last: bool, bad_steps: int = 0, tokens: int | None = None) -> bool:
        """Count tokens and check for preemption, every step; save on schedule, at the end, or on
        preemption, unless the run is in a streak of ``bad_steps`` (the state may be the diverged one:
        the newest good checkpoint stays the newest).  True: stop now (preempted, saved or not).
        With ``checkpoint.async_save`` an earlier save's outcome surfaces here, on every rank.
        ``tokens``: the positions the step computed over every dp rank (default ``tokens_per_step``,
        full-length rows): ``tokens_seen`` counts what was trained on, not the data position."""
        self.tokens_seen += self.tokens_per_step if tokens is None else tokens
        self.preempted = self.preemption.agreed()
        if self.writer is not None:
            self._outcome(self.writer.poll())
        every = self.settings.every_steps
        if not (self.preempted or last or (every and step % every == 0)):
            return False
        if bad_steps:
            if self.writer is not None and (self.preempted or last):
                self._outcome(self.writer.wait())  # the earlier save is sealed (or has failed) before exit
            if self.preempted:
                self.withheld = True
                log.warning("checkpoint: preempted after step %d: nothing saved, the state is not finite (%d bad "
                            "steps in a row); the newest good checkpoint is %s; exiting", step, bad_steps,
                            self.newest_good or "none")
            return self.preempted
        self.save(step, final=self.preempted or last)
        if self.preempted:
            log.warning("checkpoint: preempted after step %d, saved %s; exiting", step,
                        self.last_saved if not self.unsupported else "nothing (checkpoints disabled)")
        return self.preempted

    def _request(self, step: int):
        tok = self.tokenizer
        meta = dict(self.meta)
        if tok is not None:
            meta["tokenizer"] = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                                 "pad_token_id": tok.pad_token_id}
        app_state = {"step": step, "tokens_seen": self.tokens_seen, "data": self.data.state_dict()}
        return save_request(self.root, step, self.engine.optimizer, zero_mesh(self.engine.mesh), model=self.model,
                            app_state=app_state, meta=meta, write_extra=None if tok is None else self._write_tokenizer)

    def save(self, step: int, *, final: bool = True) -> Path | None:
        """Save ``step``; on failure stop (CheckpointError naming checkpoint.dir) or, with
        ``checkpoint.on_error=continue``, log one line and train on.  With ``checkpoint.async_save`` the
        state is staged and written in the background; a ``final`` save (the end, a preemption) is
        waited for."""
        if self.unsupported:
            return None
        if step == self.saved_step:
            return Path(self.last_saved or "")
        chaos.saving(step)
        if self.writer is not None:
            return self._save_async(step, final=final)
        start = time.perf_counter()
        try:
            path = write_checkpoint(self._request(step))
        except CheckpointSaveError as err:
            return self._failed(step, err)
        seconds = time.perf_counter() - start
        self._sealed(path)
        self._saved(SaveOutcome(step, path, None, seconds, seconds, 0))
        return path

    def _save_async(self, step: int, *, final: bool) -> Path | None:
        assert self.writer is not None
        go, waited = self.writer.make_room("wait" if final else self.settings.async_policy)
        self._outcome(waited)
        if not go:
            if dist.get_rank() == 0:
                log.warning("checkpoint: step %d not saved: the save of step %d is still being written "
                            "(checkpoint.async_policy=skip)", step, self.writer.writing_step)
            return None
        since = time.perf_counter()  # an NVMe store's state_dict reads its files: blocked time too
        blocked = self.writer.start(self._request(step), since=since)
        if dist.get_rank() == 0:
            log.info("checkpoint: step %d staged in %.3fs (training blocked); writing in the background", step,
                     blocked)
        if final:
            self._outcome(self.writer.wait())
        return Path(self.last_saved) if final and self.last_saved and self.saved_step == step else None

    def _outcome(self, outcome: SaveOutcome | None) -> None:
        """An asynchronous save's outcome, the same on every rank: as a synchronous save's would be."""
        if outcome is None:
            return
        if outcome.error is not None:
            self._failed(outcome.step, outcome.error)
        else:
            self._saved(outcome)

    def _failed(self, step: int, err: CheckpointSaveError) -> None:
        message = f"checkpoint.dir={self.root}: saving step {step} failed: {err.reason}"
        if self.settings.on_error == "stop":
            raise CheckpointError(message + " (checkpoint.on_error=continue would train on without it)") from None
        if dist.get_rank() == 0:
            log.warning("checkpoint: %s; training on (checkpoint.on_error=continue)", message)
        self.save_failed = (step, err.reason)

    def _sealed(self, path: Path) -> None:
        """A save is sealed (in the writer thread when asynchronous): retention, counting it as good."""
        self.good.add(path.resolve())
        if dist.get_rank() == 0:
            prune(self.root, self.settings.keep_last, keep=[path], is_good=self._is_good)

    def _saved(self, outcome: SaveOutcome) -> None:
        self.save_failed = None
        self.saved_step, self.last_saved = outcome.step, str(outcome.path)
        self.timings.append((outcome.step, {"checkpoint/blocked_s": outcome.blocked_s,
                                            "checkpoint/write_s": outcome.write_s}))
        if self.writer is not None and dist.get_rank() == 0:
            log.info("checkpoint: step %d sealed %s (%.1f MB): training blocked %.3fs, sealed %.2fs after the "
                     "request", outcome.step, outcome.path, outcome.nbytes / 1e6, outcome.blocked_s, outcome.write_s)

    def _is_good(self, path: Path) -> bool:
        if path.resolve() in self.good or path.resolve() in self.bad:
            return path.resolve() in self.good
        try:
            verify_checkpoint(path)
        except CheckpointError as err:
            log.warning("checkpoint: %s; not counted toward checkpoint.keep_last", err)
            self.bad.add(path.resolve())
            return False
        self.good.add(path.resolve())
        return True

    def _write_tokenizer(self, directory: Path) -> None:
        self.tokenizer.save_pretrained(str(directory / "tokenizer"))

    def close(self) -> None:
        if self.writer is not None:
            self._outcome(self.writer.close())
        self.preemption.restore()
        self.preemption.exit_when_done()


def start_checkpointing(settings: CheckpointConfig, *, run_dir: str, engine: TrainingEngine, data: ResumableStream,
                        tokens_per_step: int, meta: dict[str, Any], tokenizer: Any,
                        micro_batches_per_step: int) -> tuple[RunCheckpoints, int]:
    """The run's checkpointer, resumed (weights, optimizer, ``data``'s position); returns it and the steps
    already done.  ``meta`` goes into every manifest (the architecture, the config, a LoRA base)."""
    ckpt = RunCheckpoints(settings, run_dir=run_dir, engine=engine, data=data, tokens_per_step=tokens_per_step,
                          meta=meta, tokenizer=tokenizer)
    return ckpt, ckpt.resume(micro_batches_per_step=micro_batches_per_step)


def check_lora_resume(path: str | Path, meta: dict[str, Any]) -> None:
    """Before a resume loads anything: LoRA adapters resume only into a LoRA run on the same base, and a
    full checkpoint only into a full run (CheckpointError naming both sides)."""
    saved = read_manifest(path).get("meta", {})
    if ("peft" in saved) != ("peft" in meta):
        holds, runs = ("LoRA adapters only", "without +peft=lora") if "peft" in saved else \
            ("every weight (a full fine-tune)", "with +peft=lora")
        raise CheckpointError(f"checkpoint {str(path)!r} holds {holds} but this run is {runs}; resume it the way "
                              f"it was trained, or start from it another way (export, peft.init_from)")
    if "peft" in meta and saved.get("base") != meta.get("base"):
        raise CheckpointError(f"checkpoint {str(path)!r}: its adapters were trained on the base {saved.get('base')}, "
                              f"this run's base is {meta.get('base')}; resume with the same model.path and train.seed")
