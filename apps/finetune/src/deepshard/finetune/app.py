"""From a composed Hydra config to running workers: validate first, then launch or run inline."""

from __future__ import annotations

import os
import sys

import torch
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.api import SignalException

from deepshard.core.launch import launch_local
from deepshard.finetune.config import resolve_nproc, validate
from deepshard.finetune.runtime import prepare
from deepshard.finetune.train import train_worker
from deepshard.offload import remove_scratch


def under_torchrun() -> bool:
    """torchrun (any node count) already started one process per rank and set the environment."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def run(cfg: DictConfig, run_dir: str) -> dict:
    """Validate everything, then train on this process (torchrun, 1 worker) or start local workers."""
    container = OmegaConf.to_container(cfg, resolve=True)
    prepare(container)  # the batch triple for this world size, fp16 on a CPU host, user data read once
    settings = validate(container)
    if under_torchrun():
        settings.parallel.resolve(int(os.environ["WORLD_SIZE"]))
        return train_worker(container, run_dir)
    nproc = resolve_nproc(settings.nproc_per_node, torch.cuda.device_count())
    settings.parallel.resolve(nproc)
    if nproc == 1:
        return train_worker(container, run_dir)
    threshold = int(container["launcher"].get("malloc_mmap_threshold", 0))
    if threshold:  # read by glibc at the workers' start
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    run_id = f"run{os.getpid()}"
    try:
        return launch_local(train_worker, nproc, container, run_dir, run_id=run_id)[0]
    except SignalException as err:  # SIGTERM/SIGINT reached the workers too: they finished the step and saved
        print(f"preempted ({err}); the workers wrote a checkpoint: rerun with checkpoint.resume=auto",
              file=sys.stderr)
        return {"preempted": True}
    finally:  # swap files are scratch: gone after a normal end, Ctrl-C, or a crashed worker
        if settings.offload.device == "nvme":
            remove_scratch(settings.offload.nvme_path, run_id)
