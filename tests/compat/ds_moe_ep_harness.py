"""Per-rank bodies of tests/compat/test_ds_moe_ep.py (world 4, one pool call): ``deepspeed.initialize`` of a
model holding ``deepspeed.moe.layer.MoE(ep_size > 1)`` trained 3 steps per case, DeepSpeed's groups as
the rank sees them, and bench/bench_ds_moe_cifar.py run with ``import deepshard.compat.deepspeed``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import deepshard.compat.deepspeed as deepspeed

HIDDEN, FFN, EXPERTS, CLASSES, ROWS, STEPS, AUX = 8, 12, 4, 5, 6, 3, 0.01
# (ep, zero stage, accumulation steps, k, drop_tokens, min_capacity, gradient_clipping)
CASES = {"ep2_zero1_accum2_top2_dropless": (2, 1, 2, 2, False, 0, 0.0),
         "ep4_zero3_top1_capacity": (4, 3, 1, 1, True, 1, 0.5),
         "ep2_zero2_top1_capacity_clip": (2, 2, 1, 1, True, 1, 0.5),
         "ep4_zero0_top2_dropless": (4, 0, 1, 2, False, 0, 0.0)}


def weights() -> dict[str, torch.Tensor]:
    """Every weight of the model, experts by global id (the test's reference reads the same)."""
    g = torch.Generator().manual_seed(0)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.4

    w = {"inp.weight": t(HIDDEN, HIDDEN), "inp.bias": t(HIDDEN), "wg": t(EXPERTS, HIDDEN) * 3,
         "out.weight": t(CLASSES, HIDDEN), "out.bias": t(CLASSES)}
    for e in range(EXPERTS):
        w |= {f"e{e}.0.weight": t(FFN, HIDDEN), f"e{e}.0.bias": t(FFN), f"e{e}.2.weight": t(HIDDEN, FFN),
              f"e{e}.2.bias": t(HIDDEN)}
    return w


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    return torch.randn(ROWS, HIDDEN, generator=g), torch.randint(CLASSES, (ROWS,), generator=g)


class Net(nn.Module):
    def __init__(self, ep: int, k: int, drop: bool, min_capacity: int) -> None:
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        expert = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.ReLU(), nn.Linear(FFN, HIDDEN))
        self.moe = deepspeed.moe.layer.MoE(HIDDEN, expert, num_experts=EXPERTS, ep_size=ep, k=k, min_capacity=min_capacity,
                                           drop_tokens=drop, use_rts=False, top2_2nd_expert_sampling=False)
        self.out = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, l_aux, _ = self.moe(torch.relu(self.inp(x)))
        return self.out(y), l_aux


def _load(net: Net, w: dict[str, torch.Tensor], ep_rank: int) -> None:
    local = net.moe.num_local_experts
    with torch.no_grad():
        for name in ("inp.weight", "inp.bias", "out.weight", "out.bias"):
            net.get_parameter(name).copy_(w[name])
        net.moe.deepspeed_moe.gate.wg.weight.copy_(w["wg"])
        for i, e in enumerate(net.moe.deepspeed_moe.experts.deepspeed_experts):
            for n, p in e.named_parameters():
                p.copy_(w[f"e{ep_rank * local + i}.{n}"])


def _full(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def train_case(ep: int, stage: int, accum: int, k: int, drop: bool, min_capacity: int, clip: float) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    net = Net(ep, k, drop, min_capacity)
    ep_rank = rank % ep
    _load(net, weights(), ep_rank)
    config = {"train_batch_size": ROWS * world * accum, "train_micro_batch_size_per_gpu": ROWS,
              "gradient_accumulation_steps": accum, "gradient_clipping": clip, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "betas": [0.9, 0.99], "eps": 1e-8,
                                                        "weight_decay": 0.01}}}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    losses, counts = [], []
    for step in range(STEPS):
        for micro in range(accum):
            x, y = batch(step, micro, rank)
            logits, l_aux = engine(x)
            loss = nn.functional.cross_entropy(logits, y) + AUX * l_aux
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            counts.append(net.moe.deepspeed_moe.exp_counts.tolist())
    params = {n: _full(p) for n, p in net.named_parameters()}
    return {"losses": losses, "counts": counts, "params": params, "ep_rank": ep_rank}


def groups_seen() -> dict:
    g = deepspeed.utils.groups
    name = "ep_size_2"
    return {"ep_ranks": g._get_expert_parallel_group_ranks(name), "edp_ranks": g._get_expert_data_parallel_group_ranks(name),
            "ep_size": g._get_expert_parallel_world_size(name), "ep_rank": g._get_expert_parallel_rank(name),
            "edp_size": g._get_expert_data_parallel_world_size(name), "edp_rank": g._get_expert_data_parallel_rank(name),
            "dp_size": g._get_data_parallel_world_size(), "max_ep": g._get_max_expert_size_name(),
            "names": sorted(g._get_expert_parallel_group_dict())}


def run_all(cifar_variants: dict[str, list[str]]) -> dict:
    out: dict = {name: train_case(*case) for name, case in CASES.items()}
    out["groups"] = groups_seen()
    from bench.bench_ds_moe_cifar import main

    for name, argv in cifar_variants.items():
        out[f"cifar_{name}"] = main(argv, deepspeed)
    return out
