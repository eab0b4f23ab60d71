"""Ulysses sequence parallelism (``parallel.sp``) trains exactly what one process trains on whole rows.

The reference is plain single-process torch written here: the whole global batch of whole rows at
once, logits from the model, ``F.cross_entropy(reduction="sum") / (labels != -100).sum()``,
torch.optim.AdamW with its own decay groups, clip_grad_norm_.  It shares no code with the mesh, the
all-to-alls, the engine, the stepper (which slices each row per sp rank) or the fused loss.

The data look like users' packed rows: 2-3 documents per row (``doc_ids``, boundaries on and off
the sp slices' edges), masked prompts, right padding, and valid labels at the slices' edges (the last
token of slice k predicts the first of slice k+1).  The model has grouped-query attention with 2 kv
heads, so sp=4 exercises the kv-head replication.

Layouts (global batch 4 rows of 16 tokens, 3 steps): world 2 = sp 2 at ZeRO 1 (micro 2 x accum 2),
ZeRO 3 with activation checkpointing and the MLP in 3 tiles (micro 4), ZeRO 2 with LoRA adapters, ZeRO 3 with
ZeRO++'s int8 weights and gradients (sharded over dp x sp, near the reference); world 4 = sp 2 x dp 2 at
ZeRO 3, sp 4 at ZeRO 1, and sp 2 x tp 2 at ZeRO 1.  Two launches, ~45 s together on 2 cores.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from deepshard.finetune.models.llama import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=72, max_seq_len=32)
SEQ, ROWS, STEPS = 16, 4, 3
LR, BETAS, EPS, WD, CLIP = 2e-3, (0.9, 0.95), 1e-6, 0.1, 0.05
LORA = {"r": 4, "alpha": 8.0}
# name: (world, sp, zero stage, micro batch, grad accum, ac, mlp tiles, lora)
LAYOUTS = {
    "sp2_zero1_accum2": (2, 2, 1, 2, 2, "none", 1, False),
    "sp2_zero3_ac_tiled_mlp": (2, 2, 3, 4, 1, "full", 3, False),
    "sp2_zero2_lora": (2, 2, 2, 4, 1, "none", 1, True),
    "sp2_zero0": (2, 2, 0, 4, 1, "none", 1, False),
    "sp2_zero2_offload_cpu": (2, 2, 2, 4, 1, "none", 1, False),  # the optimizer state in host memory
    # ZeRO++'s int8 weights and gradients over the shard group dp x sp (2 ranks at dp 1): near, not equal
    "sp2_zero3_quantized": (2, 2, 3, 4, 1, "none", 1, False),
    "sp2_dp2_zero3": (4, 2, 3, 2, 1, "none", 1, False),
    "sp4_zero1_gqa_repeat": (4, 4, 1, 4, 1, "none", 1, False),
    "sp2_tp2_zero1": (4, (2, 2), 1, 4, 1, "none", 1, False),  # (sp, tp): 1 local kv head, repeated for sp
}


def model(lora: bool = False, mlp_tiles: int = 1) -> Llama:
    torch.manual_seed(0)
    m = Llama(dataclasses.replace(CFG, mlp_tiles=mlp_tiles))
    m.init_weights(0)
    if lora:
        from deepshard.finetune.models.lora import apply_lora

        apply_lora(m, **LORA, seed=0)
    return m


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, labels, doc_ids [step, rows, SEQ]: tokens follow next = 5 * prev + 1 (mod vocab) inside a
    document; each row packs 2-3 documents; each document's first tokens are a masked prompt; rows end
    in padding (label -100) at random."""
    g = torch.Generator().manual_seed(3)
    ids = torch.zeros(STEPS, ROWS, SEQ, dtype=torch.long)
    labels = torch.full((STEPS, ROWS, SEQ), -100, dtype=torch.long)
    doc_ids = torch.zeros(STEPS, ROWS, SEQ, dtype=torch.long)
    for s in range(STEPS):
        for r in range(ROWS):
            cuts = sorted(torch.randperm(SEQ - 2, generator=g)[:int(torch.randint(1, 3, (1,), generator=g))] + 1)
            bounds = [0, *[int(c) for c in cuts], SEQ]
            for d, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
                tok = int(torch.randint(0, CFG.vocab_size, (1,), generator=g))
                for t in range(lo, hi):
                    ids[s, r, t] = tok
                    tok = (tok * 5 + 1) % CFG.vocab_size
                    if t < hi - 1:  # labels[t]: the token after t, inside its document
                        labels[s, r, t] = (ids[s, r, t] * 5 + 1) % CFG.vocab_size
                doc_ids[s, r, lo:hi] = d
                prompt = int(torch.randint(0, max(1, (hi - lo) // 2), (1,), generator=g))
                labels[s, r, lo:lo + prompt] = -100
            pad = int(torch.randint(0, 4, (1,), generator=g))
            if pad:
                labels[s, r, SEQ - pad:] = -100
    return ids, labels, doc_ids


def reference(lora: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single process, whole rows, the whole global batch at once, the token-weighted loss written out."""
    m = model(lora)
    train = [p for p in m.parameters() if p.requires_grad]
    decay = [p for p in train if p.dim() >= 2]
    no_decay = [p for p in train if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS)
    ids, labels, doc_ids = data()
    losses = []
    for s in range(STEPS):
        logits = m(ids[s], doc_ids=doc_ids[s])
        loss = F.cross_entropy(logits.flatten(0, 1), labels[s].flatten(), ignore_index=-100, reduction="sum")
        loss = loss / (labels[s] != -100).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(train, CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in m.named_parameters()}


def _full_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in module.named_parameters():
        t = p.data.full_tensor() if hasattr(p.data, "full_tensor") else p.data
        out[n.replace("_checkpoint_wrapped_module.", "")] = t.float().cpu().clone()
    return out


def _run(sp: int | tuple[int, int], stage: int, micro: int, accum: int, ac: str, tiles: int, lora: bool, *,
         offload: bool = False, quantized: bool = False) -> tuple[list[float], dict]:
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
    from deepshard.core.mesh import local_device
    from deepshard.finetune.models.llama.parallelize import parallelize_llama
    from deepshard.finetune.recipe.steppers import EngineStepper
    from deepshard.offload import CpuStateStore

    zeropp = dict(quantized_weights=True, quantized_gradients=True) if quantized else {}
    config = EngineConfig(zero=ZeroConfig(stage=stage, reduce_bucket_size=3000, allgather_bucket_size=3000, **zeropp),
                          precision=PrecisionConfig(dtype="fp32"),
                          optim=OptimConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, grad_clip=CLIP),
                          grad_accum=accum, ac=ac)
    sp, tp = sp if isinstance(sp, tuple) else (sp, 1)
    mesh = build_mesh(ParallelDims(sp=sp, tp=tp))
    recipe = partial(parallelize_llama, mesh=mesh, zero=config.zero, dtype="fp32", ac=ac)
    factory = CpuStateStore if offload else DeviceStateStore
    engine = initialize(model(lora, tiles).to(local_device()), config, mesh=mesh, parallelize_fn=recipe,
                        store_factory=factory)
    stepper = EngineStepper(engine, grad_accum=accum, device=local_device())
    stepper.prof = types.SimpleNamespace(phase=lambda name: contextlib.nullcontext())
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    ids, labels, doc_ids = data()

    def batches():  # whole rows: the same ones on every sp rank of a dp rank, the stepper slices them
        for s in range(STEPS):
            for m in range(accum):
                lo = (m * dp + dp_rank) * micro
                yield {"input_ids": ids[s, lo:lo + micro], "labels": labels[s, lo:lo + micro],
                       "doc_ids": doc_ids[s, lo:lo + micro]}

    stream = batches()
    losses = [stepper(stream).loss for _ in range(STEPS)]
    engine.gather_params()
    return losses, _full_params(engine.model)


def _worker() -> dict:
    import torch.distributed as dist

    from deepshard.core import init_distributed

    init_distributed()
    world = dist.get_world_size()
    return {name: _run(*layout[1:], offload=name.endswith("offload_cpu"), quantized=name.endswith("quantized"))
            for name, layout in LAYOUTS.items() if layout[0] == world}


@pytest.fixture(scope="module")
def runs(gloo_pool) -> dict[int, list[dict]]:
    return {2: gloo_pool(2).run(_worker), 4: gloo_pool(4).run(_worker)}


@pytest.fixture(scope="module")
def refs() -> dict[bool, tuple]:
    return {False: reference(), True: reference(lora=True)}


def test_data_cross_the_slices_edges():
    """The cases the layouts must get right are in the data: documents and valid labels across the
    sp slices' edges (sp 2 and 4), masked prompts and padding."""
    ids, labels, doc_ids = data()
    for edge in (SEQ // 4, SEQ // 2, 3 * SEQ // 4):
        assert (labels[..., edge - 1] != -100).any()  # the last token of a slice predicts the next slice's first
        assert (doc_ids[..., edge - 1] == doc_ids[..., edge]).any()  # a document spanning the edge
    assert (doc_ids[..., -1] > 0).all() and (labels == -100).float().mean() > 0.2


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sequence_parallel_matches_whole_row_reference(runs, refs, name):
    world, lora = LAYOUTS[name][0], LAYOUTS[name][-1]
    ref_losses, ref_params = refs[lora]
    # ZeRO++: int8 weights in forward and int8 gradient shards, near the reference and not equal (measured:
    # losses within 1.3e-3; parameters within 0.14, Adam's first steps turn the small gradients' changed
    # signs into whole lr-sized steps)
    quantized = name.endswith("quantized")
    loss_tol, param_tol = (1e-2, 0.25) if quantized else (1e-5, 1e-5)
    for rank, result in enumerate(runs[world]):
        losses, params = result[name]
        assert losses == pytest.approx(ref_losses, rel=loss_tol), f"{name} rank {rank}"
        assert params.keys() == ref_params.keys(), name
        worst = max(((params[n] - ref_params[n]).norm() / ref_params[n].norm()).item() for n in params)
        assert worst < param_tol, f"{name} rank {rank}: parameters differ from the reference by {worst:.2e}"
        if quantized:
            assert losses != ref_losses, "the quantized collectives changed nothing"
    if not lora:
        assert ref_losses[-1] < ref_losses[0]  # the reference trains
