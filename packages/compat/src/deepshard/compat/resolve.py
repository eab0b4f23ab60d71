"""What a config leaves to the world size and the host, as DeepSpeed decides it.

DeepSpeed's batch arithmetic (``train_batch_size = micro batch x grad accumulation x dp size``: any
two fix the third) and the fp16-on-CPU fallback (fp16 needs a GPU to be worth it: a CPU-only host
trains in fp32, with one notice), used alike by the app's config and ``deepshard.compat.deepspeed``.
"""

from __future__ import annotations

import sys

APP_BATCH_KEYS = ("train.global_batch_size", "train.micro_batch_size", "train.grad_accum")
DS_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def resolve_batch(train: dict, dp: int, *, keys: tuple[str, str, str] = APP_BATCH_KEYS, microbatches: int = 1) -> None:
    """Any two of ``global_batch_size``, ``micro_batch_size``, ``grad_accum`` fix the third (0 = derive);
    ``global = micro x accumulation x microbatches x dp`` (``microbatches``: a pipeline's per accumulation).

    A contradiction is a ValueError that shows the numbers, under the caller's ``keys`` (the app's, or
    the ds_config's ``DS_BATCH_KEYS``); ``train`` is updated in place.
    """
    kg, km, ka = keys
    g, m, a = train.get("global_batch_size", 0), train["micro_batch_size"], train["grad_accum"]
    if not g:
        return  # no global batch: validate() insists on positive micro batch and accumulation
    width = dp * microbatches  # rows of micro-batches per accumulation step, over the replicas
    size = f"data-parallel size {dp}" + (f" x pipeline.microbatches={microbatches}" if microbatches > 1 else "")
    if m == 0 and a == 0:
        a = 1
    if m == 0 or a == 0:
        known, name = (a, ka) if m == 0 else (m, km)
        derived, rest = divmod(g, known * width)
        if rest or derived < 1:
            raise ValueError(
                f"{kg}={g} is not divisible by {name}={known} x {size} "
                f"= {known * width}: choose a global batch that is a multiple of {known * width}")
        m, a = (derived, a) if m == 0 else (m, derived)
    elif m * a * width != g:
        raise ValueError(
            f"{kg}={g} != {km}={m} x {ka}={a} x {size} = {m * a * width}: give two of the three, or make them agree")
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
