"""Shared by the checkpoint tests: a micro Llama trained on a fixed *global* batch per step.

The global batch is split into contiguous per-rank chunks, so the same steps at world 1, 2 or 4
see the same data and (in fp32) the same losses up to summation order.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from deepshard.core import SchedulerConfig, initialize
from deepshard.core.checkpoint.state import load_checkpoint, save_checkpoint, training_state
from deepshard.core.mesh import local_device
from tests.core.zero_harness import MICRO, SEQ, build_model, engine_config

GLOBAL_BATCH = 8
STEPS = 10
SPLIT = 5


def global_batches(num_steps: int = STEPS) -> torch.Tensor:
    """[step, GLOBAL_BATCH, SEQ + 1] token ids following a learnable rule."""
    g = torch.Generator().manual_seed(4321)
    seq = [torch.randint(0, MICRO.vocab_size, (num_steps, GLOBAL_BATCH, 1), generator=g)]
    for _ in range(SEQ):
        seq.append((seq[-1] * 5 + 1) % MICRO.vocab_size)
    return torch.cat(seq, dim=-1)


def make_engine(stage: int, *, ac: str = "none", dtype: str = "fp32", store_factory=None):
    """A warm-up schedule and clipping, so the LR step and the update count matter on resume."""
    cfg = engine_config(stage, 1, 0.5, dtype=dtype)
    cfg = dataclasses.replace(cfg, ac=ac, scheduler=SchedulerConfig(name="WarmupLR", warmup_max_lr=2e-3,
                                                                     warmup_num_steps=8))
    kwargs = {} if store_factory is None else {"store_factory": store_factory}
    return initialize(build_model(MICRO).to(local_device()), cfg, **kwargs)


def run_steps(engine, steps: range) -> list[float]:
    """Train ``steps`` (0-based indices into :func:`global_batches`); the global mean loss of each."""
    dp = engine.mesh["dp"]
    data = global_batches()
    losses = []
    for step in steps:
        tokens = data[step].chunk(dp.size())[dp.get_local_rank()].to(local_device())
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp.get_group())
        losses.append(total.item() / dp.size())
    return losses


def save(engine, root: Path, step: int) -> Path:
    return save_checkpoint(root, step, engine.optimizer, engine.mesh["dp"], model=engine.model,
                           app_state={"step": step}, meta={"model": dataclasses.asdict(MICRO)})


def load(engine, path: Path) -> dict:
    return load_checkpoint(path, engine.optimizer, engine.mesh["dp"], model=engine.model)


def resume_worker(root: str) -> dict:
    """World 2: for each stage, 10 steps straight vs 5 + save + fresh engine + load + 5.

    Stage 2 runs with activation checkpointing (wrapped FQNs) and also saves at step 10, leaving
    ``root/stage2`` with two checkpoints for the reshard, auto-resume and corruption tests.
    """
    from deepshard.core import init_distributed

    init_distributed()
    root = Path(root)
    out = {}
    for stage in (0, 1, 2, 3):
        straight = run_steps(make_engine(stage), range(STEPS))
        ac = "full" if stage == 2 else "none"
        first = make_engine(stage, ac=ac)
        losses = run_steps(first, range(SPLIT))
        path = save(first, root / f"stage{stage}", SPLIT)
        second = make_engine(stage)
        app = load(second, path)
        losses += run_steps(second, range(SPLIT, STEPS))
        if stage == 2:
            save(second, root / "stage2", STEPS)
        out[stage] = {"straight": straight, "resumed": losses, "app": app,
                      "num_updates": second.optimizer.num_updates}
    # bf16 compute with fp32 masters: the checkpoint holds the masters, so a fp32 run resumes them exactly
    bf16 = make_engine(1, dtype="bf16")
    run_steps(bf16, range(SPLIT))
    path = save(bf16, root / "bf16", SPLIT)
    masters = {k: v.full_tensor() for k, v in training_state(bf16.optimizer, bf16.mesh["dp"]).items()
               if k.startswith("model.")}
    fp32 = make_engine(3)
    load(fp32, path)
    params = {"model." + n: p.full_tensor() for n, p in fp32.model.named_parameters()}
    out["bf16_to_fp32_max_diff"] = max((masters[k] - params[k]).abs().max().item() for k in masters)
    out["bf16_keys_match"] = sorted(masters) == sorted(params)
    # the state store is opaque to checkpoints: NVMe-offloaded at stage 2 -> host-offloaded at stage 3
    from deepshard.offload import OffloadConfig, make_store_factory

    rank = dist.get_rank()
    nvme = make_store_factory(OffloadConfig(device="nvme", nvme_path=str(root), sub_group_size=500), rank, "ckpt")
    cpu = make_store_factory(OffloadConfig(device="cpu"), rank, "ckpt")
    first = make_engine(2, store_factory=nvme)
    losses = run_steps(first, range(SPLIT))
    path = save(first, root / "offload", SPLIT)
    first.store.close()
    second = make_engine(3, store_factory=cpu)
    load(second, path)
    out["offload"] = losses + run_steps(second, range(SPLIT, STEPS))
    return out


def reshard_worker(path: str, stage: int) -> tuple[float, int]:
    """Load ``path`` at this world size and ``stage``; the loss of the next step (step 6)."""
    from deepshard.core import init_distributed

    init_distributed()
    engine = make_engine(stage)
    load(engine, Path(path))
    return run_steps(engine, range(SPLIT, SPLIT + 1))[0], engine.optimizer.num_updates
