"""Issue 34: the ds_config's ``checkpoint`` section and optimizer weight decay, per rank of a gloo group.

One launch serves tests/compat/test_ds_ckpt_config.py: ``checkpoint.tag_validation`` in its three modes
with a per-rank tag, the ds_config optimizer's weight decay at ZeRO 2 and 3, and asynchronous saves
(``checkpoint.writer.decoupled``) against synchronous ones.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812

import deepshard.compat.deepspeed as deepspeed
from deepshard.core.checkpoint.manifest import read_manifest
from tests.compat.ds_zero3_patterns_harness import TinyLM, batch

LR, BETAS, WD = 5e-2, (0.9, 0.95), 0.1


def _engine(config: dict, *, stage: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    model = TinyLM()
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "weight_decay": WD}}, **config}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _step(engine, step: int, rank: int) -> float:
    inputs, labels = batch(step, rank)
    loss = F.cross_entropy(engine(inputs).flatten(0, 1), labels.flatten())
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    torch.distributed.all_reduce(mean)
    return mean.item() / torch.distributed.get_world_size()


def tags(root: Path, rank: int) -> dict:
    """``save_checkpoint(dir, tag=<this rank's loss>)`` under each ``checkpoint.tag_validation``."""
    out = {}
    for mode in ("Warn", "Ignore", "Fail"):
        engine = _engine({"checkpoint": {"tag_validation": mode}})
        inputs, labels = batch(0, rank)
        loss = F.cross_entropy(engine(inputs).flatten(0, 1), labels.flatten())
        engine.backward(loss)
        engine.step()
        tag, error = f"{loss.item():.6f}", None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                engine.save_checkpoint(str(root / mode), tag=tag)
            except ValueError as err:
                error = str(err)
        out[mode] = {"tag": tag, "error": error,
                     "warnings": [str(w.message) for w in caught if "checkpoint tag" in str(w.message)]}
    return out


def decay(stages: list[int], steps: int) -> dict:
    """The full weights after ``steps`` with the ds_config's optimizer (weight_decay 0.1, model.parameters())."""
    out = {}
    for stage in stages:
        engine = _engine({}, stage=stage)
        for step in range(steps):
            _step(engine, step, torch.distributed.get_rank())
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            out[stage] = {n: p.detach().clone().cpu() for n, p in engine.module.named_parameters()}
    return out


def _crcs(path: str) -> dict[str, str]:
    return {n: f["crc32"] for n, f in read_manifest(Path(path))["files"].items() if n.endswith(".distcp")}


def async_saves(root: Path, rank: int, stage: int = 3) -> dict:
    """Async saves at steps 2 and 4 (the second waits for the first) while training goes on, then the same
    run with synchronous saves; a fresh engine resumes the async step-2 checkpoint and trains steps 3-6."""
    runs = {}
    for name, config in (("async", {"checkpoint": {"writer": {"decoupled": True}}}), ("sync", {})):
        engine = _engine(config, stage=stage)
        losses, paths = [], []
        for step in range(6):
            losses.append(_step(engine, step, rank))
            if step in (1, 3):
                engine.save_checkpoint(str(root / name), client_state={"step": step + 1})
                paths.append(str(root / name / f"global_step{step + 1}"))
        in_flight = engine._writer is not None and engine._writer.in_flight
        sealed = engine.wait_for_checkpoint()
        runs[name] = {"losses": losses, "paths": paths, "in_flight_after_loop": in_flight, "sealed": sealed,
                      "latest": (root / name / "latest").read_text()}
    fresh = _engine({"checkpoint": {"writer": {"decoupled": True}}}, stage=stage, seed=1)
    path, client_state = fresh.load_checkpoint(str(root / "async"), tag="global_step2")
    resumed = [_step(fresh, step, rank) for step in range(2, 6)]
    same = [_crcs(next(Path(a).glob("step-*"))) == _crcs(next(Path(s).glob("step-*")))
            for a, s in zip(runs["async"]["paths"], runs["sync"]["paths"])]
    return {**runs, "resumed": resumed, "client_state": client_state, "same_shards": same}


def _part(fn, *args) -> dict:
    """One part's result, or its error (the same on both ranks: each part's calls are collective), so
    that each test fails for its own reason."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - reported by the test that reads this part
        return {"error": f"{type(err).__name__}: {err}"}


def worker(root: str) -> dict:
    deepspeed.init_distributed()
    rank = deepspeed.comm.get_rank()
    return {"tags": _part(tags, Path(root) / "tags", rank), "decay": _part(decay, [2, 3], 3),
            "async": _part(async_saves, Path(root) / "async", rank)}


def exit_worker(root: str) -> list[float]:
    """An asynchronous save as a script's last call: the process exits with the save still being written."""
    deepspeed.init_distributed()
    rank = deepspeed.comm.get_rank()
    engine = _engine({"checkpoint": {"writer": {"decoupled": True}}}, stage=3)
    losses = [_step(engine, step, rank) for step in range(2)]
    engine.save_checkpoint(root, client_state={"step": 2})
    assert engine._writer.in_flight
    return losses
