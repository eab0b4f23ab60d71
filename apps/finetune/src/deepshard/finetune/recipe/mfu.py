"""MFU on every run: model FLOPs per token as PaLM and torchtitan count them, over the hardware's peak.

FLOPs per token = 6 x the trainable non-embedding parameters (forward 2, backward 4) + 4 x the frozen
ones (LoRA's base: forward and the activation gradient, no weight gradient) + 12 x layers x heads x
head_dim x sequence length (attention's two matmuls, forward and backward).  A step counts the positions
its batches really carried (:class:`StepFlops`): rows x length of each batch as the collator made it, so
padding inside a batch is computed and counts (as torchtitan counts its inputs), while what
``data.pad_to_multiple_of`` cut off does not, and the attention term takes the batch's own length as
the sequence length.  Activation recomputation
is not useful work and is not counted; an MoE layer counts the experts a token visits (top-k of them).
The embedding is a lookup (no FLOPs); a head tied to it is a matmul and counts.

The peak: ``profile.peak_tflops`` when given; on CUDA the dense bf16/fp16 peak of the device by name;
on CPU the best fp32 GEMM rate measured on this host at the rank's thread count (square 1024 and
2048 matmuls, at most about a second), once per host and thread count, cached in
``$XDG_CACHE_HOME/deepshard/peak_flops.json`` (default ``~/.cache``).  At one thread a GEMM is timed
by the CPU time of the thread that runs it, not by the clock: the ranks of a host measure while their
peers start, and a peak measured on a shared core (half the rate) stayed in the cache and put later
runs' MFU above 100%.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

__all__ = ["PEAK_TFLOPS", "StepFlops", "cpu_peak_tflops", "flops_per_token", "param_counts", "peak_tflops"]

# dense bf16/fp16 tensor-core peaks per device, TFLOP/s (fp32 is far lower; set profile.peak_tflops)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "A10G": 125.0, "L40S": 362.0, "L4": 121.0,
               "V100": 125.0, "T4": 65.0, "RTX 4090": 165.0, "RTX 3090": 71.0}


def param_counts(model: nn.Module, *, experts_active: float = 1.0) -> tuple[int, int]:
    """(trainable, frozen) parameters that a token's matmuls use, the embeddings' left out.

    Counted per module, so a head tied to the embedding counts as the matmul it is.  Parameters of
    an MoE's experts (modules named ``experts``) are scaled by ``experts_active`` (top-k / experts).
    """
    trainable = frozen = 0.0
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            continue
        scale = experts_active if ".experts" in f".{name}" else 1.0
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                trainable += p.numel() * scale
            else:
                frozen += p.numel() * scale
    return int(trainable), int(frozen)


def flops_per_token(*, trainable: int, frozen: int, n_layers: int, n_heads: int, head_dim: int,
                    seq_len: int) -> int:
    """Model FLOPs of one token's forward and backward (PaLM's 6N + 12 L H Q T; frozen weights 4N)."""
    return 6 * trainable + 4 * frozen + 12 * n_layers * n_heads * head_dim * seq_len


@dataclass(frozen=True)
class StepFlops:
    """Model FLOPs of a step from what it computed: ``dense`` per position (6 x trainable + 4 x frozen),
    ``attention`` per position and per position of its batch's length (12 x layers x heads x head_dim),
    shared by ``ranks`` ranks (dp x tp x pp x sp: the job's FLOPs over its ranks, one rank's share)."""

    dense: int
    attention: int
    ranks: int = 1

    def per_rank(self, positions: int, attended: int) -> int:
        """One rank's FLOPs of a step whose batches (over every dp rank) carried ``positions`` positions,
        ``attended`` the sum over its batches of rows x length x length (PaLM's T per position)."""
        return (self.dense * positions + self.attention * attended) // self.ranks


def _cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "deepshard" / "peak_flops.json"


def _gemm_clock(threads: int) -> tuple[str, Callable[[], float]]:
    """What times one GEMM at ``threads`` threads, and its name in the cache key: at one thread the
    thread's CPU time (the GEMM runs on it), else the clock."""
    return ("cpu time", time.thread_time) if threads == 1 else ("wall", time.perf_counter)


def _host_key(threads: int) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    clock = _gemm_clock(threads)[0]  # entries timed by another clock are not reused
    return f"{platform.node()}|{cpu}|torch {torch.__version__}|threads {threads}|{clock}"


def measure_cpu_gemm(threads: int, budget_s: float = 1.0) -> float:
    """The best fp32 GEMM rate (TFLOP/s) of square 1024 (three times) then 2048 matmuls at ``threads``
    threads, stopping once ``budget_s`` is spent (a 2048 GEMM is run only where it fits).  At one
    thread each GEMM is timed by this thread's CPU time (the core's rate, whatever else runs on it)."""
    timer = _gemm_clock(threads)[1]
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    best, start = 0.0, time.perf_counter()
    try:
        a = torch.randn(2048, 2048, device="cpu")  # the host's own rate: host memory on purpose
        torch.mm(a[:1024, :1024], a[:1024, :1024])  # warm the BLAS and its threads
        for n in (1024, 1024, 1024, 2048):
            x = a[:n, :n].contiguous()
            if n == 2048 and best and (time.perf_counter() - start) + 2 * n**3 / (best * 1e12) > budget_s:
                break
            t0 = timer()
            torch.mm(x, x)
            best = max(best, 2 * n**3 / max(timer() - t0, 1e-9) / 1e12)
            if time.perf_counter() - start > budget_s:
                break
    finally:
        torch.set_num_threads(saved)
    return best


def cpu_peak_tflops(threads: int) -> float:
    """This host's measured fp32 GEMM peak at ``threads`` threads, from the cache or measured now."""
    path, key = _cache_file(), _host_key(threads)
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if isinstance(cached.get(key), (int, float)) and cached[key] > 0:
        return float(cached[key])
    value = measure_cpu_gemm(threads)
    try:  # atomic: ranks of one host may measure at once; the last writer wins, every value is valid
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**cached, key: value}, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
    return value


def peak_tflops(device: torch.device, threads: int, configured: float = 0.0) -> float:
    """The peak one rank's MFU divides by: ``configured`` (profile.peak_tflops), the device table on
    CUDA (0 for an unknown device: no MFU), the measured GEMM rate on CPU."""
    if configured > 0:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)
    return cpu_peak_tflops(threads)
