"""``engine.tput_timer``: DeepSpeed's ThroughputTimer (samples per second over the updates after
``start_step``), without its log line (``steps_per_print`` logging is the script's business here)."""

from __future__ import annotations

import time


class ThroughputTimer:
    def __init__(self, batch_size: int, start_step: int = 2) -> None:
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.start_time = 0.0
        self.started = False
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            duration = time.time() - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            if global_step:
                self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        if self.global_step_count > 0:
            steps = self.global_step_count - self.start_step
            if steps > 0 and self.total_elapsed_time > 0:
                return self.batch_size / (self.total_elapsed_time / steps)
        return float("-inf")
