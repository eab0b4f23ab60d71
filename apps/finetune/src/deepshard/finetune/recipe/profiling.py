"""``profile.enabled``: where a step's time goes, achieved FLOP/s and MFU, and a torch.profiler trace.

The split is measured around the engine's calls (forward, backward, optimizer step); the time the
ZeRO stage spends waiting for its collectives (``finish_backward`` after backward, the parameter
all-gather after the step) is timed by the optimizer itself (``ZeroOptimizer.comm_wait_s``) and
reported as communication wait, so backward and optimizer are compute only.  Model FLOPs and the
peak come from ``mfu.py`` (PaLM's count; the device table or this host's measured GEMM rate), and
MFU is logged on every run, profiled or not.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict
from collections.abc import Iterator

import torch

from deepshard.core.training_engine import TrainingEngine
from deepshard.finetune.recipe.mfu import peak_tflops


class StepProfiler:
    """``with prof.phase("forward"): ...`` in the loop, ``prof.end_step(step, seconds, flops)`` for the scalars."""

    def __init__(self, *, enabled: bool, engine, peak: float = 0.0,
                 trace_steps: list[int] | None = None, trace_dir: str = "", rank: int = 0) -> None:
        self.enabled = enabled
        self.peak = peak
        self.trace_steps = sorted(trace_steps or [])
        self.trace_dir = trace_dir
        self.rank = rank
        self.mfu: float | None = None  # the last step's, for the log line and the summary
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

    def end_step(self, step: int, seconds: float, flops: int = 0) -> dict[str, float]:
        """This step's scalars (MFU always, the split when enabled); writes the trace after its last step.
        ``flops``: this rank's model FLOPs of the step, from the positions it computed (0: no MFU)."""
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
        if flops:  # MFU is cheap (FLOPs counted from shapes), so it is logged on every run
            achieved = flops / seconds
            out["profile/tflops"] = achieved / 1e12
            if self.peak > 0:
                out["train/mfu"] = self.mfu = achieved / (self.peak * 1e12)
        return out


def build_profiler(profile, engine: TrainingEngine, *, trace_dir: str, rank: int,
                   device: torch.device) -> StepProfiler:
    """The run's profiler from its ``profile`` section: the peak from config, the device table, or
    this host's measured GEMM rate at this rank's threads."""
    peak = peak_tflops(device, torch.get_num_threads(), profile.peak_tflops)
    return StepProfiler(enabled=profile.enabled, engine=engine, peak=peak,
                        trace_steps=list(profile.trace_steps), trace_dir=trace_dir, rank=rank)
