"""Several of issue 41's HF-stack scripts in one launch, one after another in the same workers: a world-2
launch costs 10-20 s here before a script trains, the scripts' own training 2-5 s, so each layout is one
launch (tests/compat/hf_stack_layouts.py).  Started in the scripts' place, e.g.
``deepshard --num_gpus 2 hf_stack_runner.py --plan plan.json``; no deepshard import (the workers are the
user's processes, as the scripts are).

Each script runs with ``runpy`` as ``python script.py ARGV`` would in a fresh worker, as the session's gloo
pool does per call (tests/gloo_pool.py): the environment the launcher gave (accelerate's ``ACCELERATE_*``
variables only for an entry driven by them, ``"accelerate": true``; the scripts' own writes, such as
TrainingArguments' ``ACCELERATE_USE_DEEPSPEED``, dropped), the RNG states of the worker's start,
accelerate's singletons and transformers' ds_config reference cleared.  The process group stays: accelerate's
``PartialState`` keeps it, as one script's second trainer (a resumed one) already does.  A failing script
fails the launch (its traceback on stderr)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import runpy
import sys
from pathlib import Path

import numpy as np
import torch


def fresh(environ: dict[str, str], accelerate: bool) -> None:
    """What the next script sees as a fresh worker: the launcher's environment and no HF-stack state left
    (only modules an earlier script imported are touched, so the first script starts as it would alone)."""
    os.environ.clear()
    os.environ.update({k: v for k, v in environ.items() if accelerate or not k.startswith("ACCELERATE_")})
    if (state := sys.modules.get("accelerate.state")) is not None:
        state.AcceleratorState._reset_state()  # not PartialState's: it holds the process group
        state.GradientState._reset_state()
    if (hf_ds := sys.modules.get("transformers.integrations.deepspeed")) is not None:
        hf_ds.unset_hf_deepspeed_config()
    gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True, help="JSON: [{script, argv, accelerate}] in order")
    opts, launcher_args = ap.parse_known_args()  # --local_rank=N from the launcher goes on to each script
    plan = json.loads(Path(opts.plan).read_text())
    environ = dict(os.environ)
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    for entry in plan:
        fresh(environ, entry.get("accelerate", False))
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])
        sys.argv = [entry["script"], *entry["argv"], *launcher_args]
        runpy.run_path(entry["script"], run_name="__main__")


if __name__ == "__main__":
    main()
