"""Per-rank model-state bytes at world size 4 (fp32 and bf16) within 10% of the ZeRO formula."""

from __future__ import annotations

from deepshard.finetune.models.llama import LlamaConfig
from deepshard.launch.local import launch_local
from tests.core.zero_harness import build_model, engine_config

# large enough that Shard(0) padding and the per-parameter rounding stay small
CFG = LlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=160, max_seq_len=32)


def _worker():
    import torch

    from deepshard.core import init_distributed, initialize
    from deepshard.core.mesh import local_device

    init_distributed()
    out = {}
    for dtype in ("fp32", "bf16"):
        for stage in (0, 1, 2, 3):
            engine = initialize(build_model(CFG).to(local_device()), engine_config(stage, dtype=dtype, bucket=20_000))
            tokens = torch.randint(0, CFG.vocab_size, (2, 17), device=local_device())
            engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
            mem = engine.memory()
            out[(dtype, stage)] = (mem["measured"].as_dict(), mem["expected"].as_dict())
            engine.step()
    return out


def test_memory_world4():
    results = launch_local(_worker, 4)
    for rank, res in enumerate(results):
        for (dtype, stage), (measured, expected) in res.items():
            for key in ("params", "grads", "optimizer", "total"):
                assert abs(measured[key] - expected[key]) <= 0.1 * expected[key], (rank, dtype, stage, key,
                                                                                   measured, expected)
    # the stages really differ: stage 3 holds less than a quarter of stage 0
    totals = {s: results[0][("fp32", s)][0]["total"] for s in range(4)}
    assert totals[3] < totals[2] < totals[1] < totals[0]
    assert totals[3] < 0.3 * totals[0]
