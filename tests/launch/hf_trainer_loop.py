"""An HF Trainer script on deepshard (``from deepshard.compat.transformers import Trainer,
TrainingArguments``) as users run one under a launcher: ZeRO-3 (fp32) on tests/compat's tiny Llama, 8
steps, a checkpoint every 4, ``train(resume_from_checkpoint=<the newest checkpoint-N>)`` at start.
``--die_at R:S``: rank R SIGKILLs itself as step S begins, once (a marker file remembers it).  Rank 0
writes transformers' logged losses (``float.hex``) to ``--out`` as one JSON object."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tests.* by package path

from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from tests.compat.hf_trainer_harness import our_trainer  # noqa: E402


class DieAt(TrainerCallback):
    def __init__(self, spec: str, marker: Path) -> None:
        rank, _, step = spec.partition(":")
        self.rank, self.step, self.marker = int(rank), int(step), marker

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201 - transformers' hook
        if int(os.environ["RANK"]) == self.rank and state.global_step + 1 == self.step and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--die_at", default="")
    args = parser.parse_args()
    out_dir = Path(args.output_dir)
    last = get_last_checkpoint(str(out_dir)) if out_dir.is_dir() else None
    trainer = our_trainer(out_dir, stage=3, micro=2, accum=1, max_steps=8, save_strategy="steps", save_steps=4)
    if args.die_at:
        trainer.add_callback(DieAt(args.die_at, Path(f"{args.out}.died")))
    trainer.train(resume_from_checkpoint=last)
    if int(os.environ["RANK"]) == 0:
        losses = {int(h["step"]): float(h["loss"]).hex() for h in trainer.state.log_history if "loss" in h}
        Path(args.out).write_text(json.dumps({"resumed_from": last, "losses": losses}))


if __name__ == "__main__":
    main()
