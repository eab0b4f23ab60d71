"""``profile.enabled``: where a step's time goes, achieved FLOP/s and MFU, and a torch.profiler trace.

The split is measured around the engine's calls (forward, backward, optimizer step); the time the
ZeRO stage spends waiting for its collectives (``finish_backward`` after backward, the parameter
all-gather after the step) is timed by the optimizer itself (``ZeroOptimizer.comm_wait_s``) and
reported as communication wait, so backward and optimizer are compute only.  Model FLOPs come from FlopCounterMode on one
micro-batch of a meta-device copy of the model (no memory, no time on the real one).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

from deepshard.core.training_engine import TrainingEngine

# dense bf16/fp16 tensor-core peaks per device, TFLOP/s (fp32 is far lower; set profile.peak_tflops)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "A10G": 125.0, "L40S": 362.0, "L4": 121.0,
               "V100": 125.0, "T4": 65.0, "RTX 4090": 165.0, "RTX 3090": 71.0}
CPU_FLOPS_PER_CYCLE = 32  # fp32 AVX2: 2 FMA units x 8 lanes x 2


def peak_tflops(device: torch.device, threads: int) -> float:
    """The device table by CUDA name; on CPU an AVX2 estimate for the threads this rank uses (~2.5 GHz)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)
    return threads * 2.5e9 * CPU_FLOPS_PER_CYCLE / 1e12


def model_flops(build: Callable[[], torch.nn.Module], micro_batch_size: int, seq_len: int,
                with_doc_ids: bool) -> int:
    """FLOPs of one forward + backward of one micro-batch (per rank, before any sharding)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = build()
    model.to("meta")
    x = torch.zeros(micro_batch_size, seq_len, dtype=torch.long, device="meta")
    kwargs = {"doc_ids": torch.zeros_like(x)} if with_doc_ids else {}
    with FlopCounterMode(display=False) as counter:
        model(x, x, **kwargs).backward()
    return counter.get_total_flops()


class StepProfiler:
    """``with prof.phase("forward"): ...`` in the loop, ``prof.end_step(step, seconds)`` for the scalars."""

    def __init__(self, *, enabled: bool, engine, flops_per_step: int = 0, peak: float = 0.0,
                 trace_steps: list[int] | None = None, trace_dir: str = "", rank: int = 0) -> None:
        self.enabled = enabled
        self.flops_per_step = flops_per_step
        self.peak = peak
        self.trace_steps = sorted(trace_steps or [])
        self.trace_dir = trace_dir
        self.rank = rank
        self.times: dict[str, float] = defaultdict(float)
        self.trace = None
        self.comm_wait_s = engine.optimizer.comm_wait_s  # the optimizer times the stage's collective waits

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times[name] += time.perf_counter() - t0

    def begin_step(self, step: int) -> None:
        if self.trace_steps and step == self.trace_steps[0] and self.trace is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.trace = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=False)
            self.trace.__enter__()

    def end_step(self, step: int, seconds: float) -> dict[str, float]:
        """This step's scalars (MFU always, the split when enabled); writes the trace after its last step."""
        if self.trace is not None and step >= self.trace_steps[-1]:
            self.trace.__exit__(None, None, None)
            os.makedirs(self.trace_dir, exist_ok=True)
            torch.profiler.tensorboard_trace_handler(self.trace_dir, worker_name=f"rank{self.rank}")(self.trace)
            self.trace = None
            self.trace_steps = []
        out: dict[str, float] = {}
        if self.enabled:
            t = self.times
            comm_b, comm_o = self.comm_wait_s["backward"], self.comm_wait_s["optimizer"]
            out = {"profile/forward_s": t.pop("forward", 0.0), "profile/backward_s": t.pop("backward", 0.0) - comm_b,
                   "profile/optimizer_s": t.pop("optimizer", 0.0) - comm_o, "profile/comm_wait_s": comm_b + comm_o}
            t.clear()
            self.comm_wait_s.update(backward=0.0, optimizer=0.0)
            out["profile/other_s"] = max(0.0, seconds - sum(out.values()))
        if self.flops_per_step:  # MFU is cheap (FLOPs counted once), so it is logged on every run
            achieved = self.flops_per_step / seconds
            out["profile/tflops"] = achieved / 1e12
            if self.peak > 0:
                out["train/mfu"] = achieved / (self.peak * 1e12)
        return out


def build_profiler(profile, engine: TrainingEngine, *, flops_per_step: int, trace_dir: str, rank: int,
                   device: torch.device) -> StepProfiler:
    """The run's profiler from its ``profile`` section: the peak from config or the device table."""
    peak = profile.peak_tflops or peak_tflops(device, torch.get_num_threads())
    return StepProfiler(enabled=profile.enabled, engine=engine, flops_per_step=flops_per_step, peak=peak,
                        trace_steps=list(profile.trace_steps), trace_dir=trace_dir, rank=rank)
