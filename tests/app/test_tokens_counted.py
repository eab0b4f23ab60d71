"""Tokens/s and MFU count the positions a step really computed: under ``data.pad_to_multiple_of`` the
batches are cut below ``data.seq_len``, and the logged counts follow them.

One world-2 run of the app's own worker (``train_worker``, on the session's gloo pool) over chat-like
rows of known lengths (a masked prompt, a learned reply, a few truncated at the window).  The oracle is
written here in plain Python and torch: the sampler's order (``randperm`` with the run's seed, rank r
taking every second index, as ``DistributedSampler`` does), the collate rule (each batch as long as its
last learned label, rounded up to the multiple, capped at seq_len), and PaLM's FLOPs by hand for the
tiny model (6N per position + 12 x layers x heads x head_dim x the batch's own length).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from deepshard.finetune.config import register, validate
from deepshard.finetune.data.packing import PaddedDataset
from tests.finetune_app.app_harness import scalars

CONF = Path(__file__).resolve().parents[2] / "conf"
SEQ, MULTIPLE, ROWS, ACCUM, WORLD, STEPS, SEED, EOS, PAD = 40, 8, 2, 2, 2, 3, 5, 2, 0
TINY = ["model.vocab_size=96", "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_hidden=64", f"data.seq_len={SEQ}", "data.pack=false", f"data.pad_to_multiple_of={MULTIPLE}",
        f"train.micro_batch_size={ROWS}", f"train.grad_accum={ACCUM}", f"train.max_steps={STEPS}",
        f"train.seed={SEED}", "train.log_every=1", f"launcher.nproc_per_node={WORLD}", "profile.peak_tflops=1.0",
        "checkpoint.resume=none", "train.sample_prompt=null"]
# PaLM by hand (tests/app/test_mfu.py's count of this model): per layer q 32x32, k and v 32x16, o 32x32,
# gate/up/down 32x64, two norms; + the final norm and the head (the embedding is a lookup)
DENSE = 2 * (32 * 32 + 2 * (32 * 16) + 32 * 32 + 3 * (32 * 64) + 2 * 32) + 32 + 96 * 32
ATTENTION = 12 * 2 * 4 * 8  # 12 x layers x heads x head_dim, per position and position of length
register()


def _docs(n: int) -> list[tuple[list[int], list[int]]]:
    """Chat-like token documents: a masked prompt, a learned reply; every seventh longer than the window."""
    rng = random.Random(11)
    docs = []
    for i in range(n):
        prompt = [rng.randrange(3, 96) for _ in range(rng.randint(2, 12 if i % 7 else 50))]
        reply = [rng.randrange(3, 96) for _ in range(rng.randint(1, 9))]
        docs.append(([1, *prompt, *reply], [-100] * (1 + len(prompt)) + reply))
    return docs


def _learned_end(doc: tuple[list[int], list[int]]) -> int:
    """A row's last learned position + 1 inside the window (its labels are the next tokens, eos last)."""
    targets = ([*doc[1], EOS])[1:SEQ + 1]
    return max((j + 1 for j, y in enumerate(targets) if y != -100), default=1)


def _expected(docs) -> list[tuple[int, int]]:
    """(positions, flops per rank) of each step, by the rules above."""
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(SEED)).tolist()
    per_rank = [order[r:len(docs) // WORLD * WORLD:WORLD] for r in range(WORLD)]
    out = []
    for step in range(STEPS):
        positions = attended = 0
        for mine in per_rank:
            for m in range(step * ACCUM, (step + 1) * ACCUM):
                longest = max(_learned_end(docs[i]) for i in mine[m * ROWS:(m + 1) * ROWS])
                length = min(SEQ, -(-longest // MULTIPLE) * MULTIPLE)
                positions += ROWS * length
                attended += ROWS * length * length
        out.append((positions, (6 * DENSE * positions + ATTENTION * attended) // WORLD))
    return out


def _worker(settings, run_dir: str, dataset) -> dict:
    """The app's worker on a pool rank; the process-wide state it sets (the root logger, the save-progress
    listener) is put back for the pool's next test."""
    import logging

    from deepshard.core.checkpoint import progress
    from deepshard.finetune.recipe.assemble import train_worker

    root = logging.getLogger()
    handlers, level, listener = list(root.handlers), root.level, progress.set_listener(None)
    try:
        return train_worker(settings, run_dir, (dataset, None))
    finally:
        progress.set_listener(listener)
        root.handlers[:] = handlers
        root.setLevel(level)


@pytest.fixture(scope="module")
def run(gloo_pool, tmp_path_factory):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        settings = validate(OmegaConf.to_container(compose(config_name="config", overrides=TINY), resolve=True))
    docs = _docs(STEPS * ACCUM * ROWS * WORLD + 3)  # one epoch holds every step
    run_dir = tmp_path_factory.mktemp("tokens_counted")
    summaries = gloo_pool(WORLD).run(_worker, settings, str(run_dir), PaddedDataset(docs, SEQ, EOS, PAD))
    return docs, run_dir, summaries


def test_logged_tokens_and_flops_are_the_positions_computed(run):
    docs, run_dir, summaries = run
    expected = _expected(docs)
    full = ROWS * SEQ * ACCUM * WORLD
    assert all(p < full for p, _ in expected), expected  # every step was cut: the old count overstates
    logged = scalars(run_dir / "tensorboard")
    assert logged["train/tokens"] == [p for p, _ in expected]
    for (positions, flops), tok_s, tflops, mfu in zip(expected, logged["train/tokens_per_s"],
                                                      logged["profile/tflops"], logged["train/mfu"], strict=True):
        seconds = positions / tok_s  # the step's time, from the logged rate
        assert tflops * 1e12 * seconds == pytest.approx(flops, rel=1e-5)
        assert mfu == pytest.approx(tflops, rel=1e-6)  # profile.peak_tflops=1
    total = sum(p for p, _ in expected)
    assert [s["tokens"] for s in summaries] == [total] * WORLD  # the same on every rank
    assert summaries[0]["tokens_per_s"] == pytest.approx(total / summaries[0]["seconds"])
    trainer = json.loads(next((run_dir / "checkpoints").glob("step-*/trainer.json")).read_text())
    assert trainer["app"]["tokens_seen"] == total
