"""Decisions that need the world size or the host, taken once before any worker starts.

DeepSpeed's batch arithmetic (train_batch_size = micro batch x grad accumulation x dp size), the
fp16-on-CPU fallback, and reading user data through once so bad records fail before training;
the model directory's files and the built datasets are checked here too, before workers start.
"""

from __future__ import annotations

import os
import sys

import torch

from deepshard.core.mesh import ParallelDims
from deepshard.finetune.config import resolve_nproc
from deepshard.finetune.data.records import check_records
from deepshard.finetune.data.resumable import check_fits


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


def fp16_fallback(cfg: dict, cuda: bool) -> bool:
    """fp16 needs a GPU to be worth it: on a CPU-only host the run trains in fp32 (returns True then)."""
    if cfg["precision"]["dtype"] != "fp16" or cuda:
        return False
    if cfg["precision"].get("force_fp16_on_cpu"):
        print("notice: precision.force_fp16_on_cpu=true: real fp16 on this CPU-only host (emulated, slow)",
              file=sys.stderr)
        return False
    cfg["precision"]["dtype"] = "fp32"
    print("notice: precision=fp16 needs a CUDA device; this CPU-only host trains in fp32 instead "
          "(loss scale stays 1)", file=sys.stderr)
    return True


def world_size(cfg: dict) -> int:
    """torchrun's WORLD_SIZE, or the number of local workers the app will start."""
    if "WORLD_SIZE" in os.environ and ("TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ):
        return int(os.environ["WORLD_SIZE"])
    return resolve_nproc(str(cfg["launcher"]["nproc_per_node"]), torch.cuda.device_count())


def prepare(cfg: dict) -> None:
    """Resolve the batch triple and the precision for this host, and check user data (in place)."""
    dims = ParallelDims(**cfg["parallel"]).resolve(world_size(cfg))
    resolve_batch(cfg["train"], dims.dp)
    fp16_fallback(cfg, torch.cuda.is_available())
    check_records(cfg["data"]["name"], cfg["data"])


def check_model_files(settings) -> None:
    """model=hf: config.json was read by validate(); here the tokenizer and the weights' headers."""
    if settings.model_name == "hf":
        import dataclasses

        from deepshard.finetune.models.hf import check_hf_dir

        check_hf_dir(settings.model_path, dataclasses.replace(settings.model, kernels="torch"))


def check_data_fits(settings, dp: int) -> None:
    """The tokenizer loads, the documents tokenize and split, and one global batch fits (ValueErrors)."""
    from deepshard.finetune.data.build import build_datasets
    from deepshard.finetune.data.tokenizer import load_tokenizer

    train, _ = build_datasets(settings.data, load_tokenizer(settings.model_path), settings.model.vocab_size)
    check_fits(len(train), dp_size=dp, micro_batch_size=settings.train.micro_batch_size)
