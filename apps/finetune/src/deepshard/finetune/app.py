"""From a composed Hydra config to running workers: validate first, then launch or run inline.

Whatever ends a run early reaches the user as one ``RunFailed`` line (main.py prints it): a worker's
error with its rank (the tracebacks go to ``<run dir>/launcher.log``), a rank that died by a signal
or hung (the launcher's heartbeat watchdog, ``launcher.hang_s``), or a diverged run.  A second job on
the run dir or the checkpoint dir of a running one is refused before it starts anything.  A
preemption (SIGTERM/SIGINT to the launcher) ends with a line read from the disk (``preempted``): exit 1
when the workers were killed before their save was sealed.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.api import SignalException

from deepshard.core.checkpoint.plain_files import open_file
from deepshard.core.precision import LossScaleAtMinimum
from deepshard.finetune.config import Settings, validate
from deepshard.finetune.config.world import under_torchrun
from deepshard.finetune.data.tokenizer import tokenizer_modules
from deepshard.finetune.preempted import preemption_outcome
from deepshard.finetune.preflight import killed_for_memory, plan_memory
from deepshard.finetune.prelaunch import check_data_fits, check_inputs, holding_job_dirs, write_hydra_files
from deepshard.finetune.recipe.assemble import WORKER_IMPORTS, train_worker
from deepshard.finetune.recipe.divergence import TrainingDiverged
from deepshard.launch.heartbeat import read_beats
from deepshard.launch.local import JobFailed, launch_local, start_worker_server
from deepshard.launch.process_trim import trim_heap
from deepshard.offload import remove_scratch


class RunFailed(Exception):
    """The run ended early: one line for the user and the exit code (1: failed, 2: an error to fix)."""

    def __init__(self, line: str, code: int) -> None:
        super().__init__(line)
        self.code = code


DIVERGED = (TrainingDiverged, LossScaleAtMinimum)  # raised alike on every rank: the run failed, no rank to name


def _log_tracebacks(run_dir: str, traces: dict[int, str]) -> str:
    """Append the ranks' tracebacks to ``<run dir>/launcher.log`` and say where they went: to stderr when
    launcher.log is not a plain file (a planted link is never written through)."""
    path = Path(run_dir) / "launcher.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(f"--- rank {rank} ---\n{trace}\n" for rank, trace in sorted(traces.items()))
    try:
        with open_file(path, "a") as f:
            f.write(text)
    except ValueError as err:
        sys.stderr.write(text)
        return f"above, not in {err}"
    return str(path)


def _inline(settings: Settings, run_dir: str) -> dict:
    """This process is the worker (one rank, or a torchrun rank): its errors become one line too."""
    try:
        return train_worker(settings, run_dir)
    except DIVERGED as err:
        raise RunFailed(str(err), 1) from None
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - anything else: one line with the rank, traceback to the log
        rank = int(os.environ.get("RANK", 0))
        log = _log_tracebacks(run_dir, {rank: traceback.format_exc()})
        message = " ".join(str(err).split())
        raise RunFailed(f"rank {rank}: {type(err).__name__}: {message} (full traceback: {log})", 2) from None


def _failed(err: JobFailed, run_dir: str, settings: Settings, estimate: int) -> RunFailed:
    """The launcher's verdict as the user's line: diverged and dead/hung ranks exit 1, errors exit 2; a
    rank killed for memory with the estimate it was started on."""
    log = _log_tracebacks(run_dir, err.tracebacks)
    if err.kind == "oom":
        return RunFailed(killed_for_memory(str(err), settings, estimate, err.memory_limit), 1)
    if err.error_type in [e.__name__ for e in DIVERGED]:
        return RunFailed(str(err).split(f"{err.error_type}: ", 1)[-1], 1)
    if err.kind == "exception":
        return RunFailed(f"{err} (full traceback: {log})", 2)
    return RunFailed(str(err), 1)


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def run(cfg: DictConfig, run_dir: str, hydra: DictConfig | None = None) -> dict:
    """Validate everything, then train on this process (torchrun, 1 worker) or start local workers.
    ``hydra``: Hydra's own config, written to ``<run dir>/.hydra/`` with ``cfg`` once the run dir is ours."""
    settings = validate(OmegaConf.to_container(cfg, resolve=True))  # the one typed config, for every worker
    with holding_job_dirs(settings, run_dir) as holder:  # no other job in them until this one ends, however it ends
        if holder and hydra is not None and hydra.output_subdir is None:
            write_hydra_files(run_dir, cfg, hydra)
        return _run(settings, run_dir)


def _run(settings: Settings, run_dir: str) -> dict:
    local_workers = not under_torchrun() and settings.world_size > 1
    # the working set of this host's ranks against the memory they will have: refused or warned here
    settings, estimate = plan_memory(settings, settings.world_size if local_workers else
                                     int(os.environ.get("LOCAL_WORLD_SIZE", 1)),  # and offload buffers chosen to fit
                                     forked=local_workers)
    if local_workers:  # their imports, in the background, while the checks below read the inputs
        start_worker_server(train_worker, preload=[*tokenizer_modules(settings.model_path), *WORKER_IMPORTS])
    check_inputs(settings)  # user data read through once, model=hf's files
    if not local_workers:
        return _inline(settings, run_dir)
    datasets = check_data_fits(settings)  # tokenizer, documents, batch: fail here, not in every worker
    trim_heap()  # what the checks parsed and dropped goes back: this process only waits from here on
    if settings.launcher.malloc_mmap_threshold:  # read by glibc at the workers' start
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(settings.launcher.malloc_mmap_threshold)
    run_id = f"run{os.getpid()}"
    beat_dir = os.path.join(run_dir, "heartbeat")
    try:
        return launch_local(train_worker, settings.world_size, settings, run_dir, datasets, run_id=run_id,
                            heartbeat_dir=beat_dir, hang_s=settings.launcher.hang_s,
                            log_file=os.path.join(run_dir, "launcher.log"),
                            grace_s=settings.launcher.shutdown_grace_s)[0]
    except JobFailed as err:
        raise _failed(err, run_dir, settings, estimate) from None
    except SignalException as err:  # SIGTERM/SIGINT reached the workers too: what they saved in the grace
        done = preemption_outcome(Path(settings.checkpoint.dir or os.path.join(run_dir, "checkpoints")),
                                  read_beats(beat_dir), signal_name=signal_name(err.sigval),
                                  grace_s=settings.launcher.shutdown_grace_s)
        if done.cut_short:
            raise RunFailed(done.line, 1) from None
        print(done.line, file=sys.stderr)
        return {"preempted": True, "checkpoint": str(done.checkpoint) if done.checkpoint else None}
    finally:  # swap files are scratch: gone after a normal end, Ctrl-C, or a crashed worker
        if settings.offload.device == "nvme":
            remove_scratch(settings.offload.nvme_path, run_id)
