"""Decisions that need the world size or the host, and the checks that read user files.

DeepSpeed's batch arithmetic (train_batch_size = micro batch x grad accumulation x dp size), the
number of ranks (torchrun's, or the workers the app starts) and the fp16-on-CPU fallback are pure
functions that ``config.validate`` applies once; the checks below read user data, the model
directory and the built datasets, before any worker starts; and before all of it the job takes its
run and checkpoint dirs, which no other job may share.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from deepshard.core.run_lock import acquire
from deepshard.finetune.data.records import check_records
from deepshard.finetune.data.resumable import check_fits

if TYPE_CHECKING:
    from torch.utils.data import Dataset

    from deepshard.finetune.config import Settings


def resolve_batch(train: dict, dp: int) -> None:
    """Any two of ``global_batch_size``, ``micro_batch_size``, ``grad_accum`` fix the third (0 = derive).

    A contradiction is a ValueError that shows the numbers; ``train`` is updated in place.
    """
    g, m, a = train.get("global_batch_size", 0), train["micro_batch_size"], train["grad_accum"]
    if not g:
        return  # no global batch: validate() insists on positive micro batch and accumulation
    if m == 0 and a == 0:
        a = 1
    if m == 0 or a == 0:
        known, name = (a, "train.grad_accum") if m == 0 else (m, "train.micro_batch_size")
        derived, rest = divmod(g, known * dp)
        if rest or derived < 1:
            raise ValueError(
                f"train.global_batch_size={g} is not divisible by {name}={known} x data-parallel size {dp} "
                f"= {known * dp}: choose a global batch that is a multiple of {known * dp}")
        m, a = (derived, a) if m == 0 else (m, derived)
    elif m * a * dp != g:
        raise ValueError(
            f"train.global_batch_size={g} != train.micro_batch_size={m} x train.grad_accum={a} x "
            f"data-parallel size {dp} = {m * a * dp}: give two of the three, or make them agree")
    train["micro_batch_size"], train["grad_accum"] = m, a


def host_dtype(dtype: str, *, force_fp16_on_cpu: bool, cuda: bool) -> str:
    """fp16 needs a GPU to be worth it: on a CPU-only host the run trains in fp32, with a notice."""
    if dtype != "fp16" or cuda:
        return dtype
    if force_fp16_on_cpu:
        print("notice: precision.force_fp16_on_cpu=true: real fp16 on this CPU-only host (emulated, slow)",
              file=sys.stderr)
        return dtype
    print("notice: precision=fp16 needs a CUDA device; this CPU-only host trains in fp32 instead "
          "(loss scale stays 1)", file=sys.stderr)
    return "fp32"


def fp16_fallback(cfg: dict, cuda: bool) -> bool:
    """:func:`host_dtype` on ``cfg["precision"]`` in place (for the DeepSpeed-config translation); True
    when the run falls back to fp32."""
    p = cfg["precision"]
    dtype = host_dtype(p["dtype"], force_fp16_on_cpu=bool(p.get("force_fp16_on_cpu")), cuda=cuda)
    fell_back, p["dtype"] = dtype != p["dtype"], dtype
    return fell_back


def resolve_nproc(value: str, cuda_devices: int) -> int:
    """``auto``: every local GPU, or 2 workers on a CPU-only host (so the default run really shards)."""
    if str(value) == "auto":
        return cuda_devices or 2
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"launcher.nproc_per_node={value!r}: valid values are 'auto' or a positive integer")
    if 0 < cuda_devices < n:
        raise ValueError(f"launcher.nproc_per_node={n} > {cuda_devices} visible GPU(s): nccl needs one GPU per "
                         f"rank; use at most {cuda_devices} (or 'auto')")
    return n


def under_torchrun() -> bool:
    """torchrun (any node count) already started one process per rank and set the environment."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def host_world_size(nproc_per_node: str) -> int:
    """torchrun's WORLD_SIZE, or the number of local workers the app will start."""
    import torch

    if "WORLD_SIZE" in os.environ and under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    return resolve_nproc(nproc_per_node, torch.cuda.device_count())


def job_dirs(settings: Settings, run_dir: str) -> dict[str, str]:
    """The directories a job writes that another job must not share, by the key that sets each (the
    checkpoint dir as ``checkpointing.py`` resolves it)."""
    return {"hydra.run.dir": run_dir, "checkpoint.dir": settings.checkpoint.dir or os.path.join(run_dir, "checkpoints")}


@contextlib.contextmanager
def holding_job_dirs(settings: Settings, run_dir: str) -> Iterator[None]:
    """This job's locks on its run and checkpoint dirs (``deepshard.core.run_lock``), for its whole life;
    a second job on either is refused here (ValueError naming the directory and the owner), before it
    starts anything.  Under torchrun every rank runs the app: global rank 0 takes them for the job (its
    run dir is the one every rank uses), the other ranks take none and so never refuse each other."""
    if under_torchrun() and os.environ.get("RANK", "0") != "0":
        yield
        return
    job = os.environ.get("TORCHELASTIC_RUN_ID", f"run{os.getpid()}")
    with contextlib.ExitStack() as held:
        taken: set[str] = set()
        for key, directory in job_dirs(settings, run_dir).items():
            if os.path.realpath(directory) not in taken:  # checkpoint.dir=<the run dir>: one lock
                taken.add(os.path.realpath(directory))
                held.enter_context(acquire(directory, key=key, job=job))
        yield


def check_inputs(settings: Settings) -> None:
    """User data read through once (ValueError naming file and line), and model=hf's files."""
    check_records(settings.data.name, dataclasses.asdict(settings.data))
    if settings.model_name == "hf":  # config.json was read by validate(); here the tokenizer and weights' headers
        from deepshard.finetune.models.hf import check_hf_dir

        check_hf_dir(settings.model_path, dataclasses.replace(settings.model, kernels="torch"))


def check_data_fits(settings: Settings) -> tuple[Dataset, Dataset | None]:
    """The tokenizer loads, the documents tokenize and split, and one global batch fits (ValueErrors).
    Returns the (train, eval) datasets, which the launcher hands to its workers."""
    from deepshard.finetune.data.build import build_datasets
    from deepshard.finetune.data.tokenizer import load_tokenizer

    train, held = build_datasets(settings.data, load_tokenizer(settings.model_path), settings.model.vocab_size)
    check_fits(len(train), dp_size=settings.parallel.dp, micro_batch_size=settings.train.micro_batch_size)
    return train, held
