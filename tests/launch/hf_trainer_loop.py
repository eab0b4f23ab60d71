"""An HF Trainer script on deepshard (``from deepshard.compat.transformers import Trainer,
TrainingArguments``) as users run one under a launcher: ZeRO-3 (fp32) on tests/compat's tiny Llama, 8
steps, a checkpoint every 4, ``train(resume_from_checkpoint=<the newest checkpoint-N>)`` at start.
``--die_at R:S``: rank R SIGKILLs itself as step S begins, once (a marker file remembers it).  Rank 0
writes transformers' logged losses (``float.hex``) to ``--out`` as one JSON object.

``--whole_first DIR``: first an uninterrupted run of the same script in DIR (its JSON at ``DIR.json``), in
the same workers, then the run asked for, as tests/compat/hf_stack_runner.py runs scripts one after another
(a fresh environment, accelerate's state and the RNGs put back): the reference of a restart costs no launch
of its own (a world-2 launch of this script is ~14 s of CPU here).  Done once: a restarted attempt finds
``DIR.json`` and goes on to the run asked for alone."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tests.* by package path

from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from tests.compat.hf_stack_runner import fresh  # noqa: E402
from tests.compat.hf_trainer_harness import our_trainer  # noqa: E402


class DieAt(TrainerCallback):
    def __init__(self, spec: str, marker: Path) -> None:
        rank, _, step = spec.partition(":")
        self.rank, self.step, self.marker = int(rank), int(step), marker

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201 - transformers' hook
        if int(os.environ["RANK"]) == self.rank and state.global_step + 1 == self.step and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)


def train(out_dir: Path, out: Path, die_at: str) -> None:
    last = get_last_checkpoint(str(out_dir)) if out_dir.is_dir() else None
    trainer = our_trainer(out_dir, stage=3, micro=2, accum=1, max_steps=8, save_strategy="steps", save_steps=4)
    if die_at:
        trainer.add_callback(DieAt(die_at, Path(f"{out}.died")))
    trainer.train(resume_from_checkpoint=last)
    if int(os.environ["RANK"]) == 0:
        losses = {int(h["step"]): float(h["loss"]).hex() for h in trainer.state.log_history if "loss" in h}
        out.write_text(json.dumps({"resumed_from": last, "losses": losses}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--die_at", default="")
    parser.add_argument("--whole_first", default="")
    args = parser.parse_args()
    whole = Path(args.whole_first)
    if args.whole_first and not whole.with_name(f"{whole.name}.json").exists():  # both ranks decide alike:
        # rank 0 writes the file after train(), which ends with a collective, before the next run begins
        environ, states = dict(os.environ), (torch.get_rng_state(), random.getstate(), np.random.get_state())
        train(whole, whole.with_name(f"{whole.name}.json"), "")
        fresh(environ, accelerate=False)
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])
    train(Path(args.output_dir), Path(args.out), args.die_at)


if __name__ == "__main__":
    main()
