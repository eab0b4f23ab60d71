"""Expert parallelism (``parallel.ep``) trains as one process holding every expert does.

One world-4 launch (the session's gloo pool) trains a tiny Qwen3-MoE (8 experts, top-2, both layers
sparse) through the family's registry recipe in several layouts: ep=2 (2 expert groups x 2 ranks
each, experts ZeRO-sharded over the 2) and ep=4 (each rank 2 experts), ZeRO 1 and 3 (and 2, 0), 2 micro-batches
per step, on masked variable-length rows (one row empty).  The oracle is transformers' own model
trained by torch.optim.AdamW in this process with every expert local: the summed token loss over
the global count plus ``coef x`` the mean over (rank, micro-batch) of each one's aux loss (the
statistics are per rank and micro-batch).  Losses and every parameter after 3 steps within 1e-5, and
the experts chosen for every token equal those of a router written here, on transformers' logits;
the gradient norm the step clips by equals the reference's (Adam would hide a mis-scaled gradient).
"""

from __future__ import annotations

import contextlib
import dataclasses
from functools import partial

import pytest
import torch

from tests.models.hf_refs import COMMON, VOCAB
from tests.models.moe_census import saved_census

STEPS, WORLD, ACCUM, ROWS, SEQ = 3, 4, 2, 16, 20
NUM_EXPERTS, TOP_K, COEF = 8, 2, 0.02
LR, BETAS, EPS, WD = 2e-3, (0.9, 0.95), 1e-5, 0.1
# name -> (ep, zero stage)
CENSUS = ("ep2_zero1", "ep4_zero1")  # cases whose sparse layers' saved tensors are counted (plain params)
CASES = {"ep2_zero1": (2, 1), "ep4_zero1": (4, 1), "ep2_zero3": (2, 3), "ep4_zero3": (4, 3), "ep2_zero2": (2, 2),
         "ep4_zero0": (4, 0)}


def hf_moe(seed: int = 0) -> torch.nn.Module:
    """transformers' Qwen3-MoE: 2 sparse layers, 8 experts, top-2, router weights large (varied routing)."""
    import transformers as tf
    from transformers import AutoModelForCausalLM

    cfg = tf.Qwen3MoeConfig(**{**COMMON, "pad_token_id": None}, head_dim=16, num_experts=NUM_EXPERTS,
                            num_experts_per_tok=TOP_K, moe_intermediate_size=20, norm_topk_prob=True,
                            router_aux_loss_coef=COEF)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def rows() -> tuple[torch.Tensor, torch.Tensor]:
    """[steps, ROWS, SEQ] ids and labels like chat data: masked prompt, answer, padding; one empty row."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (STEPS, ROWS, SEQ + 1), generator=g)
    labels = ids[..., 1:].clone()
    for s in range(STEPS):
        for r in range(ROWS):
            prompt = int(torch.randint(2, 7, (), generator=g))
            length = int(torch.randint(prompt + 3, SEQ + 1, (), generator=g))
            ids[s, r, length:] = 0
            labels[s, r, :prompt] = -100
            labels[s, r, length - 1:] = -100
    labels[1, 5] = -100
    return ids[..., :-1].contiguous(), labels


def micro(rank: int, m: int) -> slice:
    """Rank ``rank``'s micro-batch ``m`` of a step's rows."""
    per = ROWS // (WORLD * ACCUM)
    start = (rank * ACCUM + m) * per
    return slice(start, start + per)


def _case(name: str, hf_dir: str) -> dict:
    import torch.distributed as dist

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

    ep, stage = CASES[name]
    spec = registry.for_hf(hf_dir)
    model = spec.build(spec.hf.config_from_hf(hf_dir))
    model.init_weights(0)
    spec.hf.load_weights(model, hf_dir)
    model.router_stats.routes = {}
    config = EngineConfig(zero=ZeroConfig(stage=stage, reduce_bucket_size=3000, allgather_bucket_size=3000),
                          precision=PrecisionConfig(dtype="fp32"), grad_accum=ACCUM,
                          optim=OptimConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, grad_clip=0.0))
    mesh = build_mesh(ParallelDims(dp=WORLD, ep=ep))
    engine = initialize(model, config, mesh=mesh,
                        parallelize_fn=partial(spec.parallelize, mesh=mesh, zero=config.zero, dtype="fp32", ac="none"))
    rank = mesh["dp"].get_local_rank()
    ids, labels = rows()
    out: list[torch.Tensor] = []
    losses, norms, routes, ops, census, states = [], [], [], set(), [], {}
    for step in range(STEPS):
        count = engine.global_num_items(sum((labels[step, micro(rank, m)] != -100).sum() for m in range(ACCUM)))
        total = torch.zeros(())
        for m in range(ACCUM):
            with torch.profiler.profile() if step == 0 and m == 0 else contextlib.nullcontext() as prof:
                if step == 0 and m == 0 and name in CENSUS:  # what the estimator's sparse_layer_bytes states
                    x, y = ids[step, micro(rank, m)], labels[step, micro(rank, m)]
                    census = saved_census(model, partial(lambda x, y: out.append(engine(x, y, reduction="sum")), x, y))
                    loss = out.pop()
                else:
                    loss = engine(ids[step, micro(rank, m)], labels[step, micro(rank, m)], reduction="sum")
                engine.backward(loss, num_items=count)
            if prof is not None:
                ops = {e.key for e in prof.key_averages()}
            routes.append({k: v.clone() for k, v in model.router_stats.routes.items()})
            total += loss.detach()
        if step == STEPS - 1:  # the model states the estimator counts (grads live: before the step)
            states = {k: v for k, v in engine.memory()["measured"].as_dict().items() if k in ("params", "grads", "optimizer")}
        norms.append(engine.step().grad_norm)
        dist.all_reduce(total)
        losses.append(total.item() / count.item())
    params = {}
    for n, p in engine.model.named_parameters():
        full = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        params[n] = full
    firsts = {n: m.first for n, m in engine.model.named_modules() if hasattr(m, "first")}
    return {"losses": losses, "norms": norms, "routes": routes, "params": params, "firsts": firsts,
            "census": census, "states": states, "grouped": "aten::_grouped_mm" in ops, "all_to_all": any("all_to_all" in k or "alltoall" in k for k in ops)}


def _worker(hf_dir: str) -> dict:
    from deepshard.core import init_distributed

    init_distributed()
    return {name: _case(name, hf_dir) for name in CASES}


def reference() -> tuple[list[float], list[float], list[dict[int, torch.Tensor]], dict[str, torch.Tensor]]:
    """transformers' model, every expert local, 3 AdamW steps on the whole batch: the summed token loss
    over the global count + coef x the mean of the (rank, micro-batch) aux losses; the experts a router
    written here picks from its logits, per (rank, micro-batch) in rank order."""
    model = hf_moe().train()
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS)
    ids, labels = rows()
    losses, norms, routes = [], [], []
    for step in range(STEPS):
        count = (labels[step] != -100).sum()
        ce, aux = 0.0, 0.0
        for rank in range(WORLD):
            for m in range(ACCUM):
                out = model(ids[step, micro(rank, m)], output_router_logits=True)
                ce = ce + torch.nn.functional.cross_entropy(out.logits.flatten(0, 1),
                                                            labels[step, micro(rank, m)].flatten(), reduction="sum")
                aux = aux + out.aux_loss / (WORLD * ACCUM)
                routes.append({i: _route(lg) for i, lg in enumerate(out.router_logits)})
        (ce / count + COEF * aux).backward()
        norms.append(torch.sqrt(sum(p.grad.square().sum() for p in params)).item())
        opt.step()
        opt.zero_grad()
        losses.append((ce / count).item())
    return losses, norms, routes, {n: p.detach().clone() for n, p in model.named_parameters()}


def _route(logits: torch.Tensor) -> torch.Tensor:
    """Per token the TOP_K experts of highest router logit, best first (a stable descending sort)."""
    return torch.tensor([sorted(range(row.numel()), key=lambda e: -row[e].item())[:TOP_K]
                         for row in logits.detach().float()])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, gloo_pool):
    path = tmp_path_factory.mktemp("moe_ep") / "hf"
    hf_moe().save_pretrained(str(path))
    return gloo_pool(WORLD).run(_worker, str(path)), reference()


def _merged(ranks: list[dict], name: str) -> dict[str, torch.Tensor]:
    """Every rank's parameters by our names, each rank's experts put at their place in [E, ...]."""
    out: dict[str, torch.Tensor] = {}
    for rank in ranks:
        case = rank[name]
        for n, p in case["params"].items():
            module = n.rsplit(".", 1)[0]
            if module in case["firsts"]:
                whole = out.setdefault(n, torch.full((NUM_EXPERTS, *p.shape[1:]), float("nan")))
                whole[case["firsts"][module]:case["firsts"][module] + p.shape[0]] = p
            else:
                out[n] = p
    return out


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow  # a multi-rank launch: the full suite (the inner loop keeps the in-process checks)
def test_expert_parallel_trains_as_one_process_with_every_expert(runs, name):
    from deepshard.finetune.models import registry

    ranks, (ref_losses, ref_norms, ref_routes, ref_params) = runs
    losses = ranks[0][name]["losses"]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < 1e-5, (losses, ref_losses)
    # Adam hides a gradient's scale from the parameters: the clipping norm shows it (experts counted once)
    norms = ranks[0][name]["norms"]
    assert max(abs(a / b - 1) for a, b in zip(norms, ref_norms, strict=True)) < 1e-5, (norms, ref_norms)
    for step in range(STEPS):  # each rank's micro-batches routed as the reference router routes them
        for rank in range(WORLD):
            for m in range(ACCUM):
                ours = ranks[rank][name]["routes"][step * ACCUM + m]
                want = ref_routes[(step * WORLD + rank) * ACCUM + m]
                assert {i: torch.equal(v, want[i]) for i, v in ours.items()} == dict.fromkeys(want, True)
    params = _merged(ranks, name)
    to_hf = registry.get("qwen3_moe").hf.to_hf_name
    assert {to_hf(n) for n in params} == set(ref_params)
    worst = max(((params[n] - ref_params[to_hf(n)]).abs().max().item(), n) for n in params)
    assert worst[0] < 1e-5, worst


@pytest.mark.slow  # a multi-rank launch: the full suite (the inner loop keeps the in-process checks)
def test_the_tokens_went_by_all_to_all_to_one_grouped_gemm(runs):
    ranks, _ = runs
    assert all(rank[name]["grouped"] and rank[name]["all_to_all"] for rank in ranks for name in CASES)


@pytest.mark.slow  # a multi-rank launch: the full suite (tests/models/test_moe_estimate.py keeps world 1)
def test_the_estimator_counts_expert_states_and_what_dispatch_keeps(runs, tmp_path):
    """core's ``residence`` with the experts 1/ep per rank over dp/ep against the live model states each case
    measured (before a step, grads live), and ``sparse_layer_bytes`` against the census of the tensors each
    sparse layer saved for backward, summed over the ranks (a rank keeps the rows it received); both against
    plain formulas written here."""
    from deepshard.core.memory import residence
    from deepshard.finetune.models import registry
    from deepshard.finetune.models.memory_plan import model_counts
    from deepshard.finetune.models.moe_memory import sparse_layer_bytes

    ranks, _ = runs
    hf = hf_moe()
    hf.config.save_pretrained(tmp_path)
    cfg = registry.for_hf(str(tmp_path)).hf.config_from_hf(str(tmp_path))
    h, i, e, k = cfg.dim, cfg.moe_hidden, NUM_EXPERTS, TOP_K
    experts = 2 * e * 3 * h * i  # both layers' gate_up [E, 2I, H] and down [E, H, I]
    dense = sum(p.numel() for p in hf.parameters()) - experts
    for name, (ep, stage) in CASES.items():
        counts = model_counts(cfg, world=WORLD, ep=ep)
        assert (counts.num_params, counts.experts) == (dense + experts // ep, experts // ep)
        est = residence(counts.num_params, stage=stage, dp=WORLD, dtype="fp32", experts=counts.experts, ep=ep).device
        x, edp = experts // ep, WORLD // ep  # fp32 Adam: params 4, grads 4, moments 8 bytes, sharded by stage
        plain = {0: 16 * (dense + x), 1: 8 * (dense + x) + 8 * dense // WORLD + 8 * x // edp,
                 2: 4 * (dense + x) + 12 * dense // WORLD + 12 * x // edp, 3: 16 * dense // WORLD + 16 * x // edp}[stage]
        assert est == plain, (name, est, plain)
        for r, rank in enumerate(ranks):
            measured = sum(rank[name]["states"].values())
            assert abs(measured / est - 1) < 0.02, (name, r, rank[name]["states"], est)
    for name in CENSUS:
        ep = CASES[name][0]
        for layer in range(2):
            tokens = [rank[name]["census"][layer]["tokens"] for rank in ranks]
            got = sum(rank[name]["census"][layer]["saved"] for rank in ranks)
            est = sum(sparse_layer_bytes(tokens=t, top_k=k, num_experts=e, dim=h, hidden=i, dtype="fp32", ep=ep,
                                         norm_topk_prob=True).saved for t in tokens)
            # per token: two [E] fp32 softmaxes, k int64 ids, its mask, k renormalized weights and their sum;
            # per row: three [H] and four [I] fp32 rows, four int64 indices (two under ep alone), a weight
            plain = sum(t * (8 * e + 8 * k + 4 + 4 * (k + 1)) + t * k * (4 * (3 * h + 4 * i) + 8 * 4 + 4) + e // ep * 4
                        for t in tokens)
            assert est == plain, (name, layer, est, plain)
            aux = 0 if layer == 0 else 64 * WORLD  # the last layer also keeps the aux loss's few scalars
            assert 0 <= got - est <= aux, (name, layer, got, est)


@pytest.mark.parametrize(("dims", "key"), [(dict(dp=4, ep=3), "parallel.ep=3 does not divide"),
                                           (dict(dp=2, tp=2, ep=2), "parallel.tp=2 with parallel.ep=2"),
                                           (dict(dp=4, ep=0), "parallel.ep=0: must be a positive integer")])
def test_mesh_layouts_expert_parallelism_is_not_built_with_are_refused(dims, key):
    from deepshard.core import ParallelDims

    with pytest.raises(ValueError, match=key.replace("=", "=").replace(".", r"\.")):
        ParallelDims(**dims).resolve(4)


def test_expert_parallel_refusals_name_the_key():
    from deepshard.core import ZeroConfig
    from deepshard.core.zero.split import check_experts
    from deepshard.finetune.models.lora import LoraConfig
    from deepshard.finetune.models.moe_decoder import MoeConfig, check_parallel

    cfg = dataclasses.replace(MoeConfig(), num_experts=6)
    with pytest.raises(ValueError, match=r"parallel\.ep=4 does not divide model\.num_experts=6"):
        check_parallel(cfg, ep=4)
    with pytest.raises(ValueError, match=r"precision\.dtype=bf16 with parallel\.ep > 1 needs zero\.stage=3"):
        check_experts(ZeroConfig(stage=1), dtype="bf16")
    with pytest.raises(ValueError, match=r"zero\.quantized_weights with parallel\.ep > 1"):
        check_experts(ZeroConfig(stage=3, quantized_weights=True))
    with pytest.raises(ValueError, match=r"offload\.params with parallel\.ep > 1"):
        check_experts(ZeroConfig(stage=3), offload_params=True)
    with pytest.raises(ValueError, match=r"LoRA on MoE experts is not built"):
        check_parallel(cfg, ep=2, lora=LoraConfig(target_modules=("q_proj", "gate_proj")))
