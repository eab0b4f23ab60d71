"""Muon (optim.name=muon): hidden matrices by Muon, the rest by AdamW, at world 1 and under ZeRO 1-3.

Oracles written here with plain torch: ``torch.optim.Muon`` + ``torch.optim.AdamW`` (torch's Muon runs
Newton-Schulz in bf16, so ours runs it in bf16 for that check), and a reference Muon in fp32 for the
ZeRO checks (torch's bf16 iteration turns a 1e-6 change of a gradient into ~1e-4 of the update).
One world-2 launch runs stages 1, 2, 3, each again with the optimizer state in the host store
(``offload.device=cpu``: CpuStateStore runs the rule), and a resume across stages; each test checks its slice.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepshard.core import EngineConfig, OptimConfig, PrecisionConfig, ZeroConfig
from deepshard.core.optim import decays
from deepshard.core.state_store import DeviceStateStore
from tests.core.zero_harness import SEQ, batches, build_model

STEPS = 5
OPTIM = OptimConfig(name="muon", lr=2e-3, muon_lr=0.02, eps=1e-6, weight_decay=0.1, grad_clip=0.0)


def _hidden(name: str, p: torch.Tensor) -> bool:  # the split, written here: 2-D, not embedding or head
    return p.dim() == 2 and "embed" not in name and "lm_head" not in name


def _ns_fp32(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz (the same addmm form), in fp32."""
    a, b, c = 3.4445, -4.775, 2.0315
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if g.shape[0] > g.shape[1] else x


class _RefMuon:
    """fp32 Muon: momentum 0.95, nesterov, lr scaled by sqrt(max(1, rows/cols)), decoupled decay."""

    def __init__(self, params: list[torch.Tensor], lr: float, weight_decay: float) -> None:
        self.params, self.lr, self.wd = params, lr, weight_decay
        self.bufs = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self) -> None:
        for p, buf in zip(self.params, self.bufs):
            buf.lerp_(p.grad, 0.05)
            update = _ns_fp32(p.grad.lerp(buf, 0.95))
            p.mul_(1 - self.lr * self.wd)
            p.add_(update, alpha=-self.lr * math.sqrt(max(1.0, p.shape[0] / p.shape[1])))


def _reference(num_steps: int, world: int, *, torch_muon: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single process, the whole global batch at once: Muon on the hidden matrices, AdamW on the rest."""
    model = build_model()
    named = list(model.named_parameters())
    hidden = [p for n, p in named if _hidden(n, p)]
    rest = [(n, p) for n, p in named if not _hidden(n, p)]
    adam = torch.optim.AdamW([{"params": [p for _, p in rest if p.dim() >= 2], "weight_decay": OPTIM.weight_decay},
                              {"params": [p for _, p in rest if p.dim() < 2], "weight_decay": 0.0}],
                             lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps, fused=True)
    muon = (torch.optim.Muon(hidden, lr=OPTIM.muon_lr, weight_decay=OPTIM.weight_decay, momentum=0.95)
            if torch_muon else _RefMuon(hidden, OPTIM.muon_lr, OPTIM.weight_decay))
    data = batches(num_steps, world, 1)
    losses = []
    for step in range(num_steps):
        tokens = data[step].reshape(-1, SEQ + 1)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        adam.step()
        muon.step()
        model.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _ours_world1(num_steps: int, ns_dtype: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Our rule on a world-1 store (no process group): the rule and split as build_optimizer makes them."""
    from deepshard.core.muon import Muon, muon_split
    from deepshard.core.update_rule import AdamW

    model = build_model()
    names, params = zip(*model.named_parameters())
    shapes = tuple(tuple(p.shape) for p in params)
    rule = Muon(use_muon=tuple(muon_split(names, shapes)), shapes=shapes, adam=AdamW(betas=OPTIM.betas, eps=OPTIM.eps),
                base_lr=OPTIM.lr, muon_lr=OPTIM.muon_lr, ns_dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[ns_dtype])
    store = DeviceStateStore(list(params), decays(list(params), OPTIM.weight_decay), rule)
    data = batches(num_steps, 1, 1)
    losses = []
    for step in range(num_steps):
        tokens = data[step].reshape(-1, SEQ + 1)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        with torch.no_grad():
            store.step([p.grad for p in params], lr=OPTIM.lr, step=step + 1)
        model.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


@pytest.mark.parametrize("ns_dtype", ["bf16", "fp32"])
def test_world1_equals_torch_muon_plus_adamw(ns_dtype):
    ref_losses, ref = _reference(STEPS, 1, torch_muon=ns_dtype == "bf16")
    losses, ours = _ours_world1(STEPS, ns_dtype)
    # bf16: torch.optim.Muon's numbers bit for bit; fp32: the reference below
    tol = 0.0 if ns_dtype == "bf16" else 1e-6
    assert losses == pytest.approx(ref_losses, rel=tol, abs=0)
    for name, p in ref.items():
        assert _rel(ours[name], p) <= tol, name
    moved = {n for n in ref if _hidden(n, ref[n]) and _rel(build_model().state_dict()[n], ref[n]) > 1e-3}
    assert moved, "Muon moved no hidden matrix"


def _config(stage: int) -> EngineConfig:
    return EngineConfig(zero=ZeroConfig(stage=stage, reduce_bucket_size=3000, allgather_bucket_size=3000),
                        precision=PrecisionConfig(dtype="fp32"), optim=OPTIM)


def _worker(tmp: str):
    import torch.distributed as dist

    from deepshard.core import init_distributed, initialize
    from deepshard.core.checkpoint.state import load_checkpoint, save_checkpoint
    from deepshard.core.mesh import local_device
    from deepshard.offload import CpuStateStore
    from tests.core.zero_harness import distributed_run

    init_distributed()
    out = {stage: distributed_run(_config(stage), STEPS)[:2] for stage in (1, 2, 3)}
    out.update({f"offload{stage}": distributed_run(_config(stage), STEPS, store_factory=CpuStateStore)[:2]
                for stage in (1, 2, 3)})
    # resume across layouts: 3 steps at stage 1, saved; loaded at stage 3, 2 more steps
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches(STEPS, world, 1).to(local_device())
    losses, saved = [], []
    for stage, steps in ((1, range(3)), (3, range(3, STEPS))):
        engine = initialize(build_model().to(local_device()), _config(stage))
        if stage == 3:
            load_checkpoint(saved[0], engine.optimizer, engine.mesh["dp"], model=engine.model)
        for step in steps:
            tokens = data[step, 0, rank]
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world)
        if stage == 1:
            saved.append(save_checkpoint(tmp, 3, engine.optimizer, engine.mesh["dp"], model=engine.model))
    out["resume"] = losses, {n: (p.data.full_tensor() if hasattr(p.data, "full_tensor") else p.data).clone()
                             for n, p in engine.model.named_parameters()}
    return out


@pytest.fixture(scope="module")
def runs(gloo_pool, tmp_path_factory):
    results = gloo_pool(2).run(_worker, str(tmp_path_factory.mktemp("muon_ckpt")))
    return results[0], _reference(STEPS, 2, torch_muon=False)


@pytest.mark.parametrize("case", [1, 2, 3, "offload1", "offload2", "offload3", "resume"])
@pytest.mark.slow  # a multi-rank launch: the full suite (the inner loop keeps the in-process checks)
def test_zero_world2_equals_world1(runs, case):
    out, (ref_losses, ref) = runs
    losses, params = out[case]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    if str(case).startswith("offload"):  # and the same run without offload, step for step
        assert losses == pytest.approx(out[int(case[-1])][0], rel=1e-6)
    for name, p in ref.items():
        assert _rel(params[name.replace("_checkpoint_wrapped_module.", "")], p) < 1e-5, (case, name)


def test_bad_values_name_the_key():
    with pytest.raises(ValueError, match="name.*'sgd'.*adamw"):
        OptimConfig(name="sgd")
    with pytest.raises(ValueError, match="ns_dtype"):
        OptimConfig(ns_dtype="fp8")


def test_deepspeed_muon_and_bf16_state_keys_translate():
    from deepshard.compat.ds_config import translate

    t = translate({"optimizer": {"type": "Muon", "params": {"muon_lr": 0.01, "adam_lr": 1e-4}},
                   "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}})
    assert {"optim.name=muon", "optim.muon_lr=0.01", "optim.lr=0.0001", "optim.state_dtype=bf16"} <= set(t.overrides)
    with pytest.raises(ValueError, match="bf16_optimizer_states=true needs bf16.bf16_master_weights_and_grads"):
        translate({"bf16": {"enabled": True, "bf16_optimizer_states": True}})
