"""What a run shows: TensorBoard scalars and a progress bar on rank 0, nothing on other ranks."""

from __future__ import annotations

import os

from tqdm import tqdm


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

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
