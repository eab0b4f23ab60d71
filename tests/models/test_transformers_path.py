"""The transformers path: ``model=hf`` on GPT-2 (Conv1D, tied head), GPT-NeoX (its config's TP plan,
its ``embed_out`` key) and OLMo2 (q/k norms over all heads), tiny random models made by transformers'
own config classes and saved by ``save_pretrained``.

World 1: our token-weighted loss on masked variable-length rows equals the one computed in the test
from transformers' logits; packed documents see only themselves.  One shared world-2 run: ZeRO-3 on
each model (GPT-2 with grad accumulation and AC, GPT-NeoX with CPU offload, OLMo2 with LoRA once) and
GPT-NeoX at tp=2, and Ulysses sp=2 at ZeRO-3 (the app's stepper slicing each row; GPT-NeoX on the
masked rows, OLMo2 with grouped kv heads and AC and GPT-2 with absolute positions on packed documents),
and pp=2 at ZeRO-1 on each (GPT-2's tied head a copy on the last stage, its gradient summed with the
embedding's) equal transformers' model trained by plain torch.optim.AdamW (losses and every parameter within 1e-5); the ZeRO-3 checkpoints export to folders transformers loads with our logits,
and the LoRA checkpoint's ``export --adapter`` to a folder PEFT loads with our logits.
Refusals (pp on an unchecked architecture or a tie at pp > 2, sp on attention outside transformers' interface or with per-layer masks, tp without a
plan, LoRA on Conv1D) are one line from the app's settings.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deepshard.finetune.models import registry
from tests.models.hf_refs import ROWS, SEQ, VOCAB, chat_rows, reference_loss

STEPS, LR, BETAS, EPS, WD = 3, 2e-3, (0.9, 0.95), 1e-6, 0.1
KINDS = ("gpt2", "neox", "olmo2")
# name -> (kind, dp, tp, zero stage, grad_accum, ac, cpu offload, lora)
CASES = {"zero3_gpt2": ("gpt2", 2, 1, 3, 2, "full", False, False),
         "zero3_neox": ("neox", 2, 1, 3, 1, "none", True, False),
         "zero3_olmo2": ("olmo2", 2, 1, 3, 1, "none", False, False),
         "zero3_olmo2_lora": ("olmo2", 2, 1, 3, 1, "none", False, True),
         "tp2_neox": ("neox", 1, 2, 0, 1, "none", False, False)}  # one tp mesh per process: last
TARGETS, RANK, ALPHA = ("q_proj", "v_proj"), 4, 8.0
# Ulysses sp=2 at ZeRO-3 (sharded over dp x sp): name -> (kind, ac, packed documents)
SP_CASES = {"sp2_neox": ("neox", "none", False), "sp2_olmo2_packed_ac": ("olmo2", "full", True),
            "sp2_gpt2_packed": ("gpt2", "none", True)}
CUTS = (5, 12, 9, 17)  # each row's second document starts here (12: on the sp slices' edge)


def hf_config(kind: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "gpt2":
        return tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                             attn_pdrop=0.0, **common)
    if kind == "neox":
        return tf.GPTNeoXConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                                max_position_embeddings=64, **common)
    return tf.Olmo2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=48, max_position_embeddings=64, **common)


def hf_model(kind: str) -> torch.nn.Module:
    """transformers' own model, seeded, its biases and norm weights moved off zero / one."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(kind), dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or ".ln_" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def adapter_value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A LoRA factor's start by its transformers name (B non-zero, so both factors train)."""
    return 0.1 * torch.randn(shape, generator=torch.Generator().manual_seed(sum(map(ord, name))))


def _ours(hf_dir: str, device: str | None = "cpu"):
    """(spec, config, model) as the app builds it: on meta, then (``device``) materialized and loaded."""
    spec = registry.for_hf(hf_dir)
    cfg = spec.hf.config_from_hf(hf_dir)
    model = registry.build_meta(cfg)
    if device is not None:
        model.to_empty(device=device)
        model.init_weights(0)
        spec.hf.load_weights(model, hf_dir)
    return spec, cfg, model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("transformers_path")
    for kind in KINDS:
        hf_model(kind).save_pretrained(str(root / kind))
    return {kind: str(root / kind) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_our_loss_is_transformers_token_weighted_loss(dirs, kind):
    spec, cfg, model = _ours(dirs[kind])
    assert spec.name == "transformers" and registry.path_line(cfg).startswith("model: transformers path (")
    ids, labels = chat_rows(1)
    with torch.no_grad():
        ours = model.eval()(ids[0], labels[0], reduction="sum") / (labels[0] != -100).sum()
        ref = reference_loss(hf_model(kind)(ids[0]).logits, labels[0])
    assert abs(ours.item() - ref.item()) < 1e-5


@pytest.mark.parametrize("kind", ("gpt2", "olmo2"))
def test_packed_documents_see_only_themselves(dirs, kind):
    """Two documents in one row (doc_ids) give each the logits it has alone (absolute and rotary positions)."""
    _, _, model = _ours(dirs[kind])
    ids = torch.randint(3, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(2))
    doc_ids = (torch.arange(SEQ) >= 9).long().unsqueeze(0)
    ref = hf_model(kind)
    with torch.no_grad():
        packed = model.eval()(ids, doc_ids=doc_ids)
        alone = torch.cat([ref(ids[:, :9]).logits, ref(ids[:, 9:]).logits], dim=1)
    assert (packed - alone).abs().max().item() < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_two_stages_chained_give_transformers_logits(dirs, kind):
    """The pp split, both stages in this process: stage 0's hidden states through stage 1 give
    transformers' logits on packed documents (positions restart; GPT-2 adds its absolute positions
    once, on the first stage); GPT-2's last stage holds its own copy of the tied head."""
    from deepshard.finetune.models.transformers_path.pipeline import PipelineView, stage_init
    from deepshard.pipeline import split_model

    _, _, meta = _ours(dirs[kind], device=None)
    view = PipelineView(meta)
    stages = split_model(view, [range(0, 1), range(1, 2)], [0, 1], spec=view.spec,
                         init_fn=stage_init(full=lambda: _ours(dirs[kind])[2]))
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    doc_ids = (torch.arange(SEQ) >= 9).long().expand(2, SEQ)
    ref = hf_model(kind)
    with torch.no_grad():
        logits = stages[1](stages[0](ids, doc_ids), doc_ids)
        alone = torch.cat([ref(ids[:, :9]).logits, ref(ids[:, 9:]).logits], dim=1)
    assert (logits - alone).abs().max().item() < 1e-5
    head = dict(stages[1].named_parameters())["hf.lm_head.weight"]
    assert all(head is not p for p in stages[0].parameters())  # a copy: a tie would span the stages


def _worker(hf_dirs: dict[str, str], ckpt_root: str) -> dict:
    from deepshard.core import init_distributed

    init_distributed()
    first = [n for n in CASES if CASES[n][2] == 1]  # tp meshes last: one per process
    out = {name: _run(name, hf_dirs[CASES[name][0]], ckpt_root) for name in first}
    out.update({name: _run_sp(name, hf_dirs[SP_CASES[name][0]]) for name in SP_CASES})
    out.update({f"pp2_{kind}": _run_pp(hf_dirs[kind]) for kind in KINDS})
    out.update({name: _run(name, hf_dirs[CASES[name][0]], ckpt_root) for name in CASES if name not in first})
    return out


def _run_pp(hf_dir: str) -> dict:
    """pp=2 (ZeRO-1 at dp 1), GPipe over 2 micro-batches: each rank returns its stage's parameters."""
    from deepshard.core import (
        EngineConfig,
        OptimConfig,
        ParallelDims,
        PrecisionConfig,
        ZeroConfig,
        build_mesh,
    )

    spec, _, model = _ours(hf_dir, device=None)
    config = EngineConfig(zero=ZeroConfig(stage=1), precision=PrecisionConfig(dtype="fp32"),
                          optim=OptimConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, grad_clip=0.0))
    mesh = build_mesh(ParallelDims(pp=2, dp=1))
    init_fn = spec.stage_init(0, full=lambda: _ours(hf_dir)[2])
    trainer = spec.pipeline(model, mesh, config, schedule="gpipe", microbatches=2, init_fn=init_fn)
    ids, labels = chat_rows(STEPS)
    results = [trainer.train_step(ids[step], labels[step]) for step in range(STEPS)]
    params = {spec.hf.to_hf_name(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
              for m in trainer.pipeline.modules for n, p in m.named_parameters()}
    return {"losses": [r.loss for r in results], "norms": [r.stats.grad_norm for r in results], "params": params}


def packed_rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """chat_rows with a second document from CUTS[row] on: doc_ids, and the first one's last label masked."""
    ids, labels = chat_rows(STEPS)
    doc_ids = torch.stack([(torch.arange(SEQ) >= c).long() for c in CUTS]).expand(STEPS, -1, -1).clone()
    for row, cut in enumerate(CUTS):
        labels[:, row, cut - 1] = -100
    return ids, labels, doc_ids


def _run_sp(name: str, hf_dir: str) -> dict:
    """ZeRO-3 at dp 1 x sp 2 through the app's stepper: every sp rank gets the whole rows, keeps its slice."""
    import contextlib
    import types
    from functools import partial

    from deepshard.core import (
        EngineConfig,
        OptimConfig,
        ParallelDims,
        PrecisionConfig,
        ZeroConfig,
        build_mesh,
        initialize,
    )
    from deepshard.core.mesh import local_device
    from deepshard.finetune.recipe.steppers import EngineStepper

    _, ac, packed = SP_CASES[name]
    spec, _, model = _ours(hf_dir, device=None)

    def materialize(m: torch.nn.Module) -> None:
        m.init_weights(0)
        spec.hf.load_weights(m, hf_dir)

    config = EngineConfig(zero=ZeroConfig(stage=3, reduce_bucket_size=3000, allgather_bucket_size=3000),
                          precision=PrecisionConfig(dtype="fp32"), ac=ac,
                          optim=OptimConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, grad_clip=0.0))
    mesh = build_mesh(ParallelDims(pp=1, dp=1, sp=2))
    recipe = partial(spec.parallelize, mesh=mesh, zero=config.zero, dtype="fp32", ac=ac)
    engine = initialize(model, config, mesh=mesh, parallelize_fn=recipe, materialize=materialize)
    stepper = EngineStepper(engine, grad_accum=1, device=local_device())
    stepper.prof = types.SimpleNamespace(phase=lambda _: contextlib.nullcontext())
    ids, labels, doc_ids = packed_rows()
    stream = iter([{"input_ids": ids[s], "labels": labels[s], **({"doc_ids": doc_ids[s]} if packed else {})}
                   for s in range(STEPS)])
    losses = [stepper(stream).loss for _ in range(STEPS)]
    return {"losses": losses, "params": {spec.hf.to_hf_name(n): p.full_tensor().detach().cpu().clone()
                                         for n, p in engine.model.named_parameters()}}


def _run(name: str, hf_dir: str, ckpt_root: str) -> dict:
    from functools import partial

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
    from deepshard.core.checkpoint.state import save_checkpoint
    from deepshard.core.zero import CpuParamOffload
    from deepshard.finetune.models.lora import apply_lora

    kind, dp, tp, stage, accum, ac, offload, lora = CASES[name]
    spec, cfg, model = _ours(hf_dir, device=None)  # on meta
    if lora:
        apply_lora(model, r=RANK, alpha=ALPHA, target_modules=TARGETS, seed=None)

    def materialize(m: torch.nn.Module) -> None:
        m.init_weights(0)
        spec.hf.load_weights(m, hf_dir)
        if lora:
            for n, p in m.named_parameters():
                if ".lora_" in n:
                    from deepshard.core.dtensor_utils import copy_global

                    copy_global(p, adapter_value(spec.hf.to_hf_name(n).replace(".weight", ""), tuple(p.shape)))

    if stage != 3:
        model.to_empty(device="cpu")
        with torch.no_grad():
            materialize(model)
    config = EngineConfig(zero=ZeroConfig(stage=stage, reduce_bucket_size=3000, allgather_bucket_size=3000),
                          precision=PrecisionConfig(dtype="fp32"), grad_accum=accum, ac=ac,
                          optim=OptimConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, grad_clip=0.0))
    mesh = build_mesh(ParallelDims(pp=1, dp=dp, tp=tp))
    params = CpuParamOffload() if offload else None
    recipe = partial(spec.parallelize, mesh=mesh, zero=config.zero, dtype="fp32", ac=ac, offload_params=params)
    engine = initialize(model, config, mesh=mesh, parallelize_fn=recipe, offload_params=params,
                        materialize=materialize if stage == 3 else None)
    ids, labels = chat_rows(STEPS)
    r = mesh["dp"].get_local_rank()
    losses = []
    for step in range(STEPS):
        x, y = ids[step, r * ROWS // dp:(r + 1) * ROWS // dp], labels[step, r * ROWS // dp:(r + 1) * ROWS // dp]
        num_items = engine.global_num_items((y != -100).sum())
        total = torch.zeros(())
        for part in range(accum):  # the step's rows in ``accum`` micro-batches, one token-weighted loss
            rows = slice(part * len(x) // accum, (part + 1) * len(x) // accum)
            loss = engine(x[rows], y[rows], reduction="sum")
            engine.backward(loss, num_items=num_items)
            total += loss.detach()
        engine.step()
        dist.all_reduce(total, group=mesh["dp"].get_group())
        losses.append(total.item() / num_items.item())
    full = {spec.hf.to_hf_name(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
            for n, p in engine.model.named_parameters()}
    out = {"losses": losses, "params": full}
    if name in ("zero3_gpt2", "zero3_neox", "zero3_olmo2_lora"):
        meta = {"family": spec.name, "model": dataclasses.asdict(cfg)}
        if lora:  # as the app saves a +peft=lora run: the adapters only, the base by reference
            meta["peft"] = {"r": RANK, "alpha": ALPHA, "dropout": 0.0, "target_modules": list(TARGETS),
                            "modules_to_save": []}
            meta["base"] = {"model": "hf", "path": hf_dir, "seed": 0}
        out["checkpoint"] = str(save_checkpoint(Path(ckpt_root) / name, STEPS, engine.optimizer, mesh["dp"],
                                                model=None if lora else engine.model, app_state={"step": STEPS},
                                                meta=meta))
    return out


def reference(kind: str, lora: bool, packed: bool | None = None, norms: list[float] | None = None
              ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """transformers' model, 3 steps of torch.optim.AdamW on the whole batch (decay on matrices), the
    summed token loss over labels != -100 divided by their count; ``lora``: PEFT's adapters only;
    ``packed`` (not None): packed_rows' rows, documents told apart by positions restarting at CUTS
    (transformers' own packed-sequence mask); ``norms`` gets each step's global grad norm."""
    model = hf_model(kind).train()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS)))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if ".lora_" in n:
                    p.copy_(adapter_value(_hf_name(n).replace(".weight", ""), tuple(p.shape)))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS)
    ids, labels = chat_rows(STEPS) if packed is None else packed_rows()[:2]
    positions = torch.stack([torch.arange(SEQ) - torch.where(torch.arange(SEQ) >= c, c, 0) for c in CUTS])
    losses = []
    for step in range(STEPS):
        # packed: no cache, or transformers does not mask by the positions (its packed-sequence rule)
        logits = model(ids[step], **({"position_ids": positions, "use_cache": False} if packed else {})).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels[step].flatten(), ignore_index=-100, reduction="sum")
        loss = loss / (labels[step] != -100).sum()
        loss.backward()
        if norms is not None:  # each parameter once (a tied one is one tensor)
            norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {_hf_name(n): p.detach().clone() for n, p in model.named_parameters()}


def _hf_name(peft_name: str) -> str:
    return peft_name.removeprefix("base_model.model.").replace(".default.", ".").replace(".base_layer.", ".")


@pytest.fixture(scope="module")
def world2(dirs, gloo_pool, tmp_path_factory):
    return gloo_pool(2).run(_worker, dirs, str(tmp_path_factory.mktemp("transformers_ckpt")))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow  # a multi-rank launch: the full suite (the inner loop keeps the in-process checks)
def test_world2_trains_as_plain_torch(world2, name):
    kind, _, _, _, _, _, _, lora = CASES[name]
    ref_losses, ref_params = reference(kind, lora)
    losses = world2[0][name]["losses"]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < 1e-5, (losses, ref_losses)
    ours = world2[0][name]["params"]
    assert set(ours) <= set(ref_params) and set(ref_params) - set(ours) <= {"lm_head.weight"}  # tied: one name
    worst = max(((ours[n] - ref_params[n]).abs().max().item(), n) for n in ours)
    assert worst[0] < 1e-5, worst
    start = dict(hf_model(kind).named_parameters())
    moved = {n for n in ours if n not in start or (ours[n] - start[n]).abs().max() > 1e-4}
    assert moved == ({n for n in ours if ".lora_" in n} if lora else set(ours))


@pytest.mark.parametrize("name", list(SP_CASES))
@pytest.mark.slow  # in the shared world-2 launch
def test_sp2_trains_as_plain_torch(world2, name):
    """Ulysses through transformers' attention interface: each rank ran half of every row."""
    kind, _, packed = SP_CASES[name]
    ref_losses, ref_params = reference(kind, False, packed)
    losses, ours = world2[0][name]["losses"], world2[0][name]["params"]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < 1e-5, (losses, ref_losses)
    assert set(ours) <= set(ref_params) and set(ref_params) - set(ours) <= {"lm_head.weight"}
    worst = max(((ours[n] - ref_params[n]).abs().max().item(), n) for n in ours)
    assert worst[0] < 1e-5, worst
    start = dict(hf_model(kind).named_parameters())
    assert all((ours[n] - start[n]).abs().max() > 1e-4 for n in ours)  # every parameter trained


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow  # in the shared world-2 launch
def test_pp2_trains_as_plain_torch(world2, kind):
    """Each model cut into two stages (embeddings + layer 0, layer 1 + final norm + head; GPT-NeoX's and
    OLMo2's rotary on both; GPT-2's position embedding on the first only, its tied head a copy on the
    last whose gradient is summed with the embedding's: both copies equal the reference's one tensor)."""
    ref_norms: list[float] = []
    ref_losses, ref_params = reference(kind, False, norms=ref_norms)
    losses = world2[0][f"pp2_{kind}"]["losses"]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < 1e-5, (losses, ref_losses)
    norms = world2[0][f"pp2_{kind}"]["norms"]  # a tied head's two copies count once, as its one tensor
    assert max(abs(a / b - 1) for a, b in zip(norms, ref_norms, strict=True)) < 1e-5, (norms, ref_norms)
    first, last = world2[0][f"pp2_{kind}"]["params"], world2[1][f"pp2_{kind}"]["params"]
    embed = next(n for n in first if n.endswith(("wte.weight", "embed_in.weight", "embed_tokens.weight")))
    assert not set(first) & set(last) and set(first) | set(last) == set(ref_params) | {"lm_head.weight"}
    if hf_config(kind).tie_word_embeddings:  # the last stage's copy of the tied head moved with the embedding
        assert "lm_head.weight" not in ref_params
        assert (last["lm_head.weight"] - ref_params[embed]).abs().max().item() < 1e-5
        last = {n: t for n, t in last.items() if n != "lm_head.weight"}
    ours = first | last
    worst = max(((ours[n] - ref_params[n]).abs().max().item(), n) for n in ours)
    assert worst[0] < 1e-5, worst


def test_packed_rows_cross_the_sp_edge():
    """What sp=2 must get right is in the data: documents and valid labels across the slices' edge."""
    _, labels, doc_ids = packed_rows()
    edge = SEQ // 2
    assert (labels[..., edge - 1] != -100).any() and (doc_ids[..., edge - 1] == doc_ids[..., edge]).any()
    assert (doc_ids[..., edge] != doc_ids[..., edge - 1]).any()  # and a document starting on it


@pytest.mark.parametrize("name", ("zero3_gpt2", "zero3_neox"))
@pytest.mark.slow  # a multi-rank launch: the full suite (the inner loop keeps the in-process checks)
def test_export_loads_in_transformers_with_our_logits(world2, tmp_path, name):
    from transformers import AutoModelForCausalLM

    from deepshard.finetune.tools.hf_export import export_checkpoint

    export_checkpoint(world2[0][name]["checkpoint"], tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == hf_config(CASES[name][0]).model_type
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    trained = hf_model(CASES[name][0])
    missing = trained.load_state_dict(world2[0][name]["params"], strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"}
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (loaded(ids).logits - trained(ids).logits).abs().max().item() < 1e-5


@pytest.mark.slow  # a multi-rank launch: the full suite (the inner loop keeps the in-process checks)
def test_lora_adapter_export_loads_in_peft_with_our_logits(world2, tmp_path):
    """``export --adapter`` of the OLMo2 LoRA checkpoint: PEFT's ``PeftModel.from_pretrained`` on
    transformers' base gives the logits of the base with ``alpha / r * B @ A`` of our trained factors
    added to each target weight (merged here, in plain torch)."""
    from peft import PeftModel

    from deepshard.finetune.tools.adapter_export import export_adapter

    name = "zero3_olmo2_lora"
    info = export_adapter(world2[0][name]["checkpoint"], tmp_path / "adapter")
    assert info["tensors"] == 2 * len(TARGETS) * 2  # A and B per target per layer (2 layers)
    loaded = PeftModel.from_pretrained(hf_model("olmo2"), str(tmp_path / "adapter")).eval()
    ours, merged = world2[0][name]["params"], hf_model("olmo2")
    weights = merged.state_dict()
    with torch.no_grad():
        for n in [n for n in ours if n.endswith(".lora_A.weight")]:
            stem = n.removesuffix(".lora_A.weight")
            weights[stem + ".weight"] += ALPHA / RANK * ours[stem + ".lora_B.weight"] @ ours[n]
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
        want = merged(ids).logits
        assert (loaded(ids).logits - want).abs().max().item() < 1e-5
        assert (hf_model("olmo2")(ids).logits - want).abs().max().item() > 1e-3  # the adapters changed it


def _settings(hf_dir: str, *overrides: str, world: int = 2):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from deepshard.finetune.config import register, validate

    register()
    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose(config_name="config", overrides=["model=hf", f"model.path={hf_dir}", "data.seq_len=32", *overrides])
    return validate(OmegaConf.to_container(cfg, resolve=True), world_size=world)


@pytest.mark.parametrize(("kind", "overrides", "message"), [
    ("gpt2", ["parallel.tp=2"], r"^parallel.tp=2: GPT2LMHeadModel .* has no base_model_tp_plan"),
    ("gpt2", ["+peft=lora", "peft.target_modules=[q_proj]"], r"GPT2LMHeadModel has no nn.Linear of those names"),
])
def test_refusals_are_one_line_before_start(dirs, kind, overrides, message):
    with pytest.raises(ValueError, match=message) as err:
        _settings(dirs[kind], *overrides)
    assert "\n" not in str(err.value)


def test_pp_refusals_are_one_line_before_start(dirs, tmp_path):
    """pp on an architecture whose stages were never checked (Bloom), and a tied head at pp > 2 (the two
    copies' gradients are summed over a pp group of two)."""
    from transformers import AutoModelForCausalLM, BloomConfig

    AutoModelForCausalLM.from_config(BloomConfig(vocab_size=VOCAB, hidden_size=16, n_layer=2, n_head=4)
                                     ).save_pretrained(str(tmp_path))
    for hf_dir, pp, message in (
            (str(tmp_path), 2, r"^parallel.pp=2: the transformers path splits \['GPTNeoXForCausalLM', "
                               r"'GPT2LMHeadModel', 'Olmo2ForCausalLM'\] only \(BloomForCausalLM is untested"),
            (dirs["gpt2"], 4, r"^parallel.pp=4: GPT2LMHeadModel ties its head to its embedding \(tie_word_"
                              r"embeddings\); the first and last stages sum their two copies' gradients at "
                              r"parallel.pp=2 only")):
        with pytest.raises(ValueError, match=message) as err:
            _settings(hf_dir, f"parallel.pp={pp}", world=pp)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize(("config", "message"), [
    (dict(model_type="bloom", n_head=4), r"^parallel.sp=2: BloomForCausalLM's attention does not go through "),
    (dict(model_type="starcoder2", num_attention_heads=4, sliding_window=8),
     r"^parallel.sp=2: Starcoder2ForCausalLM sets sliding_window, a mask or bias transformers builds per layer"),
    (dict(model_type="gpt_neox", num_attention_heads=4), r"^parallel.sp=3 does not divide model.n_heads=4"),
])
def test_sp_refusals_are_one_line_before_start(tmp_path, config, message):
    """sp where the registered attention cannot reach (Bloom's own attention with ALiBi), or would drop
    a per-layer mask (Starcoder2's sliding window), or heads that sp does not split."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = dict(config)
    kind = config.pop("model_type")
    torch.manual_seed(0)
    hf = CONFIG_MAPPING[kind](vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, intermediate_size=32, **config)
    AutoModelForCausalLM.from_config(hf).save_pretrained(str(tmp_path))
    sp = 3 if "n_heads=4" in message else 2
    with pytest.raises(ValueError, match=message) as err:
        _settings(str(tmp_path), f"parallel.sp={sp}", "data.seq_len=24", world=sp)
    assert "\n" not in str(err.value)


def test_the_app_reads_any_causal_lm_as_the_transformers_path(dirs):
    s = _settings(dirs["neox"], "parallel.tp=2")  # GPT-NeoX's config carries a tp plan
    assert registry.spec_of(s.model).name == "transformers" and s.model.arch == "GPTNeoXForCausalLM"
    assert registry.path_line(s.model) == "model: transformers path (GPTNeoXForCausalLM)"
    assert registry.path_line(registry.get("llama").config()) == "model: native (llama)"
    for kind in KINDS:  # the layouts tested in the world-2 launch
        assert _settings(dirs[kind], "parallel.pp=2").parallel.pp == 2
    assert _settings(dirs["olmo2"], "parallel.sp=2").parallel.sp == 2


def test_the_estimator_and_the_flop_count_take_it(dirs):
    """The app's preflight and profiler run on it: FLOPs counted on meta, activations from its bound."""
    from deepshard.finetune.models.working_set import working_set_of
    from deepshard.finetune.recipe.assemble import step_flops

    s = _settings(dirs["olmo2"], "+zero=stage3", "ac=full")
    c = s.model
    tokens = s.train.micro_batch_size * s.data.seq_len
    matmul = sum(p.numel() for n, p in hf_model("olmo2").named_parameters() if p.dim() == 2 and "embed" not in n)
    assert step_flops(s) >= 6 * tokens * matmul * s.train.grad_accum  # 6 FLOPs per weight per token, at least
    ws = working_set_of(s, baseline=0)
    assert ws.device["activations"] >= tokens * (c.n_layers * c.dim + c.vocab_size) * 4


def test_peft_init_from_loads_a_peft_folder_into_the_transformers_path(dirs, tmp_path):
    """``peft.init_from``: an adapter folder that PEFT itself saved from transformers' OLMo2 (factors
    away from PEFT's init) passes the settings' check and loads into our transformers-path model with
    LoRA (PEFT's keys are transformers' names, not the decoder's); our logits equal PeftModel's."""
    from peft import LoraConfig, get_peft_model

    from deepshard.finetune.models.lora import apply_lora
    from deepshard.finetune.models.peft_adapter import load_peft_adapter

    theirs = get_peft_model(hf_model("olmo2"), LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS)))
    with torch.no_grad():
        for n, p in theirs.named_parameters():
            if ".lora_" in n:
                p.copy_(adapter_value(_hf_name(n).replace(".weight", ""), tuple(p.shape)))
    theirs.save_pretrained(str(tmp_path / "adapter"))
    s = _settings(dirs["olmo2"], "+peft=lora", f"peft.r={RANK}", f"peft.alpha={ALPHA}",
                  f"peft.target_modules=[{','.join(TARGETS)}]", f"peft.init_from={tmp_path / 'adapter'}")
    assert s.peft.init_from
    _, _, ours = _ours(dirs["olmo2"])
    apply_lora(ours, r=RANK, alpha=ALPHA, target_modules=TARGETS, seed=0)
    assert load_peft_adapter(ours, str(tmp_path / "adapter")) == 2 * len(TARGETS) * 2
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (ours.eval()(ids) - theirs.eval()(ids).logits).abs().max().item() < 1e-5
        assert (ours(ids) - hf_model("olmo2")(ids).logits).abs().max().item() > 1e-3  # the adapters count
