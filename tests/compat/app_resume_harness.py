"""The app's own resume (``checkpoint.resume=OUT_DIR``, RunCheckpoints over the app's engine and data
stream) of a DeepSpeed checkpoint brought in by compat's ds_import, on one rank of a gloo group.

The app's data stream is a dataset laid out so that this run's step k draws exactly the rows of the
fixture's ``global_batch(k)`` (the stream's own seeded permutation, inverted): the losses after the
resume equal DeepSpeed's recorded continuation only if the data position starts at DeepSpeed's step."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from tests.compat.ds_fixture_model import MICRO, SEQ, TOTAL_STEPS, VOCAB, global_batch

ROOT = Path(__file__).resolve().parents[2]
GLOBAL = 2 * MICRO


def app_overrides(stage: int, world: int, resume: str, run_dir: str) -> list[str]:
    """The fixture's ds_config and tiny HF Llama as the app's settings (the model= keys of our Llama)."""
    return [f"+zero=stage{stage}", "precision=fp32", "model.vocab_size=64", "model.dim=16", "model.n_layers=2",
            "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_hidden=32", "model.max_seq_len=32",
            "model.norm_eps=1e-6", "optim.lr=0.01", "optim.betas=[0.9,0.95]", "optim.eps=1e-8",
            "optim.weight_decay=0.1", "optim.grad_clip=1.0", "scheduler=warmup_decay", "scheduler.warmup_min_lr=0",
            "scheduler.warmup_max_lr=0.01", "scheduler.warmup_num_steps=2", "scheduler.warmup_type=linear",
            "scheduler.total_num_steps=10", f"train.micro_batch_size={GLOBAL // world}", "train.grad_accum=1",
            f"train.max_steps={TOTAL_STEPS}", f"data.seq_len={SEQ - 1}", f"launcher.nproc_per_node={world}",
            f"checkpoint.resume={resume}", f"checkpoint.dir={run_dir}/checkpoints"]


def settings_for(overrides: list[str], world: int):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from deepshard.finetune.config import register, validate

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    return validate(OmegaConf.to_container(cfg, resolve=True), world_size=world)


def fixture_dataset(seed: int) -> list[dict[str, torch.Tensor]]:
    """Rows placed where the app's stream (epoch 0, permutation of ``seed``) takes global_batch(k) at step k."""
    from deepshard.finetune.data.resumable import OffsetSampler

    n = GLOBAL * TOTAL_STEPS
    perm = OffsetSampler(n, rank=0, world=1, seed=seed).permutation()
    rows: list[dict[str, torch.Tensor]] = [{}] * n
    for step in range(TOTAL_STEPS):
        for i, row in enumerate(global_batch(step)):
            rows[perm[step * GLOBAL + i]] = {"input_ids": row[:-1].clone(), "labels": row[1:].clone()}
    assert all(rows) and max(int(r["input_ids"].max()) for r in rows) < VOCAB
    return rows


class _NoProfile:
    def phase(self, _name: str):
        return contextlib.nullcontext()


def app_resume_worker(runs: list[tuple[int, str, str]]) -> list[dict]:
    """For each (our ZeRO stage, imported checkpoint dir, run dir): the app's engine and data stream,
    its resume, then the steps up to the fixture's end; the losses, rates, data position and log line."""
    from deepshard.core import build_mesh, init_distributed
    from deepshard.finetune.data.resumable import ResumableStream
    from deepshard.finetune.recipe.assemble import build_stepper, run_meta
    from deepshard.finetune.recipe.checkpointing import start_checkpointing

    rank, world = init_distributed()
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("deepshard").addHandler(handler)
    logging.getLogger("deepshard").setLevel(logging.INFO)
    out = []
    for stage, imported, run_dir in runs:
        records.clear()
        s = settings_for(app_overrides(stage, world, imported, run_dir), world)
        stepper = build_stepper(s, build_mesh(s.parallel), rank=rank)
        dp = stepper.engine.mesh["dp"]
        batches = ResumableStream(fixture_dataset(s.train.seed), dp_rank=dp.get_local_rank(), dp_size=dp.size(),
                                  micro_batch_size=s.train.micro_batch_size, seed=s.train.seed)
        ckpt, start = start_checkpointing(s.checkpoint, run_dir=run_dir, engine=stepper.engine, data=batches,
                                          tokens_per_step=s.tokens_per_step(dp.size()), meta=run_meta(s),
                                          tokenizer=None, micro_batches_per_step=s.micro_batches_per_step)
        stepper.prof = _NoProfile()
        position = batches.state_dict()
        losses, lrs = [], []
        for _ in range(start, TOTAL_STEPS):
            step = stepper(batches)
            losses.append(step.loss)
            lrs.append(step.stats.lr)
        out.append({"start": start, "position": position, "losses": losses, "lrs": lrs,
                    "tokens_seen": ckpt.tokens_seen, "log": [m for m in records if "imported from DeepSpeed" in m]})
    return out
