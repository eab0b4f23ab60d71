"""``compile=true`` trains what eager trains: one world-2 launch (the session's gloo pool) runs each
case twice through the Llama recipe, eager and with every block compiled, on masked rows whose
length changes between steps, and compares the losses and the parameters after 5 steps (fp32, 1e-5).
The same launch counts, per block, that the compiled forward ran, that dynamo handed inductor at
least one graph and broke none (fullgraph), and that 4 sequence lengths cost at most 2 graphs per
block code (automatic dynamic shapes: the first length static, then one symbolic graph).

Cases: ZeRO-0, ZeRO-3 (FSDP2's hooks around the compiled blocks), ZeRO-3 with AC (the checkpoint
traced into the graph), ZeRO-3 with LoRA (frozen base, adapters trained).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

STEPS = 5
LENGTHS = (16, 16, 24, 20, 12)  # one per step: variable-length data
ROWS = 4
CASES = {"zero0": (0, "none", False), "zero3": (3, "none", False), "zero3_ac": (3, "full", False),
         "zero3_lora": (3, "none", True)}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Chat-like rows: a masked prompt, some rows ending in padding (labels -100)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for length in LENGTHS:
        ids = torch.randint(0, 96, (ROWS, length), generator=g)
        labels = ids.roll(-1, dims=1)
        labels[:, :3] = -100
        labels[1, length - 4:] = -100
        out.append((ids, labels))
    return out


def _train(stage: int, ac: str, lora: bool, compile: bool) -> dict:
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
    from deepshard.finetune.models.llama.model import Llama, LlamaConfig
    from deepshard.finetune.models.llama.parallelize import parallelize_llama
    from deepshard.finetune.models.lora import apply_lora

    cfg = LlamaConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=32)
    model = Llama(cfg)
    model.init_weights(0)
    if lora:
        apply_lora(model, r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"), seed=3)
        with torch.no_grad():  # B non-zero, so both factors train
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    config = EngineConfig(zero=ZeroConfig(stage=stage), precision=PrecisionConfig(dtype="fp32"),
                          optim=OptimConfig(lr=3e-3, weight_decay=0.1), ac=ac, compile=compile)
    mesh = build_mesh(ParallelDims(dp=2))
    recipe = partial(parallelize_llama, mesh=mesh, zero=config.zero, dtype="fp32", ac=ac, compile=compile)
    engine = initialize(model, config, mesh=mesh, parallelize_fn=recipe)
    rank = dist.get_rank()
    losses = []
    for ids, labels in _batches():
        x, y = ids[rank * 2:(rank + 1) * 2], labels[rank * 2:(rank + 1) * 2]
        num_items = engine.global_num_items((y != -100).sum())
        loss = engine(x, y, reduction="sum")
        engine.backward(loss, num_items=num_items)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / num_items.item())
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in engine.model.named_parameters()}
    calls = [getattr(b.__dict__.get("forward"), "calls", 0) for b in engine.model.layers]  # compiled forwards' calls
    return {"losses": losses, "params": params, "calls": calls}


def _cases(cache_dir: str) -> dict:
    import os

    import torch._dynamo

    from deepshard.core import compile as ds_compile
    from deepshard.core import init_distributed

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # the pool puts the environment back after the call
    dynamo = torch._dynamo.config
    saved = {k: getattr(dynamo, k) for k in ("recompile_limit", "fail_on_recompile_limit_hit", "automatic_dynamic_shapes")}
    init_distributed()
    out = {}
    try:
        for name, (stage, ac, lora) in CASES.items():
            torch._dynamo.reset()  # each case's graphs counted from nothing
            ds_compile._STATS.__init__()
            eager = _train(stage, ac, lora, compile=False)
            compiled = _train(stage, ac, lora, compile=True)
            stats = ds_compile.compile_stats()
            out[name] = {"eager": eager, "compiled": compiled, "graphs": stats.graphs,
                         "breaks": stats.graph_breaks()}
    finally:
        torch._dynamo.reset()
        for k, v in saved.items():
            setattr(dynamo, k, v)
        ds_compile._CONFIGURED.clear()
    return out


@pytest.fixture(scope="module")
def results(gloo_pool, inductor_cache):
    return gloo_pool(2).run(_cases, inductor_cache, timeout_s=600)


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_blocks_train_as_eager(results, case):
    for rank, res in enumerate(results):
        r = res[case]
        eager, compiled = r["eager"], r["compiled"]
        assert compiled["losses"] == pytest.approx(eager["losses"], abs=1e-5), (case, rank)
        assert eager["losses"][0] != eager["losses"][-1]  # it trained
        for name, p in eager["params"].items():
            assert torch.allclose(compiled["params"][name], p, atol=1e-5, rtol=0), (case, rank, name)


@pytest.mark.parametrize("case", list(CASES))
def test_every_block_ran_compiled_in_one_graph_each_length_bounded(results, case):
    for res in results:
        r = res[case]
        assert r["compiled"]["calls"] == [STEPS, STEPS]
        assert r["eager"]["calls"] == [0, 0]
        assert r["breaks"] == 0
        # 4 distinct lengths, 2 blocks sharing one code: one static graph, then one symbolic one
        assert 1 <= r["graphs"] <= 2, r["graphs"]
