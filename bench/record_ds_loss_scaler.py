"""Record DeepSpeed's own DynamicLossScaler on random overflow sequences (the fixture of
tests/core/test_loss_scaler_vs_deepspeed.py).

Needs the bench extra (``pip install -r bench/requirements.txt``); run from the repo root:
``python bench/record_ds_loss_scaler.py tests/core/fixtures/ds_loss_scaler.json`` (DeepSpeed prints
banners on stdout, so the JSON goes to the named file).
Each case: the knobs, the overflow sequence, DeepSpeed's (scale, hysteresis) after every step,
and the step at which it raised (overflow at the minimum scale), if it did.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sys


def record(knobs: dict, overflows: list[bool]) -> dict:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    s = DynamicLossScaler(init_scale=2.0 ** knobs["initial_scale_power"], scale_window=knobs["loss_scale_window"],
                          min_scale=knobs["min_loss_scale"], delayed_shift=knobs["hysteresis"],
                          consecutive_hysteresis=knobs["consecutive_hysteresis"],
                          raise_error_at_min_scale=knobs["raise_error_at_min_scale"])
    after, raised_at = [], None
    for i, overflow in enumerate(overflows):
        try:
            s.update_scale(overflow)
        except Exception:  # DeepSpeed raises a bare Exception at the minimum scale
            raised_at = i
            break
        after.append([float(s.cur_scale), int(s.cur_hysteresis)])
    return {"knobs": knobs, "overflows": overflows, "after": after, "raised_at": raised_at}


def main() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29641"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # its scaler logs through deepspeed.comm's rank
    rng = random.Random(20261201)
    cases = []
    for window, hysteresis, consecutive, p in itertools.product((1, 3, 10), (1, 2, 3), (False, True), (0.08, 0.4)):
        knobs = {"initial_scale_power": 16, "loss_scale_window": window, "hysteresis": hysteresis,
                 "min_loss_scale": 1.0, "consecutive_hysteresis": consecutive, "raise_error_at_min_scale": True}
        cases.append(record(knobs, [rng.random() < p for _ in range(120)]))
    for hysteresis, raise_error in itertools.product((1, 2), (True, False)):  # runs that hit the minimum scale
        knobs = {"initial_scale_power": 4, "loss_scale_window": 3, "hysteresis": hysteresis, "min_loss_scale": 2.0,
                 "consecutive_hysteresis": False, "raise_error_at_min_scale": raise_error}
        cases.append(record(knobs, [rng.random() < 0.7 for _ in range(120)]))
    with open(sys.argv[1], "w") as f:
        json.dump({"deepspeed": deepspeed.__version__, "cases": cases}, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
