"""Expert parallelism, one world-4 launch (the session's gloo pool) for two things:

- **Capacity under ep**: a capacity-limited MoE block split over ep=2 (two groups of 2 ranks), each rank
  with its own tokens: its output, its dropped count and its input's gradient equal
  ``reference_block`` (written in tests/models/test_moe_capacity.py, plain torch, all experts local) on
  that rank's tokens; a rank's expert gradient is its group's reference gradients summed, times 1/ep
  (models/moe_ep.py's scale, which ZeRO's average over dp undoes).  Dropping happens before dispatch:
  a dropped pair that travelled and ran would change the output.
- **DeepSpeed's MoE layer with ep_size=2** (compat): each rank's ``(output, l_aux, exp_counts)`` and its
  input's gradient equal the ep_size=1 layer holding every expert on that rank's tokens.
- **Layout-free checkpoints**: a tiny Qwen3-MoE trained at ep=2 (ZeRO-1) saves after step 2; loaded at
  ep=4 (ZeRO-3) and at ep=1 (ZeRO-2), step 3's loss and every parameter equal the uninterrupted ep=2
  run within 1e-5 (the checkpoint holds canonical [num_experts, ...] tensors: it names no layout); the
  HF export of that checkpoint loads in transformers with the saved parameters under its own names.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tests.models.test_moe_capacity import DIM, EXPERTS, HIDDEN, TOKENS, block_weights, reference_block
from tests.models.test_moe_ep import ACCUM, NUM_EXPERTS, micro, rows

WORLD, EP, K, FACTOR, MIN_CAP = 4, 2, 2, 0.5, 2


def _capacity_case() -> dict:
    from deepshard.core import ParallelDims, build_mesh
    from deepshard.finetune.models.moe import CapacityConfig, RouterStats, SparseMoe
    from deepshard.finetune.models.moe_ep import apply_ep

    mesh = build_mesh(ParallelDims(dp=WORLD, ep=EP))
    rank = mesh["dp"].get_local_rank()
    w = block_weights()
    moe = SparseMoe(DIM, HIDDEN, EXPERTS, K, routing="softmax_topk", norm_topk_prob=True,
                    stats=RouterStats(last_layer=0),
                    capacity=CapacityConfig(capacity_factor=FACTOR, min_capacity=MIN_CAP, drop_tokens=True))
    with torch.no_grad():
        moe.gate.weight.copy_(w["gate"])
        moe.experts.gate_up_proj.copy_(w["gate_up"])
        moe.experts.down_proj.copy_(w["down"])
    apply_ep(moe, mesh["ep"])
    x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(10 + rank)).requires_grad_()
    out = moe(x)
    (out * _probe(rank)).sum().backward()
    return {"out": out.detach(), "dropped": moe.stats.dropped[0], "x_grad": x.grad, "first": moe.experts.first,
            "gate_up_grad": moe.experts.gate_up_proj.grad, "down_grad": moe.experts.down_proj.grad}


def _probe(rank: int) -> torch.Tensor:
    return torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(20 + rank))


def _engine(hf_dir: str, ep: int, stage: int):
    from deepshard.core import (
        EngineConfig,
        OptimConfig,
        ParallelDims,
        PrecisionConfig,
        ZeroConfig,
        build_mesh,
        initialize,
    )
    from deepshard.finetune.models import registry

    spec = registry.for_hf(hf_dir)
    model = spec.build(spec.hf.config_from_hf(hf_dir))
    model.init_weights(0)
    spec.hf.load_weights(model, hf_dir)
    config = EngineConfig(zero=ZeroConfig(stage=stage, reduce_bucket_size=3000, allgather_bucket_size=3000),
                          precision=PrecisionConfig(dtype="fp32"), grad_accum=ACCUM,
                          optim=OptimConfig(lr=2e-3, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1, grad_clip=0.0))
    mesh = build_mesh(ParallelDims(dp=WORLD, ep=ep))
    return initialize(model, config, mesh=mesh, parallelize_fn=partial(
        spec.parallelize, mesh=mesh, zero=config.zero, dtype="fp32", ac="none")), mesh["dp"]


def _step(engine, dp, step: int) -> float:
    import torch.distributed as dist

    ids, labels = rows()
    rank = dp.get_local_rank()
    count = engine.global_num_items(sum((labels[step, micro(rank, m)] != -100).sum() for m in range(ACCUM)))
    total = torch.zeros(())
    for m in range(ACCUM):
        loss = engine(ids[step, micro(rank, m)], labels[step, micro(rank, m)], reduction="sum")
        engine.backward(loss, num_items=count)
        total += loss.detach()
    engine.step()
    dist.all_reduce(total)
    return total.item() / count.item()


def _params(engine) -> dict:
    """Every parameter this rank holds, in full over its shard group, with where its experts start."""
    firsts = {n: m.first for n, m in engine.model.named_modules() if hasattr(m, "first")}
    out = {}
    for n, p in engine.model.named_parameters():
        module = n.rsplit(".", 1)[0]
        out[n] = ((p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone(), firsts.get(module))
    return out


def _resume_case(hf_dir: str, root: str) -> dict:
    import dataclasses

    from deepshard.core.checkpoint.state import load_checkpoint, save_checkpoint

    engine, dp = _engine(hf_dir, EP, 1)
    losses = [_step(engine, dp, s) for s in range(2)]
    meta = {"family": "qwen3_moe", "model": dataclasses.asdict(engine.model.cfg)}
    path = save_checkpoint(root, 2, engine.optimizer, dp, model=engine.model, meta=meta)
    saved = _params(engine)
    losses.append(_step(engine, dp, 2))
    out = {"uninterrupted": (losses, _params(engine)), "saved": saved, "path": str(path)}
    for ep, stage in ((4, 3), (1, 2)):
        engine, dp = _engine(hf_dir, ep, stage)
        load_checkpoint(path, engine.optimizer, dp, model=engine.model)
        out[f"ep{ep}"] = ([_step(engine, dp, 2)], _params(engine))
    return out


def ds_moe(ep_size: int, ep_rank: int = 0):
    """DeepSpeed's MoE layer (compat), top-2 with capacity, each expert's weights seeded by its global index."""
    import deepshard.compat.deepspeed as deepspeed
    from tests.compat.test_ds_moe import EXPERTS as DS_EXPERTS
    from tests.compat.test_ds_moe import HIDDEN as DS_HIDDEN
    from tests.compat.test_ds_moe import expert

    layer = deepspeed.moe.layer.MoE(DS_HIDDEN, expert(), num_experts=DS_EXPERTS, ep_size=ep_size, k=2,
                                    capacity_factor=0.75, min_capacity=2, top2_2nd_expert_sampling=False)
    local = DS_EXPERTS // ep_size
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(8 * torch.randn(DS_EXPERTS, DS_HIDDEN,
                                                                 generator=torch.Generator().manual_seed(7)))
        for i, e in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            g = torch.Generator().manual_seed(100 + ep_rank * local + i)
            for p in e.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return layer


def ds_tokens(rank: int) -> torch.Tensor:
    from tests.compat.test_ds_moe import HIDDEN as DS_HIDDEN

    return torch.randn(12, DS_HIDDEN, generator=torch.Generator().manual_seed(30 + rank)).requires_grad_()


def _ds_moe_case() -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    layer = ds_moe(EP, rank % EP)
    x = ds_tokens(rank)
    out, l_aux, counts = layer(x)
    out.square().sum().backward()
    return {"out": out.detach(), "l_aux": l_aux.item(), "counts": counts.tolist(), "x_grad": x.grad}


def _worker(hf_dir: str, root: str) -> dict:
    from deepshard.core import init_distributed

    init_distributed()
    return {"capacity": _capacity_case(), "ds_moe": _ds_moe_case(), "resume": _resume_case(hf_dir, root)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, gloo_pool):
    from tests.models.test_moe_ep import hf_moe

    path = tmp_path_factory.mktemp("moe_resume")
    hf_moe().save_pretrained(str(path / "hf"))
    return gloo_pool(WORLD).run(_worker, str(path / "hf"), str(path / "ckpt"))


@pytest.mark.slow  # a multi-rank launch: the full suite (the inner loop keeps tests/models/test_moe_capacity.py)
def test_capacity_under_expert_parallelism_drops_what_the_reference_drops(ranks):
    refs = []
    for rank in range(WORLD):
        x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(10 + rank)).requires_grad_()
        w = {n: t.clone().requires_grad_() for n, t in block_weights().items()}
        want, dropped = reference_block(x, w, k=K, factor=FACTOR, min_capacity=MIN_CAP, drop=True)
        (want * _probe(rank)).sum().backward()
        refs.append((want, dropped, x.grad, w))
    for rank, r in enumerate(ranks):
        got, (want, dropped, x_grad, _) = r["capacity"], refs[rank]
        assert got["dropped"] == dropped > 0, (rank, got["dropped"], dropped)
        assert (got["out"] - want).abs().max().item() < 1e-5
        assert (got["x_grad"] - x_grad).abs().max().item() < 1e-5
        group = range(rank - rank % EP, rank - rank % EP + EP)  # the ep group: EP neighbouring ranks
        first, local = got["first"], EXPERTS // EP
        for name, key in (("gate_up", "gate_up_grad"), ("down", "down_grad")):
            summed = sum(refs[g][3][name].grad for g in group)[first:first + local] / EP
            assert (got[key] - summed).abs().max().item() < 1e-5, (rank, name)


def _canonical(rank_params: list[dict]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for params in rank_params:
        for n, (p, first) in params.items():
            if first is None:
                out[n] = p
            else:
                whole = out.setdefault(n, torch.full((NUM_EXPERTS, *p.shape[1:]), float("nan")))
                whole[first:first + p.shape[0]] = p
    return out


@pytest.mark.slow  # a multi-rank launch: the full suite
@pytest.mark.parametrize("resumed", ["ep4", "ep1"])
def test_a_checkpoint_saved_at_ep2_resumes_at_ep4_and_ep1(ranks, resumed):
    base_losses, _ = ranks[0]["resume"]["uninterrupted"]
    losses, _ = ranks[0]["resume"][resumed]
    assert abs(losses[0] - base_losses[2]) < 1e-5, (losses, base_losses)
    want = _canonical([r["resume"]["uninterrupted"][1] for r in ranks])
    got = _canonical([r["resume"][resumed][1] for r in ranks])
    assert set(got) == set(want)
    worst = max(((got[n] - want[n]).abs().max().item(), n) for n in want)
    assert worst[0] < 1e-5, worst


@pytest.mark.slow  # a multi-rank launch: the full suite
def test_the_hf_export_of_an_ep2_checkpoint_loads_in_transformers(ranks, tmp_path):
    from transformers import AutoModelForCausalLM

    from deepshard.finetune.models import registry
    from deepshard.finetune.tools.hf_export import export_checkpoint

    export_checkpoint(ranks[0]["resume"]["path"], tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    theirs = dict(hf.named_parameters())
    to_hf = registry.get("qwen3_moe").hf.to_hf_name
    saved = _canonical([r["resume"]["saved"] for r in ranks])
    assert {to_hf(n) for n in saved} == set(theirs)
    assert max((saved[n] - theirs[to_hf(n)]).abs().max().item() for n in saved) < 1e-6


@pytest.mark.slow  # a multi-rank launch: the full suite (the inner loop keeps tests/compat/test_ds_moe.py)
def test_deepspeeds_moe_layer_with_ep_size_2_equals_all_experts_local(ranks):
    for rank, r in enumerate(ranks):
        full = ds_moe(1)  # every expert seeded by its global index, as each ep rank seeds its own
        x = ds_tokens(rank)
        out, l_aux, counts = full(x)
        out.square().sum().backward()
        got = r["ds_moe"]
        assert got["counts"] == counts.tolist() and abs(got["l_aux"] - l_aux.item()) < 1e-6
        assert (got["out"] - out.detach()).abs().max().item() < 1e-5
        assert (got["x_grad"] - x.grad).abs().max().item() < 1e-5
