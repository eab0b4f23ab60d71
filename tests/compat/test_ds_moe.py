"""``deepspeed.moe`` against DeepSpeed's documented semantics, written here one token at a time.

The reference (:func:`reference_moe`) follows DeepSpeed 0.19.8's gate as its docs and source describe
it: softmax gates; top-1 the argmax, top-2 the argmax and then the argmax of the other logits (no
Gumbel sampling: ``top2_2nd_expert_sampling=False``), top-k (k > 2) the k largest; capacity
``max(ceil(S / E * capacity_factor * (k if k > 1 else 1)), min_capacity)``; over capacity top-1 keeps
an expert's first tokens (``use_rts=False``), top-2 queues second choices after every first one,
top-k keeps an expert's highest gates; kept gates renormalized for k >= 2; ``l_aux`` per k as
DeepSpeed's; ``exp_counts`` before dropping.  ``(output, l_aux, exp_counts)``, every gradient and the
parameter names equal; ``use_residual``'s mix; ``moe.utils`` and ``compression.helper``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import deepshard.compat.deepspeed as deepspeed

HIDDEN, EXPERTS, TOKENS = 8, 4, 20


def expert() -> nn.Module:
    return nn.Sequential(nn.Linear(HIDDEN, 12), nn.ReLU(), nn.Linear(12, HIDDEN))


def reference_moe(x: torch.Tensor, wg: torch.Tensor, experts: list[nn.Module], *, k: int, factor: float,
                  min_capacity: int, drop: bool) -> tuple[torch.Tensor, torch.Tensor, list[int], int]:
    s = x.shape[0]
    logits = x @ wg.t()
    gates = torch.softmax(logits, dim=-1)
    order = [sorted(range(EXPERTS), key=lambda e: -gates[t, e].item()) for t in range(s)]
    if k == 2:  # the second: the best of the other logits (the same order: softmax is monotone)
        choices = [o[:2] for o in order]
    else:
        choices = [o[:k] for o in order]
    counts = [sum(e in c for c in choices) for e in range(EXPERTS)]
    capacity = max(math.ceil(s / EXPERTS * factor * (k if k > 1 else 1)), min_capacity) if drop else s * k
    kept: list[set[int]] = [set() for _ in range(s)]
    if k <= 2:  # by position: slot-major, token order
        fill = [0] * EXPERTS
        for slot in range(k):
            for t in range(s):
                e = choices[t][slot]
                if fill[e] < capacity:
                    fill[e] += 1
                    kept[t].add(e)
    else:  # each expert keeps its highest gates
        for e in range(EXPERTS):
            mine = sorted((t for t in range(s) if e in choices[t]), key=lambda t: -gates[t, e].item())
            for t in mine[:capacity]:
                kept[t].add(e)
    rows = []
    for t in range(s):
        total = sum(gates[t, e] for e in kept[t]) if k > 1 else 1.0
        out = x.new_zeros(HIDDEN)
        for e in kept[t]:
            out = out + gates[t, e] / total * experts[e](x[t])
        rows.append(out)
    me = gates.mean(dim=0)
    first = torch.tensor([[1.0 if c[0] == e else 0.0 for e in range(EXPERTS)] for c in choices]).mean(dim=0)
    anyk = torch.tensor([[1.0 if e in c else 0.0 for e in range(EXPERTS)] for c in choices]).mean(dim=0)
    l_aux = ((me * first).sum() * EXPERTS if k == 1 else (me * first).mean() * EXPERTS ** 2 if k == 2
             else (me * anyk).mean() * EXPERTS ** 2 / k)
    return torch.stack(rows), l_aux, counts, sum(counts) - sum(len(e) for e in kept)


@pytest.mark.parametrize(("k", "factor", "drop"), [(1, 1.0, True), (2, 0.75, True), (3, 0.5, True), (2, 1.0, False)])
def test_moe_layer_equals_deepspeeds_documented_gate(k, factor, drop):
    torch.manual_seed(0)
    layer = deepspeed.moe.layer.MoE(HIDDEN, expert(), num_experts=EXPERTS, k=k, capacity_factor=factor,
                                    min_capacity=2, drop_tokens=drop, use_rts=False, top2_2nd_expert_sampling=False)
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.mul_(8)  # lopsided routing: capacity bites
    names = [n for n, _ in layer.named_parameters()]
    assert {"deepspeed_moe.gate.wg.weight", "deepspeed_moe.experts.deepspeed_experts.3.2.bias"} <= set(names)
    x = torch.randn(2, TOKENS // 2, HIDDEN, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out, l_aux, counts = layer(x)
    experts = list(layer.deepspeed_moe.experts.deepspeed_experts)
    xr = x.detach().reshape(TOKENS, HIDDEN).clone().requires_grad_()
    want, want_aux, want_counts, dropped = reference_moe(xr, layer.deepspeed_moe.gate.wg.weight, experts, k=k, factor=factor,
                                                min_capacity=2, drop=drop)
    assert counts.tolist() == want_counts and abs(l_aux.item() - want_aux.item()) < 1e-6
    assert (out.reshape(TOKENS, HIDDEN) - want).abs().max().item() < 1e-6
    assert (dropped > 0) == drop, dropped
    probe = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((out.reshape(TOKENS, HIDDEN) * probe).sum() + l_aux, [x, *layer.parameters()])
    ref = torch.autograd.grad((want * probe).sum() + want_aux, [xr, *layer.parameters()], allow_unused=True)
    for n, a, b in zip(["x", *names], grads, ref, strict=True):
        b = torch.zeros_like(a) if b is None else b
        assert (a.reshape(b.shape) - b).abs().max().item() < 1e-5, n


def test_use_residual_mixes_the_dense_copy_by_a_learned_softmax():
    torch.manual_seed(0)
    layer = deepspeed.moe.layer.MoE(HIDDEN, expert(), num_experts=EXPERTS, k=1, use_residual=True, use_rts=False,
                                    drop_tokens=False)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(3))
    out, _, _ = layer(x)
    moe = layer.deepspeed_moe(x)
    coef = torch.softmax(x @ layer.coefficient.weight.t() + layer.coefficient.bias, dim=-1)
    assert (out - (moe * coef[:, :1] + layer.mlp(x) * coef[:, 1:])).abs().max().item() < 1e-6


def test_moe_utils_split_the_expert_params_into_their_own_groups():
    from deepshard.compat.deepspeed.moe.utils import (
        is_moe_param,
        split_params_into_different_moe_groups_for_optimizer,
    )

    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), deepspeed.moe.layer.MoE(HIDDEN, expert(), num_experts=2))
    params = list(model.parameters())
    expert_params = [p for p in params if is_moe_param(p)]
    assert len(expert_params) == 2 * 4 and all(p.group_name == "ep_size_1" for p in expert_params)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "dense", "lr": 0.1},
                                                                  max_group_size=12 * HIDDEN + 12)
    assert [g["name"] for g in groups] == ["dense", "ep_size_1", "ep_size_1", "ep_size_1", "ep_size_1"]
    assert [p for g in groups[1:] for p in g["params"]] == expert_params
    assert all(g["moe"] and g["lr"] == 0.1 for g in groups[1:]) and "moe" not in groups[0]
    assert groups[0]["params"] == [p for p in params if not is_moe_param(p)]
    assert deepspeed.moe.utils.has_moe_layers(model) == (True, 2)
    with pytest.raises(ValueError, match="param_groups: a dict or a list/tuple of dicts"):
        split_params_into_different_moe_groups_for_optimizer(iter(params))


def test_compression_helper_recursive_getattr():
    from deepshard.compat.deepspeed.compression.helper import recursive_getattr, recursive_setattr

    model = nn.Sequential(nn.Sequential(nn.Linear(2, 3)))
    assert recursive_getattr(model, "0.0.weight") is model[0][0].weight
    recursive_setattr(model, "0.0", nn.Identity())
    assert isinstance(model[0][0], nn.Identity)


def test_initialize_refuses_two_expert_parallel_sizes():
    from deepshard.compat.deepspeed.moe.layer import expert_parallel

    layers = [deepspeed.moe.layer.MoE(HIDDEN, expert(), num_experts=4) for _ in range(2)]
    layers[0].ep_size, layers[1].ep_size = 2, 4  # as layers built at ep_size 2 and 4 in a process group report
    with pytest.raises(ValueError, match=r"MoE layers with ep_size=\[2, 4\]: one ep_size > 1 per model"):
        expert_parallel(nn.Sequential(*layers))
    assert expert_parallel(nn.Sequential(deepspeed.moe.layer.MoE(HIDDEN, expert(), num_experts=2))) == (1, [])
