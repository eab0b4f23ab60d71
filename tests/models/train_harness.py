"""Shared by the family training tests: one world-2 launch trains each case 3 steps on masked
chat-like rows through the family's own recipe (the registry's ``parallelize`` / ``pipeline``), and
the test process trains transformers' own model of it with torch.optim.AdamW on the whole batch.

Cases: ZeRO-3 at dp=2 for every family (Qwen3 with its embedding and head in vocabulary tiles,
Qwen2 with the chunked fused loss in several chunks, Phi-3 split from its fused checkpoint), Qwen3 at tp=2 and Mistral at pp=2 (its rows
longer than the window).  Issue 39's cells: Phi-3 at tp=2 (its fused q/k/v and gate/up split on load,
so each piece is column-sharded by heads) and pp=2; Ulysses sp=2 (ZeRO-3 over dp x sp, each rank
holding half of every row) for Gemma 3 (a sliding and a global layer, rows longer than the window),
Gemma 2 (attention scores soft-capped), Qwen2, Qwen3, Mistral and Phi-3 (longrope: the whole row's
length picks the factors); Qwen2 and Mistral at tp=2, Qwen2 and Qwen3 at pp=2, Llama and Gemma 3 with their tied heads at pp=2
(Llama's checkpoint after step 2 resumed at pp=1 for the last step); ZeRO-3 with the
parameters and the optimizer state in host memory (``offload.params=cpu``, ``offload.device=cpu``)
for Qwen2, Qwen3, Mistral, Phi-3 and Gemma 3 (each records its measured model-state bytes); LoRA on
every projection at ZeRO-3 for Qwen2, Qwen3, Mistral (against PEFT) and Phi-3 (against plain-torch
LoRA on the rows of its fused projections, which PEFT cannot adapt).  The tp layouts run last.  Each family's
``zero3_<family>`` case saves a checkpoint the export test reads, each LoRA case an adapters-only one
(as ``+peft=lora`` saves) that ``export --adapter`` reads.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

import torch

from tests.models.hf_refs import ROWS, SEQ, VOCAB, chat_rows, hf_model

STEPS = 3
# eps 1e-6, not 1e-8: a gradient near zero (Qwen2's k bias: 1e-10; softmax barely sees it) is rounding
# noise that Adam normalizes to a full-size step.  With 1e-8 even our single-process model drifted
# 1.6e-5 (Qwen2) and 4.4e-5 (Qwen3) from transformers' in 3 steps, its step-1 gradients within 5e-8.
LR, BETAS, EPS, WD = 2e-3, (0.9, 0.95), 1e-6, 0.1
# name -> (family, pp, dp, tp, zero stage, config overrides)
CASES = {"zero3_qwen3": ("qwen3", 1, 2, 1, 3, {"vocab_tile_size": 48}),
         "zero3_qwen2": ("qwen2", 1, 2, 1, 3, {"loss_chunk_size": 16}),
         "zero3_mistral": ("mistral", 1, 2, 1, 3, {}),
         "zero3_llama": ("llama", 1, 2, 1, 3, {}),
         "zero3_gemma3": ("gemma3", 1, 2, 1, 3, {"loss_chunk_size": 16}),  # the soft-capped chunked loss
         "pp2_mistral": ("mistral", 2, 1, 1, 1, {}),
         "zero3_qwen2_lora": ("qwen2", 1, 2, 1, 3, {}),
         "zero3_phi3": ("phi3", 1, 2, 1, 3, {}),
         "pp2_phi3": ("phi3", 2, 1, 1, 1, {}),
         "pp2_qwen2": ("qwen2", 2, 1, 1, 0, {}),
         "pp2_qwen3": ("qwen3", 2, 1, 1, 1, {}),
         "pp2_llama": ("llama", 2, 1, 1, 1, {}),  # tied head: the last stage's copy of the embedding
         "pp2_gemma3": ("gemma3", 2, 1, 1, 1, {}),  # tied, soft-capped head; the scaled embedding first
         "resume_pp1_llama": ("llama", 1, 2, 1, 1, {}),  # pp2_llama's checkpoint after step 2, at pp=1
         "sp2_gemma3": ("gemma3", 1, 1, 1, 3, {}),
         "sp2_gemma2": ("gemma2", 1, 1, 1, 3, {}),
         "sp2_qwen2": ("qwen2", 1, 1, 1, 3, {}),
         "sp2_qwen3": ("qwen3", 1, 1, 1, 1, {}),
         "sp2_mistral": ("mistral", 1, 1, 1, 3, {}),
         "sp2_phi3": ("phi3", 1, 1, 1, 1, {}),
         "offload_qwen2": ("qwen2", 1, 2, 1, 3, {}),
         "offload_qwen3": ("qwen3", 1, 2, 1, 3, {}),
         "offload_mistral": ("mistral", 1, 2, 1, 3, {}),
         "offload_phi3": ("phi3", 1, 2, 1, 3, {}),
         "offload_gemma3": ("gemma3", 1, 2, 1, 3, {}),  # tied head: one host copy for embedding and head
         "zero3_qwen3_lora": ("qwen3", 1, 2, 1, 3, {}),
         "zero3_mistral_lora": ("mistral", 1, 2, 1, 3, {}),
         "zero3_phi3_lora": ("phi3", 1, 2, 1, 3, {}),  # q/k/v and gate/up: pieces of fused HF projections
         "tp2_qwen3": ("qwen3", 1, 1, 2, 0, {}),
         "tp2_gemma3": ("gemma3", 1, 1, 2, 0, {}),
         "tp2_phi3": ("phi3", 1, 1, 2, 0, {}),
         "tp2_qwen2": ("qwen2", 1, 1, 2, 1, {}),
         "tp2_mistral": ("mistral", 1, 1, 2, 0, {})}
# a case that resumes another's checkpoint, saved after step STEPS - 1 (under another layout), and
# trains the last step: the uninterrupted run's last loss and parameters
RESUME = {"resume_pp1_llama": "pp2_llama"}
SP = {name: 2 for name in CASES if name.startswith("sp2_")}  # Ulysses: the sp axis takes the world
OFFLOAD = {name for name in CASES if name.startswith("offload_")}  # CPU params (FSDP2's) + CPU optimizer state
# adapters on every projection (Qwen2's q/k/v carry their frozen biases, Qwen3's q/k feed its norms), base frozen
LORA = {"zero3_qwen2_lora", "zero3_qwen3_lora", "zero3_mistral_lora", "zero3_phi3_lora"}
TARGETS, RANK, ALPHA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 4, 8.0


def adapter_value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A LoRA factor's start, by its name (``...q_proj.lora_B``): B non-zero, so both factors train."""
    seed = sum(map(ord, name)) * 31 + len(name)
    return 0.1 * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _engine_config(stage: int):
    from deepshard.core import EngineConfig, OptimConfig, PrecisionConfig, ZeroConfig

    return EngineConfig(zero=ZeroConfig(stage=stage, reduce_bucket_size=3000, allgather_bucket_size=3000),
                        precision=PrecisionConfig(dtype="fp32"),
                        optim=OptimConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, grad_clip=0.0))


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu().clone()


def train_steps(engine, ids: torch.Tensor, labels: torch.Tensor, rows: slice, group,
                cols: slice = slice(None)) -> list[float]:
    """One token-weighted step per leading index of ``ids`` on this rank's ``rows`` (and, under sp, its
    ``cols`` of each row: the labels were aligned on the whole row); each step's global mean loss
    (``group``: every rank holding a part of the batch)."""
    import torch.distributed as dist

    losses = []
    for step in range(ids.shape[0]):
        x, y = ids[step, rows, cols], labels[step, rows, cols]
        num_items = engine.global_num_items((y != -100).sum())
        loss = engine(x, y, reduction="sum")
        engine.backward(loss, num_items=num_items)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append(total.item() / num_items.item())
    return losses


def measure_after_backward(engine, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, int]:
    """This rank's measured model-state bytes with the gradients alive: one more forward and backward
    (no step; the case's results are taken before it)."""
    engine.backward(engine(ids, labels, reduction="sum"), num_items=engine.global_num_items((labels != -100).sum()))
    return engine.memory()["measured"].as_dict()


def check_offloaded_figure(figure: int, held: list[dict[str, int]], reference: torch.nn.Module) -> None:
    """The estimator's host figure for ZeRO-3 with ``offload.params=cpu offload.device=cpu`` over
    ``len(held)`` ranks (in rank order) against what each rank held after a backward (``reference``:
    transformers' model of the case).  The figure is 20 B per parameter / dp: fp32 params and grads
    (8 B) and the host store's fp32 master + Adam moments (12 B).  Rank r holds rows [r*c, (r+1)*c) of
    dim 0 of every tensor (c = ceil(rows / dp): 5 experts over 2 ranks are 3 + 2) as params, as grads
    and twice as moments; on a CPU-only host the master is the param itself, so the run holds 16 B
    per parameter in all: the figure bounds the ranks' mean from above by the aliased master."""
    dp = len(held)
    num_params = sum(p.numel() for p in reference.parameters())  # a tied head once
    assert figure == 20 * num_params // dp, (figure, num_params)

    def shard(rank: int) -> int:  # fp32 bytes of this rank's rows of every tensor
        rows = [(p.shape[0], -(-p.shape[0] // dp), p.numel() // p.shape[0]) for p in reference.parameters()]
        return sum(max(0, min(n, (rank + 1) * c) - rank * c) * rest * 4 for n, c, rest in rows)

    for rank, h in enumerate(held):
        mine = shard(rank)
        assert (h["params"], h["grads"], h["host"], h["optimizer"]) == (mine, mine, 2 * mine, 0), (rank, h, mine)
    assert sum(h["params"] + h["grads"] + h["host"] for h in held) == 16 * num_params <= dp * figure


def _run(name: str, hf_dir: str, ckpt_root: str) -> dict:
    """This rank's part of one case: the global losses and the trained parameters it holds, by our names."""

    from deepshard.core import DeviceStateStore, ParallelDims, build_mesh, initialize
    from deepshard.core.checkpoint.state import save_checkpoint
    from deepshard.core.mesh import zero_mesh
    from deepshard.core.zero import CpuParamOffload
    from deepshard.finetune.models import registry
    from deepshard.offload import CpuStateStore

    family, pp, dp, tp, stage, overrides = CASES[name]
    sp = SP.get(name, 1)
    spec = registry.for_hf(hf_dir)
    cfg = dataclasses.replace(spec.hf.config_from_hf(hf_dir), **overrides)
    model = spec.build(cfg)
    model.init_weights(0)
    spec.hf.load_weights(model, hf_dir)
    if name in LORA:
        from deepshard.finetune.models.lora import apply_lora

        apply_lora(model, r=RANK, alpha=ALPHA, target_modules=TARGETS, seed=None)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if ".lora_" in n:
                    p.copy_(adapter_value(n.replace(".weight", ""), tuple(p.shape)))
    config = _engine_config(stage)
    mesh = build_mesh(ParallelDims(pp=pp, dp=dp, tp=tp, sp=sp))
    ids, labels = chat_rows(STEPS)
    rows = slice(mesh["dp"].get_local_rank() * ROWS // dp, (mesh["dp"].get_local_rank() + 1) * ROWS // dp)
    part = mesh["sp"].get_local_rank() if sp > 1 else 0
    cols = slice(part * SEQ // sp, (part + 1) * SEQ // sp)
    losses = []
    if pp > 1:
        trainer = spec.pipeline(model, mesh, config, schedule="gpipe", microbatches=2)
        for step in range(STEPS):
            if step == STEPS - 1 and name in RESUME.values():
                save_checkpoint(Path(ckpt_root) / name, step, trainer.optimizer, mesh["dp"], app_state={"step": step})
            losses.append(trainer.train_step(ids[step, rows], labels[step, rows]).loss)
        modules = trainer.pipeline.modules
        params = {n: _full(p) for m in modules for n, p in m.named_parameters()}
        return {"losses": losses, "params": params}
    offload = CpuParamOffload() if name in OFFLOAD else None
    recipe = partial(spec.parallelize, mesh=mesh, zero=config.zero, dtype="fp32", ac="none", offload_params=offload)
    engine = initialize(model, config, mesh=mesh, parallelize_fn=recipe, offload_params=offload,
                        store_factory=CpuStateStore if name in OFFLOAD else DeviceStateStore)
    first = 0
    if name in RESUME:
        from deepshard.core.checkpoint.state import load_checkpoint, step_dir_name

        first = STEPS - 1
        load_checkpoint(Path(ckpt_root) / RESUME[name] / step_dir_name(first), engine.optimizer, zero_mesh(mesh),
                        model=engine.model)
    losses += train_steps(engine, ids[first:], labels[first:], rows, zero_mesh(mesh).get_group(), cols)
    out = {"losses": losses, "params": {n: _full(p) for n, p in engine.model.named_parameters()}}
    if name in OFFLOAD:  # what the estimator's model-states figure is held against: the bytes after a backward
        out["memory"] = measure_after_backward(engine, ids[0, rows, cols], labels[0, rows, cols])
    if name == f"zero3_{family}" or name in LORA:
        meta = {"family": spec.name, "model": dataclasses.asdict(cfg)}
        if name in LORA:  # as the app saves a +peft=lora run: the adapters only, the base by reference
            meta["peft"] = {"r": RANK, "alpha": ALPHA, "dropout": 0.0, "target_modules": list(TARGETS),
                            "modules_to_save": []}
            meta["base"] = {"model": "hf", "path": hf_dir, "seed": 0}
        out["checkpoint"] = str(save_checkpoint(Path(ckpt_root) / name, STEPS, engine.optimizer, mesh["dp"],
                                                model=None if name in LORA else engine.model,
                                                app_state={"step": STEPS}, meta=meta))
    return out


def worker(hf_dirs: dict[str, str], ckpt_root: str) -> dict:
    from deepshard.core import init_distributed

    init_distributed()
    return {name: _run(name, hf_dirs[CASES[name][0]], ckpt_root) for name in CASES}


def _peft(model: torch.nn.Module) -> torch.nn.Module:
    """PEFT's LoRA on transformers' model, its factors set to :func:`adapter_value` by our names."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS),
                                             lora_dropout=0.0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                ours = n.removeprefix("base_model.model.model.").replace(".default.weight", "")
                p.copy_(adapter_value(ours, tuple(p.shape)))
    return model


def _add_lora(pairs: list[tuple[torch.Tensor, torch.Tensor]], module, args, out: torch.Tensor) -> torch.Tensor:
    x = args[0]
    return out + torch.cat([x @ a.T @ b.T for a, b in pairs], dim=-1) * (ALPHA / RANK)


def _sliced_lora(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """LoRA in plain torch on transformers' Phi-3, where PEFT has no adapter on a slice of a fused
    projection: q/k/v (rows of ``qkv_proj``) and gate/up (rows of ``gate_up_proj``) each get
    ``alpha / r * B @ A`` of their own factors on their rows, o_proj and down_proj on all of theirs (a
    forward hook per projection); the base frozen.  Returns the factors by our names with ``model.``."""
    model.requires_grad_(False)
    c = model.config
    head = c.hidden_size // c.num_attention_heads
    q, kv, ffn = c.num_attention_heads * head, c.num_key_value_heads * head, c.intermediate_size
    factors: dict[str, torch.nn.Parameter] = {}
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for module, parts in ((attn.qkv_proj, (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv))),
                              (attn.o_proj, (("self_attn.o_proj", attn.o_proj.out_features),)),
                              (mlp.gate_up_proj, (("mlp.gate_proj", ffn), ("mlp.up_proj", ffn))),
                              (mlp.down_proj, (("mlp.down_proj", mlp.down_proj.out_features),))):
            pairs = []
            for part, rows in parts:
                stem = f"layers.{i}.{part}"
                a = torch.nn.Parameter(adapter_value(stem + ".lora_A", (RANK, module.in_features)))
                b = torch.nn.Parameter(adapter_value(stem + ".lora_B", (rows, RANK)))
                factors[f"model.{stem}.lora_A.weight"], factors[f"model.{stem}.lora_B.weight"] = a, b
                pairs.append((a, b))
            module.register_forward_hook(partial(_add_lora, pairs))
    return factors


def hf_name(peft_name: str) -> str:
    """A PEFT parameter's name as transformers' (adapters keep their ``lora_A.weight`` leaf)."""
    return peft_name.removeprefix("base_model.model.").replace(".default.", ".").replace(".base_layer.", ".")


def reference(family: str, lora: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """transformers' own model (the saved case), 3 steps of torch.optim.AdamW on the whole batch:
    the summed token loss over labels != -100 divided by their count; decay on matrices only.
    ``lora``: PEFT's adapters on it (Phi-3's: :func:`_sliced_lora`), the only parameters trained."""
    model = hf_model(family).train()
    factors = _sliced_lora(model) if lora and family == "phi3" else {}
    if lora and not factors:
        model = _peft(model)
    params = [p for p in model.parameters() if p.requires_grad] + list(factors.values())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
    ids, labels = chat_rows(STEPS)
    losses = []
    for step in range(STEPS):
        logits = model(ids[step]).logits
        valid = labels[step] != -100
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[step].flatten(), ignore_index=-100,
                                                 reduction="sum") / valid.sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    named = {**dict(model.named_parameters()), **factors}
    return losses, {hf_name(n): p.detach().clone() for n, p in named.items()}


def check_adapter_in_peft(adapter_dir: Path, trained: dict[str, torch.Tensor], fresh_model) -> None:
    """Our exported adapter loaded by PEFT onto ``fresh_model()`` (transformers' model of the base) gives the
    logits of that model with each trained ``B @ A`` (scaled alpha / r) merged into its weight by hand."""
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(fresh_model(), str(adapter_dir)).eval()
    merged = fresh_model()
    weights = dict(merged.named_parameters())
    with torch.no_grad():
        for n in [n for n in trained if n.endswith(".lora_A.weight")]:
            stem = n.removesuffix(".lora_A.weight")
            weights[f"model.{stem}.weight"] += ALPHA / RANK * trained[stem + ".lora_B.weight"] @ trained[n]
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
        want = merged(ids).logits
        assert (loaded(ids).logits - want).abs().max().item() < 1e-5
        assert (fresh_model()(ids).logits - want).abs().max().item() > 1e-3  # the adapters changed it
