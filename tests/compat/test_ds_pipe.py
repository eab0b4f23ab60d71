"""Issue 32: ``deepspeed.pipe.PipelineModule`` + ``engine.train_batch`` / ``eval_batch`` on deepshard.pipeline,
world 2 (pp=2 with an embedding tied to the output head across the two stages, clipped at 0.5; and pp=1 x
dp=2), against a plain single-process torch loop written here: DeepSpeed's pipeline loss contract (the
mean of the micro-batches' mean losses, averaged over dp ranks), AdamW, the tied weight in the gradient
norm once; and against real DeepSpeed 0.19.8's PipelineEngine running the same harness bodies at pp=2
(fixtures/ds_scripts.json, recorded by bench/record_ds_scripts.py on CPU/gloo: CI needs no DeepSpeed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from tests.compat.ds_pipe_harness import HIDDEN, VOCAB, micro_batch, run_all
from tests.gloo_pool import pool

_RUN: list = []


def results() -> list[dict]:
    if not _RUN:
        _RUN.append(pool(2).run(run_all))
    return _RUN[0]


FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "ds_scripts.json").read_text())


def reference(steps: int, gas: int, dp: int, clip: float = 0.0, first_stage_norm: bool = False):
    """``first_stage_norm``: clip every gradient with the norm of pp=2's first stage's parameters only
    (the tied embedding and the first Linear), as DeepSpeed 0.19.8's fp32 ZeRO-0 pipeline does."""
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
        if first_stage_norm:
            norm = torch.norm(torch.stack([p.grad.norm() for p in [*embed.parameters(), *l1.parameters()]]))
            for p in params:
                p.grad.mul_(min(1.0, clip / (norm.item() + 1e-6)))
            norms.append(norm.item())
        else:
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
    """The engine's loader at dp=1: DeepSpeed's PipelineEngine._build_data_iter samples with
    DistributedSampler(shuffle=False), i.e. the rows in order, in micro-batches of 2; the tied model
    trained as in reference()."""
    rows = [row for k in range(steps * gas) for row in zip(*micro_batch(k))]
    order = list(range(len(rows)))
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


@pytest.mark.slow
@pytest.mark.parametrize("run", ["pp2_noclip", "pp2_zero1"])
def test_pipeline_module_at_pp2_equals_deepspeeds_pipeline_engine(run):
    """The pp=2 tied script under DeepSpeed's PipelineEngine (its stage-local build given the one-process
    weights, see the recorder): train_batch's 3 losses and eval_batch's loss on both stages within 1e-5;
    without clipping at ZeRO 0, and clipped at 0.5 at ZeRO 1 (DeepSpeed's ZeRO optimizer's global norm)."""
    assert FIXTURE["deepspeed"] == "0.19.8" and FIXTURE["world_size"] == 2
    for rank, out in enumerate(o[run] for o in results()):
        ds = FIXTURE["pipe"][run][rank]
        assert "error" not in ds, ds
        assert (out["first"], out["last"]) == (ds["first"], ds["last"])
        assert out["losses"] == pytest.approx(ds["losses"], abs=1e-5), f"rank {rank}"
        assert out["eval"] == pytest.approx(ds["eval"], abs=1e-5), f"rank {rank}"
        assert ds["forward_refused"].rstrip(".") in out["forward_refused"]
        if run == "pp2_zero1":  # get_global_grad_norm(): DeepSpeed's ZeRO optimizer's, the tied weight once
            assert out["norms"] == pytest.approx(ds["norms"], rel=1e-5), f"rank {rank}"
    # the weights matter: DeepSpeed's own stage-local init (seed 0 on each stage) trains to other losses
    own_init = FIXTURE["pipe"]["pp2_stage_local_init"][0]["losses"]
    assert own_init[0] != pytest.approx(FIXTURE["pipe"]["pp2"][0]["losses"][0], abs=1e-2)


@pytest.mark.slow
def test_deepspeeds_fp32_zero0_pipeline_clips_with_the_first_stages_norm():
    """Where ours and DeepSpeed differ, on purpose: at ZeRO 0 in fp32, DeepSpeed's PipelineEngine clips with
    runtime.utils.clip_grad_norm_(mpu=grid), which counts only model-parallel rank 0's parameters, and the
    pipeline grid's model-parallel rank is the stage: every stage scales by the first stage's norm.  The
    fixture equals that loop written in torch; ours clips by the global norm (the tied weight once), as
    torch.nn.utils.clip_grad_norm_ over the whole model does and as DeepSpeed's ZeRO-1 pipeline does."""
    ds_like, _, _ = reference(steps=3, gas=4, dp=1, clip=0.5, first_stage_norm=True)
    ours_like, _, _ = reference(steps=3, gas=4, dp=1, clip=0.5)
    for rank, ds in enumerate(FIXTURE["pipe"]["pp2"]):
        assert ds["losses"] == pytest.approx(ds_like[0], abs=1e-5), f"rank {rank}"
        assert ds["losses"][2] != pytest.approx(ours_like[0][2], abs=1e-4)  # the two rules part at step 3
        assert ds["norms"] == [None] * 3  # DeepSpeed's get_global_grad_norm() there: None
    for rank, out in enumerate(o["pp2"] for o in results()):
        assert out["losses"] == pytest.approx(ours_like[0], abs=1e-5), f"rank {rank}"


@pytest.mark.slow
def test_train_batch_loader_equals_deepspeeds():
    """training_data= + train_batch(): DeepSpeed's pipeline loader reads the rows in order (no shuffle)."""
    for rank, out in enumerate(o["loader"] for o in results()):
        assert out == pytest.approx(FIXTURE["pipe"]["loader"][rank], abs=1e-5), f"rank {rank}"
