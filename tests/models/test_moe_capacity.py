"""DeepSpeed's token dropping and ST-MoE's router z-loss on the MoE block, against references written here.

The reference (:func:`reference_block`) is plain torch, one token and one slot at a time: softmax
router, a stable descending sort per token for its experts, DeepSpeed's capacity
``max(ceil(tokens / experts * factor * k), min_capacity)`` filled slot-major (every first choice in
token order, then every second choice), a SwiGLU per kept (token, slot).  Outputs, the dropped count
and every gradient equal ours within 1e-5, for the grouped GEMM and the per-expert loop, in train mode
(``capacity_factor``) and eval mode (``eval_capacity_factor``).  ``reference_block`` is also the oracle
of the expert-parallel case (tests/models/test_moe_ep_resume.py).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

TOKENS, DIM, HIDDEN, EXPERTS = 24, 12, 10, 4


def block_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Router weights large (lopsided routing, so capacity bites), expert weights small."""
    g = torch.Generator().manual_seed(seed)
    return {"gate": 2 * torch.randn(EXPERTS, DIM, generator=g),
            "gate_up": 0.3 * torch.randn(EXPERTS, 2 * HIDDEN, DIM, generator=g),
            "down": 0.3 * torch.randn(EXPERTS, DIM, HIDDEN, generator=g)}


def reference_block(x: torch.Tensor, w: dict[str, torch.Tensor], *, k: int, factor: float, min_capacity: int,
                    drop: bool, norm: bool = True) -> tuple[torch.Tensor, int]:
    """(output [T, DIM], dropped (token, slot) pairs): softmax top-k with DeepSpeed's capacity, one by one."""
    probs = torch.softmax(x @ w["gate"].t(), dim=-1)
    t_count = x.shape[0]
    choices = [sorted(range(EXPERTS), key=lambda e: -probs[t, e].item())[:k] for t in range(t_count)]
    capacity = max(math.ceil(t_count / EXPERTS * factor * k), min_capacity) if drop else t_count * k
    fill, kept, dropped = [0] * EXPERTS, [], 0
    for slot in range(k):
        for t in range(t_count):
            e = choices[t][slot]
            if fill[e] < capacity:
                fill[e] += 1
                kept.append((t, slot))
            else:
                dropped += 1
    rows = [x.new_zeros(DIM) for _ in range(t_count)]
    for t, slot in kept:
        e = choices[t][slot]
        weight = probs[t, e] / (probs[t, choices[t]].sum() if norm else 1.0)
        gate, up = (w["gate_up"][e] @ x[t]).chunk(2)
        rows[t] = rows[t] + weight * (w["down"][e] @ (F.silu(gate) * up))
    return torch.stack(rows), dropped


def _ours(w: dict[str, torch.Tensor], *, k: int, impl: str, capacity, z_coef: float = 0.0):
    from deepshard.finetune.models.moe import RouterStats, SparseMoe

    moe = SparseMoe(DIM, HIDDEN, EXPERTS, k, routing="softmax_topk", norm_topk_prob=True, impl=impl,
                    stats=RouterStats(z_coef=z_coef, last_layer=0), capacity=capacity)
    with torch.no_grad():
        moe.gate.weight.copy_(w["gate"])
        moe.experts.gate_up_proj.copy_(w["gate_up"])
        moe.experts.down_proj.copy_(w["down"])
    return moe


@pytest.mark.parametrize("impl", ["grouped", "loop"])
@pytest.mark.parametrize("k", [1, 2])
def test_capacity_drops_the_tokens_deepspeeds_formula_drops(impl, k):
    from deepshard.finetune.models.moe import CapacityConfig

    cap = CapacityConfig(capacity_factor=0.5, eval_capacity_factor=1.5, min_capacity=2, drop_tokens=True)
    w = block_weights()
    x = torch.randn(2, TOKENS // 2, DIM, generator=torch.Generator().manual_seed(1))
    moe = _ours(w, k=k, impl=impl, capacity=cap)
    for training, factor in ((True, 0.5), (False, 1.5)):
        moe.train(training)
        xo, xr = x.clone().requires_grad_(), x.reshape(TOKENS, DIM).clone().requires_grad_()
        wr = {n: t.clone().requires_grad_() for n, t in w.items()}
        out = moe(xo)
        want, dropped = reference_block(xr, wr, k=k, factor=factor, min_capacity=2, drop=True)
        assert moe.stats.dropped[0] == dropped and (dropped > 0 if training else True), (moe.stats.dropped, dropped)
        assert (out.reshape(TOKENS, DIM) - want).abs().max().item() < 1e-5
        probe = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(2))
        (out.reshape(TOKENS, DIM) * probe).sum().backward()
        (want * probe).sum().backward()
        got = {"x": xo.grad.reshape(TOKENS, DIM), "gate": moe.gate.weight.grad,
               "gate_up": moe.experts.gate_up_proj.grad, "down": moe.experts.down_proj.grad}
        ref = {"x": xr.grad, **{n: t.grad for n, t in wr.items()}}
        assert {n: (got[n] - ref[n]).abs().max().item() < 1e-5 for n in got} == dict.fromkeys(got, True)
        moe.zero_grad()
    assert moe.stats.scalars()["moe/dropped_tokens"] == moe.stats.dropped[0]


def test_dropless_by_default_and_a_large_capacity_drops_nothing():
    from deepshard.finetune.models.moe import CapacityConfig

    w = block_weights()
    x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(3))
    want, _ = reference_block(x, w, k=2, factor=1.0, min_capacity=4, drop=False)
    for cap in (CapacityConfig(), CapacityConfig(capacity_factor=4.0, drop_tokens=True)):
        moe = _ours(w, k=2, impl="grouped", capacity=cap)
        with torch.no_grad():
            assert (moe(x) - want).abs().max().item() < 1e-5 and moe.stats.dropped[0] == 0


def test_router_z_loss_is_added_to_the_step_loss_and_reported():
    """ST-MoE: coef * mean over tokens of logsumexp(logits)^2, its gradient reaching the router."""
    from deepshard.finetune.models.moe import CapacityConfig

    w, coef = block_weights(), 0.05
    x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(4))
    moe = _ours(w, k=2, impl="grouped", capacity=CapacityConfig(), z_coef=coef)
    moe(x).sum().backward()
    wr = {n: t.clone().requires_grad_() for n, t in w.items()}
    want, _ = reference_block(x, wr, k=2, factor=1.0, min_capacity=4, drop=False)
    z = torch.logsumexp(x @ wr["gate"].t(), dim=-1).square().mean()
    (want.sum() + coef * z).backward()
    assert abs(moe.stats.scalars()["moe/z_loss"] - z.item()) < 1e-5
    assert (moe.gate.weight.grad - wr["gate"].grad).abs().max().item() < 1e-5


@pytest.mark.parametrize(("kw", "match"), [(dict(capacity_factor=0.0), r"model\.capacity_factor=0\.0: must be > 0"),
                                           (dict(min_capacity=-1), r"model\.min_capacity=-1: must be >= 0"),
                                           (dict(router_z_loss_coef=-1.0), r"model\.router_z_loss_coef=-1\.0")])
def test_bad_capacity_keys_are_refused_by_name(kw, match):
    from deepshard.finetune.models.moe_decoder import MoeConfig

    with pytest.raises(ValueError, match=match):
        MoeConfig(**kw)


def _validate(tmp_path, overrides: list[str]):
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from deepshard.finetune.config import register, validate
    from tests.models.moe_refs import moe_hf_model

    path = tmp_path / "hf"
    moe_hf_model("qwen3_moe").save_pretrained(str(path))
    (path / "tokenizer.json").write_text("{}")
    register()
    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose(config_name="config", overrides=[f"model.path={path}", "data.seq_len=32", *overrides])
    return validate(OmegaConf.to_container(cfg, resolve=True), world_size=2)


def test_the_app_takes_the_moe_keys_and_refuses_them_for_a_dense_model(tmp_path):
    s = _validate(tmp_path, ["model=hf", "model.drop_tokens=true", "model.capacity_factor=1.25",
                             "model.router_z_loss_coef=0.001"])
    assert (s.model.drop_tokens, s.model.capacity_factor, s.model.router_z_loss_coef) == (True, 1.25, 0.001)
    assert s.model.eval_capacity_factor == 1.0  # not given: the family's default
    with pytest.raises(ValueError, match=r"model\.drop_tokens=True: an MoE key; model 'tiny' has no experts"):
        _validate(tmp_path, ["model=tiny", "model.drop_tokens=true"])
