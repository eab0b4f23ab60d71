"""Issue 32: ``deepspeed.pipe.PipelineModule`` + ``engine.train_batch`` / ``eval_batch`` on deepshard.pipeline,
world 2 (pp=2 with an embedding tied to the output head across the two stages, clipped at 0.5; and pp=1 x
dp=2), against a plain single-process torch loop written here: DeepSpeed's pipeline loss contract (the
mean of the micro-batches' mean losses, averaged over dp ranks), AdamW, the tied weight in the gradient
norm once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from ds_pipe_harness import HIDDEN, VOCAB, micro_batch, run_all
from torch import nn

from deepshard.launch.local import launch_local

_RUN: list = []


def results() -> list[dict]:
    if not _RUN:
        _RUN.append(launch_local(run_all, 2))
    return _RUN[0]


def reference(steps: int, gas: int, dp: int, clip: float = 0.0):
    torch.manual_seed(0)  # the layers in PipelineModule's order: the tied embedding once, then two Linears
    embed, l1, l2 = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
    params = [*embed.parameters(), *l1.parameters(), *l2.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)

    def loss_of(ids, labels):
        logits = l2(torch.tanh(l1(embed(ids)))) @ embed.weight.t()
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

    losses, norms = [[] for _ in range(dp)], []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for r in range(dp):
            rank_loss = sum(loss_of(*micro_batch((step * gas + k) * dp + r)) for k in range(gas)) / gas
            losses[r].append(rank_loss.item())
            total = total + rank_loss / dp
        total.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, clip if clip else float("inf")).item())
        opt.step()
    with torch.no_grad():
        evals = [(sum(loss_of(*micro_batch(1000 + k * dp + r)) for k in range(gas)) / gas).item() for r in range(dp)]
    return losses, sum(evals) / dp, norms


@pytest.mark.slow
def test_pipeline_module_with_tied_layers_at_pp2_equals_torch():
    ref, ref_eval, ref_norms = reference(steps=3, gas=4, dp=1, clip=0.5)  # the tied weight's grad counted once
    outs = [o["pp2"] for o in results()]
    assert [o["first"] for o in outs] == [True, False] and [o["last"] for o in outs] == [False, True]
    assert outs[0]["ranges"][1][-1] == 4 and len(outs[0]["ranges"]) == 2  # the tied embedding on both stages
    for rank, out in enumerate(outs):  # train_batch's loss on every stage, as DeepSpeed broadcasts it
        assert out["losses"] == pytest.approx(ref[0], abs=1e-5), f"rank {rank}"
        assert out["norms"] == pytest.approx(ref_norms, rel=1e-5)
        assert out["eval"] == pytest.approx(ref_eval, abs=1e-5)
        assert "Only train_batch() is accessible in pipeline mode" in out["forward_refused"]


@pytest.mark.slow
def test_pipeline_module_data_parallel_equals_torch():
    ref, ref_eval, _ = reference(steps=3, gas=2, dp=2)
    mean = [sum(v) / 2 for v in zip(*ref)]  # DeepSpeed's train_batch returns the dp-averaged loss
    for rank, out in enumerate(o["dp2"] for o in results()):
        assert out["losses"] == pytest.approx(mean, abs=1e-5), f"rank {rank}"
        assert out["eval"] == pytest.approx(ref_eval, abs=1e-5)


def loader_reference(steps: int, gas: int):
    """The engine's loader at dp=1: DistributedSampler(shuffle, seed 0) = randperm(n) with seed 0, rows in
    micro-batches of 2; the tied model trained as in reference()."""
    rows = [row for k in range(steps * gas) for row in zip(*micro_batch(k))]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    torch.manual_seed(0)
    embed, l1, l2 = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
    opt = torch.optim.AdamW([*embed.parameters(), *l1.parameters(), *l2.parameters()], lr=1e-2, weight_decay=0.0)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for k in range(gas):
            idx = order[(step * gas + k) * 2:(step * gas + k + 1) * 2]
            ids = torch.stack([rows[i][0] for i in idx])
            labels = torch.stack([rows[i][1] for i in idx])
            logits = l2(torch.tanh(l1(embed(ids)))) @ embed.weight.t()
            total = total + F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)) / gas
        total.backward()
        opt.step()
        losses.append(total.item())
    return losses


@pytest.mark.slow
def test_train_batch_reads_the_engines_own_loader():
    ref = loader_reference(steps=2, gas=4)
    for rank, out in enumerate(o["loader"] for o in results()):
        assert out == pytest.approx(ref, abs=1e-5), f"rank {rank}"
