"""One rank of ZeRO-Infinity (params and optimizer state on NVMe) that trains a step and then saves a
checkpoint, for ``test_infinity_save_memory`` (run confined in a memory cgroup): JSON of the save."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tests.* by package path


def main(spec: dict) -> dict:
    from bench.bench_infinity import llama_spec
    from deepshard.core import (
        EngineConfig,
        OptimConfig,
        PrecisionConfig,
        ZeroConfig,
        init_distributed,
        initialize,
    )
    from deepshard.core.checkpoint import save_checkpoint
    from deepshard.finetune.models.llama import Llama, LlamaConfig
    from deepshard.offload import OffloadConfig, make_store_factory, param_offload

    init_distributed()
    torch.manual_seed(0)
    cfg = EngineConfig(zero=ZeroConfig(stage=3), precision=PrecisionConfig(dtype="fp32"), optim=OptimConfig(lr=1e-3),
                       ac="full")
    off = OffloadConfig(device="nvme", nvme_path=spec["nvme_path"], params="nvme", buffer_count=2,
                        param_buffer_count=3, param_prefetch=2)
    factory = make_store_factory(off, 0, f"save{os.getpid()}")
    with torch.device("meta"):
        model = Llama(LlamaConfig(**llama_spec(spec["params_m"], dim=256)))
    engine = initialize(model, cfg, store_factory=factory, offload_params=param_offload(off, factory),
                        materialize=factory.param_swap.materializer(lambda m: m.init_weights(seed=0)))
    tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(1))
    loss = engine(tokens[:, :-1], tokens[:, 1:])
    engine.backward(loss)
    engine.step()
    t0 = time.perf_counter()
    path = save_checkpoint(spec["ckpt"], 1, engine.optimizer, engine.mesh["dp"], model=engine.model)
    out = {"saved": str(path), "save_s": time.perf_counter() - t0, "num_params": sum(p.numel() for p in model.parameters())}
    engine.store.close()
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
