"""One rank of the app's engine in a fresh process: its peak resident growth over 3 steps beside the
working-set estimate (tests/offload/test_working_set_estimate.py).

    python tests/offload/working_set_worker.py OVERRIDE...   -> one JSON line
"""

from __future__ import annotations

import json
import os
import sys


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def main(overrides: list[str]) -> dict:
    import torch

    import deepshard.finetune.models.llama.parallelize  # noqa: F401 - imports are the baseline, not the run
    import deepshard.offload  # noqa: F401
    import deepshard.pipeline  # noqa: F401
    from deepshard.core import build_mesh, init_distributed
    from deepshard.finetune.config import validate
    from deepshard.finetune.models.working_set import run_shape, working_set_of
    from deepshard.finetune.recipe.assemble import build_stepper
    from deepshard.finetune.tools.estimate import compose

    settings = validate(compose(overrides))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29591"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    init_distributed()
    torch.manual_seed(0)
    tokens = torch.randint(0, settings.model.vocab_size,
                           (settings.train.micro_batch_size, settings.data.seq_len + 1))
    with open("/proc/self/clear_refs", "w") as f:  # the peak from here on
        f.write("5")
    start = _status("VmRSS")
    mesh = build_mesh(settings.parallel)
    stepper = build_stepper(settings, mesh, rank=0)
    engine = stepper.engine
    for _ in range(3):
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
    peak = _status("VmHWM")
    ws = working_set_of(settings, baseline=0)
    engine.store.close()
    return {"growth": peak - start, "estimate": ws.ram(on_device=False), "host": ws.host, "device": ws.device,
            "shape": str(run_shape(settings))}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
