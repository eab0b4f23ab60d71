"""The MoE families against transformers' own models, and the MoE block against references written here.

- Tiny random Qwen3-MoE (a dense ``mlp_only_layers`` layer, ``norm_topk_prob``), Mixtral and Qwen2-MoE
  (shared expert, ``decoder_sparse_step``, ``mlp_only_layers``) checkpoints
  written by transformers' ``save_pretrained`` (its per-expert layout) and as its in-memory fused layout
  import through the registry: logits, loss and the aux loss (with and without an attention mask) equal
  within 1e-5; our parameters written under ``to_hf_name`` load in transformers with equal logits.
- The grouped GEMM equals the per-expert loop (forward and every gradient) at odd sizes with an expert
  that gets no token, and it is the path that ran (the profiler sees ``aten::_grouped_mm``).
- A router written here (a sort per token) picks the same experts with the same weights.
- What the MoE families cannot run is refused by key.
"""

from __future__ import annotations

import json

import pytest
import torch

from deepshard.finetune.models import registry
from deepshard.finetune.models.hf import write_safetensors
from deepshard.finetune.models.moe import Experts, SparseMoe
from tests.models.hf_refs import VOCAB, chat_rows, reference_loss
from tests.models.moe_refs import COEF, FAMILIES, PARITY_FAMILIES, moe_hf_model


def _ours(path):
    spec = registry.for_hf(path)
    model = spec.build(spec.hf.config_from_hf(path))
    model.init_weights(0)
    spec.hf.load_weights(model, path)
    return spec, model.eval()


@pytest.fixture(scope="module", params=PARITY_FAMILIES)
def saved(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = moe_hf_model(request.param)
    hf.save_pretrained(str(path))
    return request.param, path, hf


def test_save_pretrained_imports_with_equal_logits_loss_and_aux(saved):
    family, path, hf = saved
    names = json.dumps(sorted(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])) \
        if (path / "model.safetensors.index.json").exists() else ""
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as st:
        names += " ".join(st.keys())
    assert ".experts.0." in names  # save_pretrained wrote the per-expert layout
    spec, ours = _ours(path)
    assert spec.name == family
    ids, labels = chat_rows()
    ids, labels = ids[0], labels[0]
    mask = (ids != 0).long()  # chat_rows pads with 0 after each row
    assert (mask == 0).any()
    with torch.no_grad():
        theirs = hf(ids, labels=labels, output_router_logits=True)
        logits = ours(ids)
        aux_all = ours.router_stats.aux
        loss = ours(ids, labels)
        ours(ids, attention_mask=mask)
        aux_masked = ours.router_stats.aux
        theirs_masked = hf(ids, attention_mask=mask, output_router_logits=True).aux_loss
    assert (logits - theirs.logits).abs().max().item() < 1e-5
    assert abs(aux_all.item() - theirs.aux_loss.item()) < 1e-5
    assert abs(aux_masked.item() - theirs_masked.item()) < 1e-5 and abs(aux_masked - aux_all) > 1e-4
    # transformers' loss: its shifted mean cross-entropy + coef * aux; ours takes aligned labels
    assert abs(loss.item() + COEF * aux_all.item() - (reference_loss(theirs.logits, labels).item()
                                                     + COEF * theirs.aux_loss.item())) < 1e-5


def test_fused_layout_imports_and_our_names_load_in_transformers(saved, tmp_path):
    """transformers 5's in-memory (fused) names read as they are; our parameters written under
    ``to_hf_name`` with the family's config.json load in transformers with equal logits."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    family, path, hf = saved
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((path / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(fused / "model.safetensors"))
    spec, ours = _ours(fused)
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = hf(ids).logits
        assert (ours(ids) - want).abs().max().item() < 1e-5
    out = tmp_path / "export"
    out.mkdir()
    params = [(spec.hf.to_hf_name(n), p.detach()) for n, p in ours.named_parameters()]
    write_safetensors(out / "model.safetensors", [(n, p.dtype, tuple(p.shape)) for n, p in params],
                      (p for _, p in params))
    (out / "config.json").write_text(json.dumps(spec.hf.config_dict(ours.cfg, bos_token_id=1, eos_token_id=2)))
    back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(back).__name__ == type(hf).__name__
    with torch.no_grad():
        assert (back(ids).logits - want).abs().max().item() < 1e-5
    (path / "tokenizer.json").write_text("{}")
    spec.hf.check_dir(path, registry.build_meta(ours.cfg))  # the per-expert headers pass the pre-start check


def _loop_vs_grouped(dim: int, hidden: int, counts: list[int]) -> None:
    g = torch.Generator().manual_seed(sum(counts) + dim)
    ex = {impl: Experts(len(counts), dim, hidden, impl) for impl in ("grouped", "loop")}
    w = [torch.randn(p.shape, generator=g) * 0.3 for p in ex["loop"].parameters()]
    for m in ex.values():
        with torch.no_grad():
            for p, v in zip(m.parameters(), w, strict=True):
                p.copy_(v)
    x0 = torch.randn(sum(counts), dim, generator=g)
    grad_out = torch.randn(sum(counts), dim, generator=g)
    res = {}
    for impl, m in ex.items():
        x = x0.clone().requires_grad_()
        y = m(x, torch.tensor(counts))
        y.backward(grad_out)
        res[impl] = [y.detach(), x.grad, *(p.grad for p in m.parameters())]
    for a, b in zip(res["grouped"], res["loop"], strict=True):
        assert (a - b).abs().max().item() < 1e-5
    assert res["grouped"][2][counts.index(0)].abs().max() == 0  # the idle expert gets no gradient


@pytest.mark.parametrize(("dim", "hidden", "counts"), [(13, 7, [3, 0, 5, 1, 4]), (32, 20, [0, 9, 2]),
                                                       (12, 16, [6, 0])])
def test_grouped_gemm_equals_the_per_expert_loop(dim, hidden, counts):
    _loop_vs_grouped(dim, hidden, counts)


def test_the_grouped_path_is_the_one_that_ran_and_takes_a_sum_gradient():
    moe = SparseMoe(13, 7, 5, 2, routing="topk_softmax")
    torch.nn.init.normal_(moe.gate.weight)
    for p in moe.experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 9, 13, requires_grad=True)
    with torch.profiler.profile() as prof:
        moe(x).sum().backward()  # a stride-0 output gradient reaches the grouped GEMM's backward
    ops = [e.key for e in prof.key_averages()]
    assert "aten::_grouped_mm" in ops
    assert moe.experts.gate_up_proj.grad is not None


def reference_route(logits: torch.Tensor, k: int, routing: str, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, the k highest (a descending stable sort), weights by each family's rule."""
    ids, weights = [], []
    for row in logits.float():
        order = sorted(range(row.numel()), key=lambda e: -row[e].item())[:k]
        ids.append(order)
        if routing == "topk_softmax":
            top = row[order]
            weights.append((top - top.max()).exp() / (top - top.max()).exp().sum())
        else:
            probs = (row - row.max()).exp() / (row - row.max()).exp().sum()
            top = probs[order]
            weights.append(top / top.sum() if norm else top)
    return torch.tensor(ids), torch.stack(weights)


@pytest.mark.parametrize(("routing", "norm"), [("softmax_topk", True), ("softmax_topk", False),
                                               ("topk_softmax", True)])
def test_a_router_written_here_picks_the_same_experts(routing, norm):
    moe = SparseMoe(16, 8, 6, 2, routing=routing, norm_topk_prob=norm)
    logits = torch.randn(40, 6, generator=torch.Generator().manual_seed(7)) * 3
    weights, idx = moe.route(logits)
    want_idx, want_w = reference_route(logits, 2, routing, norm)
    assert torch.equal(idx, want_idx)
    assert (weights - want_w).abs().max().item() < 1e-6


@pytest.mark.parametrize(("key", "kw"), [("parallel.tp", {"tp": 2}), ("parallel.pp", {"pp": 2}),
                                         ("parallel.sp", {"sp": 2})])
def test_layouts_not_built_for_moe_are_refused_by_key(key, kw):
    for family in FAMILIES:
        spec = registry.get(family)
        cfg = spec.config(dim=32, n_heads=4, n_kv_heads=2, num_experts=4, moe_hidden=16)
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            spec.check_parallel(cfg, **kw)
        spec.check_parallel(cfg)


def test_lora_on_experts_is_refused_and_on_attention_passes():
    from deepshard.finetune.models.lora import LoraConfig

    spec = registry.get("qwen3_moe")
    cfg = spec.config(dim=32, n_heads=4, n_kv_heads=2, num_experts=4, moe_hidden=16)
    with pytest.raises(ValueError, match="peft.target_modules.*LoRA on MoE experts"):
        spec.check_parallel(cfg, lora=LoraConfig())
    spec.check_parallel(cfg, lora=LoraConfig(target_modules=("q_proj", "v_proj")))


def test_activation_checkpointing_keeps_every_gradient_aux_loss_included():
    """Blocks recomputed in backward (non-reentrant, as the recipe's ac) rewrite the router statistics
    with the same values: every gradient equals the plain run's, the aux loss's included."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    spec = registry.get("qwen3_moe")
    cfg = spec.config(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=40, num_experts=5,
                      moe_hidden=12, mlp_only_layers=(1,), router_aux_loss_coef=0.5)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))

    def grads(ac: bool) -> dict[str, torch.Tensor]:
        model = spec.build(cfg)
        model.init_weights(0)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for i in (0, 2):
                model.layers[i].mlp.gate.weight.copy_(torch.randn(5, 32, generator=g))
        if ac:
            for layer in model.layers:
                layer.forward = partial(checkpoint, layer.forward, use_reentrant=False)
        model(ids, ids, reduction="sum").backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, recomputed = grads(False), grads(True)
    assert plain["layers.0.mlp.gate.weight"].abs().max() > 0
    assert max((plain[n] - recomputed[n]).abs().max().item() for n in plain) == 0.0


@pytest.mark.parametrize(("override", "key"), [("parallel.tp=2", "parallel.tp"), ("parallel.pp=2", "parallel.pp"),
                                               ("+peft=lora", "peft.target_modules"), ("parallel.dp=2", None),
                                               ("parallel.ep=2", r"parallel.ep=2 does not divide model.num_experts=5")])
def test_the_app_refuses_them_before_start(saved, override, key):
    """Through the app's own settings (what runs before any worker starts), for a saved MoE folder."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from deepshard.finetune.config import register, validate

    _, path, _ = saved
    (path / "tokenizer.json").write_text("{}")
    register()
    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose(config_name="config", overrides=["model=hf", f"model.path={path}", "data.seq_len=32", override])
    if key is None:
        assert registry.spec_of(validate(OmegaConf.to_container(cfg, resolve=True), world_size=2).model).name
        return
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        validate(OmegaConf.to_container(cfg, resolve=True), world_size=2)
