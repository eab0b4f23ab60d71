"""Issue 32: DeepSpeed scripts' bodies (tests/compat/ds_script_harness.py) at world 2 against plain torch
and against real DeepSpeed 0.19.8 running the same bodies (fixtures/ds_scripts.json, recorded by
bench/record_ds_scripts.py: CI needs no DeepSpeed).

One 2-rank launch runs DeepSpeedExamples' CIFAR script (argparse + add_config_arguments, a Net with no
ModuleList of blocks, ds_config Adam + WarmupLR + clipping) at ZeRO 0, 2 and 3 in fp32 with one
save_checkpoint / load_checkpoint round into a fresh engine (and once with the script's default fp16,
which trains in fp32 on CPU); DeepSpeed-Chat's optimizer wiring (grouped FusedAdam + a script-built scheduler) at ZeRO 1;
and a probe of ZeRO-3's parameter attributes and the safe_get_* accessors at ZeRO 2 and 3.  The
references below are single-process torch loops written here (DeepSpeed's WarmupLR rate and
DistributedSampler's order written out from their sources).
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from deepshard.compat.deepspeed.ds_import import import_checkpoint
from tests.compat.ds_script_harness import (
    CIFAR_STAGES,
    Blocks,
    Net,
    cifar_like,
    probe_data,
    run_all,
    warmup_linear,
)
from tests.gloo_pool import pool

_RUN: list = []


def results() -> list[dict]:
    if not _RUN:
        ckpt_root = tempfile.mkdtemp(prefix="ds_scripts_")
        try:  # DeepSpeed's own ZeRO-3 CIFAR checkpoint, imported for ours to resume
            imported = {3: str(import_checkpoint(FIXTURES / "ds_cifar_zero3", Path(ckpt_root) / "imported3"))}
            _RUN.append(pool(2).run(run_all, ckpt_root, imported))
        finally:
            shutil.rmtree(ckpt_root, ignore_errors=True)
    return _RUN[0]


FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE = json.loads((FIXTURES / "ds_scripts.json").read_text())


def rank_batches(micro: int, world: int = 2):
    """DistributedSampler(shuffle=True, seed=0, epoch 0): randperm(n), rank r takes every world-th index."""
    data = cifar_like()
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
    per_rank = [perm[r::world] for r in range(world)]
    for k in range(len(per_rank[0]) // micro):
        yield [(torch.stack([data[i][0] for i in idx[k * micro:(k + 1) * micro]]),
                torch.tensor([data[i][1] for i in idx[k * micro:(k + 1) * micro]])) for idx in per_rank]


def cifar_reference(epochs: int = 1) -> list[list[float]]:
    """Plain torch: AdamW (DeepSpeed's Adam type, adam_w_mode), WarmupLR (log, min 0, max 1e-3 over 1000
    steps; update k uses last_batch_iteration k-1), global-norm clipping at 1.0, ranks' mean losses averaged."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.0, betas=(0.8, 0.999), eps=1e-8, weight_decay=3e-7)
    losses = [[], []]
    batches = [b for _ in range(epochs) for b in rank_batches(8)]  # DeepSpeed's loader sets no epoch: same order
    for k, per_rank in enumerate(batches):
        for g in opt.param_groups:
            g["lr"] = 0.0 if k == 0 else 1e-3 * math.log(k) / math.log(1000)
        opt.zero_grad()
        rank_losses = [F.cross_entropy(net(x), y) for x, y in per_rank]
        (sum(rank_losses) / 2).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        for r in range(2):
            losses[r].append(rank_losses[r].item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("run", ["cifar_stage0", "cifar_stage2", "cifar_stage3", "cifar_stage0_fp16"])
def test_cifar_script_equals_torch(run):
    ref = cifar_reference()
    for rank, out in enumerate(results()):
        got = out[run]["losses"]
        assert len(got) == 8
        assert got == pytest.approx(ref[rank], abs=1e-5), f"rank {rank}"
    assert ref[0][-1] != pytest.approx(ref[0][0], abs=1e-3)  # the rates move the weights: the check can fail


@pytest.mark.slow
@pytest.mark.parametrize("stage", CIFAR_STAGES)
def test_cifar_script_resumed_equals_torch_continuing(stage):
    """save_checkpoint, a fresh engine on other weights, load_checkpoint, one more epoch: torch's second epoch
    (weights, Adam moments, WarmupLR's step and the loader's order all restored)."""
    ref = cifar_reference(epochs=2)
    for rank, out in enumerate(results()):
        assert out[f"cifar_stage{stage}"]["resumed"] == pytest.approx(ref[rank][8:], abs=1e-5), f"rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("stage", CIFAR_STAGES)
def test_cifar_script_equals_deepspeed(stage):
    """The same body and argv under real DeepSpeed: each rank's 8 losses, then its 8 after
    save_checkpoint / load_checkpoint into a fresh engine (Net from another seed), within 1e-4."""
    assert FIXTURE["deepspeed"] == "0.19.8" and FIXTURE["world_size"] == 2
    for rank, out in enumerate(results()):
        ds = FIXTURE["cifar"][f"stage{stage}"][rank]
        assert "error" not in ds, ds
        got = out[f"cifar_stage{stage}"]
        assert len(got["losses"]) == len(got["resumed"]) == len(ds["losses"]) == len(ds["resumed"]) == 8
        assert got["losses"] == pytest.approx(ds["losses"], abs=1e-4), f"rank {rank}"
        assert got["resumed"] == pytest.approx(ds["resumed"], abs=1e-4), f"rank {rank} after resume"


@pytest.mark.slow
def test_deepspeeds_own_cifar_checkpoint_resumed_by_ours():
    """DeepSpeed's ZeRO-3 checkpoint of the CIFAR script after epoch 1 (fixtures/ds_cifar_zero3), imported
    by from_deepspeed and loaded by the script's fresh engine (ours, ZeRO 3, world 2): the next epoch's
    losses are the ones DeepSpeed trained after loading its own checkpoint, within 1e-4."""
    for rank, out in enumerate(results()):
        got = out["cifar_stage3_from_ds"]["resumed"]
        assert got == pytest.approx(FIXTURE["cifar"]["stage3"][rank]["resumed"], abs=1e-4), f"rank {rank}"


def chat_reference(steps: int = 3) -> list[list[float]]:
    """Two groups (decay 0.1 on weights, 0 on biases), AdamW lr 1e-3 betas (0.9, 0.95), the linear warm-up
    factor stepped after each update, accumulation 2, clipping 1.0."""
    torch.manual_seed(0)
    net = Net()
    groups = [{"params": [p for n, p in net.named_parameters() if "bias" not in n], "weight_decay": 0.1},
              {"params": [p for n, p in net.named_parameters() if "bias" in n], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_linear(2, steps))
    data = cifar_like()
    losses = [[], []]
    for update in range(steps):
        opt.zero_grad()
        total = 0.0
        for micro in range(2):
            step = update * 2 + micro
            for r in range(2):
                start = (step * 2 + r) * 8
                x = torch.stack([d[0] for d in data[start:start + 8]])
                y = torch.tensor([d[1] for d in data[start:start + 8]])
                loss = F.cross_entropy(net(x), y)
                total = total + loss / 4  # mean over 2 ranks x 2 micro-batches
                losses[r].append(loss.item())
        total.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        sched.step()
    return losses


@pytest.mark.slow
def test_chat_style_optimizer_and_scheduler_equal_torch():
    ref = chat_reference()
    for rank, out in enumerate(results()):
        assert out["chat_stage1"] == pytest.approx(ref[rank], abs=1e-5), f"rank {rank}"


def probe_reference() -> dict:
    torch.manual_seed(1)
    model = Blocks()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    out = {}
    for step in range(2):
        opt.zero_grad()
        loss = sum(F.cross_entropy(model(x), y) for x, y in (probe_data(step, r) for r in range(2))) / 2
        loss.backward()
        if step == 1:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    out["masters"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["exp_avg"] = {n: opt.state[p]["exp_avg"] for n, p in model.named_parameters()}
    out["exp_avg_sq"] = {n: opt.state[p]["exp_avg_sq"] for n, p in model.named_parameters()}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_safe_get_accessors_and_gathered_parameters(stage):
    ref = probe_reference()
    for rank, out in enumerate(results()):
        got = out[f"probe_stage{stage}"]
        for key in ("grads", "masters", "exp_avg", "exp_avg_sq"):
            for name, value in ref[key].items():
                torch.testing.assert_close(got[key][name], value, rtol=1e-5, atol=1e-7,
                                           msg=lambda m, r=rank, k=key, n=name: f"rank {r} {k} {n}: {m}")
        torch.testing.assert_close(got["gathered_layer0"], ref["masters"]["layers.0.weight"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got["bias_after_modify"], ref["masters"]["head.bias"] + 1.0, rtol=1e-5, atol=1e-6)
        assert torch.equal(got["embed_after_set"], torch.full((8, 6), 0.5))
        # DeepSpeed: only ZeRO-3 parameters carry ds_* attributes (DeepSpeed-Chat branches on hasattr(p, "ds_id"))
        assert all(got["has_ds_id"]) == (stage == 3) and any(got["has_ds_id"]) == (stage == 3)


@pytest.mark.slow
def test_zero3_parameter_attributes():
    shapes = {n: tuple(p.shape) for n, p in Blocks().named_parameters()}
    for rank, out in enumerate(results()):
        got = out["probe_stage3"]
        assert got["ds_numel"] == sum(math.prod(s) for s in shapes.values())  # full counts, not shards
        assert got["ds_ids_unique"] and got["status_outside"]
        assert got["ds_shape"] == shapes
        # Shard(0) rows: 7 rows over 2 ranks are 4 + 3
        assert got["ds_tensor_rows"]["layers.0.weight"] == (4 if rank == 0 else 3)
        assert got["ds_tensor_rows"]["layers.0.bias"] == (4 if rank == 0 else 3)
        from deepshard.compat.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        assert got["status_inside"] == [(ZeroParamStatus.AVAILABLE, 56), (ZeroParamStatus.AVAILABLE, 7)]
