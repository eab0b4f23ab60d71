"""What a run shows: TensorBoard scalars and a progress bar on rank 0, nothing on other ranks."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from tqdm import tqdm

from deepshard.core.memory import ModelStateBytes

DEVICE_PEAKS = ("model_state", "device_max_allocated", "device_max_reserved")


def device_peaks(device: torch.device) -> tuple[float, float]:
    """This rank's peak device memory so far (allocated by tensors, reserved by the caching
    allocator); zeros off CUDA, where the host's ``ru_maxrss`` is the figure to look at."""
    if device.type != "cuda":
        return 0.0, 0.0
    return float(torch.cuda.max_memory_allocated(device)), float(torch.cuda.max_memory_reserved(device))


def memory_scalars(memory: ModelStateBytes, *, world: int, device: torch.device) -> dict[str, float]:
    """Every rank's model-state bytes and, on CUDA, its device peaks, gathered by one all-gather on
    the compute device (nccl takes no host tensor); this rank's split of the model state."""
    mine = torch.tensor([float(memory.total), *device_peaks(device)], dtype=torch.float64, device=device)
    gathered = [torch.zeros(len(DEVICE_PEAKS), dtype=torch.float64, device=device) for _ in range(world)]
    dist.all_gather(gathered, mine)
    out: dict[str, float] = {}
    for rank, row in enumerate(gathered):
        for i, name in enumerate(DEVICE_PEAKS):
            if i == 0 or device.type == "cuda":
                out[f"memory/{name}_bytes_rank{rank}"] = row[i].item()
    out.update({"memory/params_bytes": memory.params, "memory/grads_bytes": memory.grads,
                "memory/optimizer_bytes": memory.optimizer + memory.host})
    return out


def memory_line(scalars: dict[str, float], world: int) -> str | None:
    """One log line of the per-rank device peaks beside the model state (None off CUDA)."""
    if "memory/device_max_allocated_bytes_rank0" not in scalars:
        return None
    gib = 2.0**30
    ranks = [f"rank {r}: model state {scalars[f'memory/model_state_bytes_rank{r}'] / gib:.2f}, "
             f"max allocated {scalars[f'memory/device_max_allocated_bytes_rank{r}'] / gib:.2f}, "
             f"max reserved {scalars[f'memory/device_max_reserved_bytes_rank{r}'] / gib:.2f}"
             for r in range(world)]
    return "device memory (GiB) after step 1, " + "; ".join(ranks)


class RunLogger:
    """Rank 0 writes TensorBoard events under ``<run_dir>/tensorboard`` (or ``tb_dir``) and draws the progress bar."""

    def __init__(self, run_dir: str, *, enabled: bool, total_steps: int, initial_step: int = 0,
                 tb_dir: str | None = None) -> None:
        self.enabled = enabled
        self.writer = None
        self.bar = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(tb_dir or os.path.join(run_dir, "tensorboard"))
            self.bar = tqdm(total=total_steps, initial=initial_step, desc="train", unit="step",
                            dynamic_ncols=True, mininterval=1.0)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(key, value, step)

    def progress(self, postfix: dict[str, str]) -> None:
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)

    def print(self, line: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(line)

    def flush(self) -> None:
        """On disk now: a process killed later keeps what it logged up to here (the writer's own flush
        comes only every 2 minutes, and a restart resumes from the newest checkpoint, not from there)."""
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
