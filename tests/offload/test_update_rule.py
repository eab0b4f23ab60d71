"""A new update rule plugs into the state stores without touching them (issue 47).

The rule is written here (SGD with momentum and per-parameter weight decay, torch's for-loop math on
flat fp32 runs); core's device store, offload's CPU store and its NVMe store run it unchanged, and
each matches a single-process ``torch.optim.SGD(foreach=False)`` bit for bit, the masters and the
momentum buffers both.  Checkpoints name the rule's state after it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from deepshard.core.state_store import DeviceStateStore
from deepshard.core.update_rule import UpdateRule
from deepshard.offload import AioConfig, CpuStateStore, NvmeStateStore, OffloadConfig

SHAPES = [(37, 13), (1000,), (5, 7, 3), (0,), (129, 31), (3,)]
DECAYS = [0.1, 0.0, 0.1, 0.0, 0.05, 0.0]
LR, MOMENTUM, STEPS = 0.05, 0.9, 5
SCALES = [1.0, 0.5, 1.0, 0.25, 1.0]  # a store folds clipping / loss-scale removal in as grad_scale


@dataclass(frozen=True)
class SgdMomentum(UpdateRule):
    """SGD with momentum as torch writes it (``dampening=0``, not Nesterov): one state per parameter."""

    states: ClassVar[tuple[str, ...]] = ("momentum_buffer",)
    momentum: float = MOMENTUM

    def update(self, masters: list[torch.Tensor], grads: list[torch.Tensor], states: Mapping[str, list[torch.Tensor]],
               weight_decays: list[float], *, lr: float, step: int, grad_scale: float) -> None:
        for p, g, buf, wd in zip(masters, grads, states["momentum_buffer"], weight_decays, strict=True):
            d_p = g * grad_scale if grad_scale != 1.0 else g
            if wd != 0:
                d_p = d_p.add(p, alpha=wd)
            if step == 1:
                buf.copy_(d_p)  # torch starts the buffer at the first gradient
            else:
                buf.mul_(self.momentum).add_(d_p)
            p.add_(buf, alpha=-lr)


def _data(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """fp32 initial values, and gradients as the params' dtype holds them (held here in fp32)."""
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen).to(dtype).float() for s in SHAPES] for _ in range(STEPS)]
    return base, grads


def _reference(base: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> tuple[list[torch.Tensor], list]:
    """Plain torch.optim.SGD, one process, fp32, the grads pre-scaled as the stores are told to scale them."""
    params = [torch.nn.Parameter(b.clone()) for b in base]
    groups = [{"params": [p for p, d in zip(params, DECAYS) if d == wd], "weight_decay": wd} for wd in sorted(set(DECAYS))]
    opt = torch.optim.SGD(groups, lr=LR, momentum=MOMENTUM, foreach=False)
    for step_grads, scale in zip(grads, SCALES, strict=True):
        for p, g in zip(params, step_grads):
            p.grad = g * scale if scale != 1.0 else g.clone()
        opt.step()
    bufs = [opt.state[p]["momentum_buffer"] if p in opt.state else torch.zeros_like(p) for p in params]
    return [p.detach() for p in params], bufs


def _nvme(tmp_path):
    config = OffloadConfig(device="nvme", nvme_path=str(tmp_path), sub_group_size=1024, buffer_size=1024,
                           buffer_count=2, aio=AioConfig(block_size=4096))
    return lambda params, decays, rule, **kw: NvmeStateStore(params, decays, rule, config=config, **kw)


@pytest.mark.parametrize("where", ["device", "cpu", "nvme"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_toy_rule_in_each_store_matches_torch_sgd(where, dtype, tmp_path):
    base, grads = _data(dtype=dtype)
    ref_params, ref_bufs = _reference(base, grads)
    make = {"device": DeviceStateStore, "cpu": CpuStateStore, "nvme": _nvme(tmp_path)}[where]
    params = [b.to(dtype) for b in base]
    masters = None if dtype == torch.float32 else [b.clone() for b in base]  # taken before the cast
    store = make(params, DECAYS, SgdMomentum(), masters=masters)
    try:
        for step, (step_grads, scale) in enumerate(zip(grads, SCALES, strict=True), start=1):
            with torch.no_grad():
                store.step([g.to(dtype, copy=True) for g in step_grads], lr=LR, step=step, grad_scale=scale)
        state = store.state_dict()
        assert set(state) == {"master", "momentum_buffer"}  # checkpoint keys: model.<p>, optim.momentum_buffer.<p>
        for i in range(len(SHAPES)):
            assert torch.equal(state["master"][i], ref_params[i]), f"master {i} ({where}, {dtype})"
            assert torch.equal(state["momentum_buffer"][i], ref_bufs[i]), f"momentum {i} ({where}, {dtype})"
            assert torch.equal(params[i], ref_params[i].to(dtype)), f"param {i} ({where}, {dtype})"
        held = store.state_bytes()
        assert sum(held.values()) >= 4 * sum(b.numel() for b in base)  # one state (not Adam's two) at least
    finally:
        store.close()


def test_toy_rule_state_round_trips_through_a_store(tmp_path):
    """``load_state_dict`` takes the rule's state by its name: a resumed store continues exactly."""
    base, grads = _data(1)
    ref_params, ref_bufs = _reference(base, grads)
    first = CpuStateStore([b.clone() for b in base], DECAYS, SgdMomentum())
    with torch.no_grad():
        for step in (1, 2):
            first.step([g.clone() for g in grads[step - 1]], lr=LR, step=step, grad_scale=SCALES[step - 1])
    saved = {k: [t.clone() for t in v] for k, v in first.state_dict().items()}
    resumed_params = [torch.zeros_like(b) for b in base]
    resumed = DeviceStateStore(resumed_params, DECAYS, SgdMomentum())
    resumed.load_state_dict(saved)
    with torch.no_grad():
        for step in range(3, STEPS + 1):
            resumed.step([g.clone() for g in grads[step - 1]], lr=LR, step=step, grad_scale=SCALES[step - 1])
    for i in range(len(SHAPES)):
        assert torch.equal(resumed_params[i], ref_params[i])
        assert torch.equal(resumed.state_dict()["momentum_buffer"][i], ref_bufs[i])
