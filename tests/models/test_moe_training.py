"""The MoE families trained by their registry recipe at world 2 (ZeRO-3 over dp=2, every expert on
every rank, the stacked expert weights sharded like any parameter) equal transformers' own model
trained by plain torch in one process: 3 steps of AdamW on masked variable-length chat rows (one
row empty), losses and every parameter within 1e-5; the checkpoints export to folders transformers
loads with our trained logits.  Qwen3-MoE once more with its parameters and optimizer state in host
memory (``offload.params=cpu offload.device=cpu``), the same check, and the estimator's offloaded
model-state figure held against the bytes its ranks held; Mixtral with LoRA on the attention
projections against PEFT's (the base, router and experts frozen), its ``export --adapter`` loaded by
PEFT with our logits.  One launch serves every case.

The load-balancing loss is not linear in tokens: its statistics are per rank and per micro-batch (as
DeepSpeed's and Megatron's), so the reference computes it the same way, on each rank's rows apart,
over every position (our app passes no attention mask: transformers' rule without one), and adds
``coef * mean of the ranks' aux`` to the token-weighted cross-entropy.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

import pytest
import torch

from deepshard.finetune.models import registry
from deepshard.launch.local import launch_local
from tests.models.hf_refs import ROWS, SEQ, VOCAB, chat_rows
from tests.models.moe_refs import COEF, FAMILIES, moe_hf_model
from tests.models.train_harness import (
    ALPHA,
    RANK,
    adapter_value,
    check_offloaded_figure,
    hf_name,
    measure_after_backward,
    train_steps,
)

pytestmark = pytest.mark.slow

STEPS, DP = 3, 2
# eps 1e-5: Adam's first step is lr * g / (|g| + eps); some attention gradients here are ~1e-6, where a
# 3e-8 rounding difference (grads agree to that) moved a parameter 1.05e-5 with eps 1e-6.
LR, BETAS, EPS, WD = 2e-3, (0.9, 0.95), 1e-5, 0.1
# ZeRO-3 with the params (FSDP2's CPU offload) and the optimizer state in host memory, once for the MoE families
OFFLOADED_FAMILY = "qwen3_moe"
OFFLOADED = f"offload_{OFFLOADED_FAMILY}"
# LoRA on the attention projections (on the experts it is refused), once: against PEFT's, and its --adapter export
LORA_FAMILY, ATTENTION = "mixtral", ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_CASE = f"lora_{LORA_FAMILY}"


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu().clone()


def _run(family: str, hf_dir: str, ckpt_root: str, offload: bool = False, lora: bool = False) -> dict:

    from deepshard.core import (
        DeviceStateStore,
        EngineConfig,
        OptimConfig,
        ParallelDims,
        PrecisionConfig,
        ZeroConfig,
        build_mesh,
        initialize,
    )
    from deepshard.core.checkpoint.state import save_checkpoint
    from deepshard.core.zero import CpuParamOffload
    from deepshard.offload import CpuStateStore

    spec = registry.for_hf(hf_dir)
    cfg = spec.hf.config_from_hf(hf_dir)
    model = spec.build(cfg)
    model.init_weights(0)
    spec.hf.load_weights(model, hf_dir)
    if lora:
        from deepshard.finetune.models.lora import apply_lora

        apply_lora(model, r=RANK, alpha=ALPHA, target_modules=ATTENTION, seed=None)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if ".lora_" in n:
                    p.copy_(adapter_value(n.replace(".weight", ""), tuple(p.shape)))
    config = EngineConfig(zero=ZeroConfig(stage=3, reduce_bucket_size=3000, allgather_bucket_size=3000),
                          precision=PrecisionConfig(dtype="fp32"),
                          optim=OptimConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, grad_clip=0.0))
    mesh = build_mesh(ParallelDims(dp=DP))
    params = CpuParamOffload() if offload else None
    recipe = partial(spec.parallelize, mesh=mesh, zero=config.zero, dtype="fp32", ac="none", offload_params=params)
    engine = initialize(model, config, mesh=mesh, parallelize_fn=recipe, offload_params=params,
                        store_factory=CpuStateStore if offload else DeviceStateStore)
    ids, labels = chat_rows(STEPS)
    rank = mesh["dp"].get_local_rank()
    rows = slice(rank * ROWS // DP, (rank + 1) * ROWS // DP)
    losses = train_steps(engine, ids, labels, rows, mesh["dp"].get_group())
    if offload:  # no checkpoint: what the estimator's figure is held against instead
        return {"losses": losses, "params": {n: _full(p) for n, p in engine.model.named_parameters()},
                "memory": measure_after_backward(engine, ids[0, rows], labels[0, rows])}
    meta = {"family": spec.name, "model": dataclasses.asdict(cfg)}
    if lora:  # as the app saves a +peft=lora run: the adapters only, the base by reference
        meta["peft"] = {"r": RANK, "alpha": ALPHA, "dropout": 0.0, "target_modules": list(ATTENTION),
                        "modules_to_save": []}
        meta["base"] = {"model": "hf", "path": hf_dir, "seed": 0}
    ckpt = save_checkpoint(Path(ckpt_root) / (LORA_CASE if lora else family), STEPS, engine.optimizer, mesh["dp"],
                           model=None if lora else engine.model, app_state={"step": STEPS}, meta=meta)
    return {"losses": losses, "params": {n: _full(p) for n, p in engine.model.named_parameters()},
            "checkpoint": str(ckpt)}


def worker(hf_dirs: dict[str, str], ckpt_root: str) -> dict:
    from deepshard.core import init_distributed

    init_distributed()
    out = {family: _run(family, hf_dirs[family], ckpt_root) for family in FAMILIES}
    out[OFFLOADED] = _run(OFFLOADED_FAMILY, hf_dirs[OFFLOADED_FAMILY], ckpt_root, offload=True)
    return {**out, LORA_CASE: _run(LORA_FAMILY, hf_dirs[LORA_FAMILY], ckpt_root, lora=True)}


def reference(family: str, lora: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """transformers' model, 3 steps of torch.optim.AdamW on the whole batch: summed token loss over
    the global valid count + coef * the mean over the dp ranks' row halves of each half's aux loss.
    ``lora``: PEFT's adapters on the attention projections, the only parameters trained."""
    model = moe_hf_model(family).train()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(ATTENTION),
                                                 lora_dropout=0.0))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if ".lora_" in n:
                    ours = n.removeprefix("base_model.model.model.").replace(".default.weight", "")
                    p.copy_(adapter_value(ours, tuple(p.shape)))
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
    ids, labels = chat_rows(STEPS)
    losses = []
    for step in range(STEPS):
        count = (labels[step] != -100).sum()
        ce, aux = 0.0, 0.0
        for r in range(DP):
            rows = slice(r * ROWS // DP, (r + 1) * ROWS // DP)
            out = model(ids[step, rows], output_router_logits=True)
            ce = ce + torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels[step, rows].flatten(),
                                                        ignore_index=-100, reduction="sum")
            aux = aux + out.aux_loss / DP
        (ce / count + COEF * aux).backward()
        opt.step()
        opt.zero_grad()
        losses.append((ce / count).item())
    return losses, {hf_name(n): p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    dirs = {}
    for family in FAMILIES:
        moe_hf_model(family).save_pretrained(str(root / family))
        dirs[family] = str(root / family)
    return launch_local(worker, DP, dirs, str(root / "ckpt")), dirs


def _merged(ranks: list[dict], family: str) -> dict[str, torch.Tensor]:
    params: dict[str, torch.Tensor] = {}
    for rank in ranks:
        params.update(rank[family]["params"])
    return params


@pytest.mark.parametrize("name", [*FAMILIES, OFFLOADED, LORA_CASE])
def test_zero3_trains_as_transformers_does_with_per_rank_aux(runs, name):
    ranks, _ = runs
    family = name.removeprefix("offload_").removeprefix("lora_")
    ref_losses, ref_params = reference(family, lora=name == LORA_CASE)
    losses = ranks[0][name]["losses"]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < 1e-5, (losses, ref_losses)
    ours = _merged(ranks, name)
    to_hf = registry.get(family).hf.to_hf_name
    assert {to_hf(n) for n in ours} == set(ref_params)
    worst = max(((ours[n] - ref_params[to_hf(n)]).abs().max().item(), n) for n in ours)
    assert worst[0] < 1e-5, worst
    start = dict(moe_hf_model(family).named_parameters())
    moved = {n for n, p in ref_params.items() if n not in start or (p - start[n]).abs().max() > 1e-4}
    assert moved == ({n for n in ref_params if ".lora_" in n} if name == LORA_CASE else set(ref_params))


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_in_transformers_with_our_logits(runs, tmp_path, family):
    from transformers import AutoModelForCausalLM

    from deepshard.finetune.tools.hf_export import export_checkpoint

    ranks, dirs = runs
    export_checkpoint(ranks[0][family]["checkpoint"], tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    spec = registry.for_hf(tmp_path / "hf")
    assert spec.name == family
    ours = spec.build(spec.hf.config_from_hf(dirs[family]))
    ours.init_weights(0)
    ours.load_state_dict(_merged(ranks, family), strict=False)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (hf(ids).logits - ours.eval()(ids)).abs().max().item() < 1e-5


def test_the_estimators_offloaded_model_states_are_what_the_run_holds(runs):
    """The estimator's host figure for the offloaded case, its parameter count from the family's
    config (the stacked experts and the dense layer included), against the bytes the ranks held
    (``train_harness.check_offloaded_figure``)."""
    from deepshard.finetune.models.memory_plan import model_counts
    from deepshard.finetune.models.working_set import RunShape, working_set
    from deepshard.offload import OffloadConfig

    ranks, dirs = runs
    cfg = registry.get(OFFLOADED_FAMILY).hf.config_from_hf(dirs[OFFLOADED_FAMILY])
    theirs = moe_hf_model(OFFLOADED_FAMILY)
    num_params = sum(p.numel() for p in theirs.parameters())  # transformers' count (tied: once)
    counts = model_counts(cfg, world=DP)
    assert counts.num_params == num_params
    shape = RunShape(stage=3, dp=DP, offload=OffloadConfig(device="cpu", params="cpu"), seq_len=SEQ)
    figure = working_set(cfg, counts, shape, baseline=0).host["model states (offloaded)"]
    check_offloaded_figure(figure, [rank[OFFLOADED]["memory"] for rank in ranks], theirs)


def test_lora_adapter_export_loads_in_peft_with_our_logits(runs, tmp_path):
    """``export --adapter`` of the attention-LoRA checkpoint: PEFT's ``PeftModel.from_pretrained`` on
    transformers' MoE model gives the logits of the base with ``alpha / r * B @ A`` of our trained
    factors added to each target weight (merged here, in plain torch)."""
    from deepshard.finetune.tools.adapter_export import export_adapter
    from tests.models.train_harness import check_adapter_in_peft

    ranks, _ = runs
    info = export_adapter(ranks[0][LORA_CASE]["checkpoint"], tmp_path / "adapter")
    assert info["tensors"] == 2 * len(ATTENTION) * 3  # A and B per target per layer (3 layers)
    check_adapter_in_peft(tmp_path / "adapter", _merged(ranks, LORA_CASE), lambda: moe_hf_model(LORA_FAMILY))
