"""Decisions that need the world size or the host, and the checks that read user files.

The number of ranks (torchrun's, or the workers the app starts) is a pure function that
``config.validate`` applies once (DeepSpeed's batch arithmetic and the fp16-on-CPU fallback live in
``deepshard.compat.resolve``, shared with the DeepSpeed front door); the checks below read user data, the model
directory and the built datasets, before any worker starts; and before all of it the job takes its
run and checkpoint dirs, which no other job may share.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from deepshard.core.checkpoint.plain_files import open_file
from deepshard.finetune.config.world import under_torchrun
from deepshard.finetune.data.resumable import check_fits
from deepshard.finetune.data.sources import check_records
from deepshard.launch.run_lock import acquire

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from torch.utils.data import Dataset

    from deepshard.finetune.config import Settings


def job_dirs(settings: Settings, run_dir: str) -> dict[str, str]:
    """The directories a job writes that another job must not share, by the key that sets each (the
    checkpoint dir as ``checkpointing.py`` resolves it)."""
    return {"hydra.run.dir": run_dir, "checkpoint.dir": settings.checkpoint.dir or os.path.join(run_dir, "checkpoints")}


@contextlib.contextmanager
def holding_job_dirs(settings: Settings, run_dir: str) -> Iterator[bool]:
    """This job's locks on its run and checkpoint dirs (``deepshard.launch.run_lock``), for its whole life;
    a second job on either is refused here (ValueError naming the directory and the owner), before it
    starts anything.  Under torchrun every rank runs the app: global rank 0 takes them for the job (its
    run dir is the one every rank uses), the other ranks take none and so never refuse each other.
    Yields whether this process holds them (the job's writer of the run dir's own files)."""
    if under_torchrun() and os.environ.get("RANK", "0") != "0":
        yield False
        return
    job = os.environ.get("TORCHELASTIC_RUN_ID", f"run{os.getpid()}")
    with contextlib.ExitStack() as held:
        taken: set[str] = set()
        for key, directory in job_dirs(settings, run_dir).items():
            if os.path.realpath(directory) not in taken:  # checkpoint.dir=<the run dir>: one lock
                taken.add(os.path.realpath(directory))
                held.enter_context(acquire(directory, key=key, job=job))
        yield True


def write_hydra_files(run_dir: str, cfg: DictConfig, hydra: DictConfig) -> None:
    """The composed config, Hydra's own and the overrides in ``<run dir>/.hydra/``, as Hydra writes them
    (conf sets ``hydra.output_subdir`` to null): by the job that holds the run dir, so a refused second
    job never overwrites a running one's; no file is written through a symlink."""
    from omegaconf import OmegaConf

    out = os.path.join(run_dir, ".hydra")
    os.makedirs(out, exist_ok=True)
    files = {"config.yaml": cfg, "hydra.yaml": OmegaConf.create({"hydra": hydra}), "overrides.yaml": hydra.overrides.task}
    for name, node in files.items():
        with open_file(os.path.join(out, name), "w") as f:
            f.write(OmegaConf.to_yaml(node))


def check_inputs(settings: Settings) -> None:
    """User data read through once (ValueError naming file and line), and model=hf's files."""
    check_records(settings.data)
    if settings.data.eval_path is not None and settings.data.eval_fraction > 0:
        print(f"notice: data.eval_path={settings.data.eval_path!r} is the eval set: data.eval_fraction="
              f"{settings.data.eval_fraction} is not applied (every document of data.path trains)")
    if settings.model_name == "hf":  # config.json was read by validate(); here the tokenizer and weights' headers
        from deepshard.finetune.models import registry

        cfg = dataclasses.replace(settings.model, kernels="torch")
        registry.spec_of(cfg).hf.check_dir(settings.model_path, registry.build_meta(cfg))


def check_data_fits(settings: Settings) -> tuple[Dataset, Dataset | None]:
    """The tokenizer loads, the documents tokenize and split, and one global batch fits (ValueErrors).
    Returns the (train, eval) datasets, which the launcher hands to its workers."""
    from deepshard.finetune.data.build import build_datasets
    from deepshard.finetune.data.tokenizer import load_tokenizer

    train, held = build_datasets(settings.data, load_tokenizer(settings.model_path), settings.model.vocab_size)
    check_fits(len(train), dp_size=settings.parallel.dp, micro_batch_size=settings.train.micro_batch_size)
    return train, held
