"""Issue 16: a DeepSpeed user's loop with ``import deepshard.compat.deepspeed as deepspeed``.

DeepSpeed's documented ZeRO-2 fp16 and ZeRO-3 CPU-offload configs (tests/finetune_app/fixtures),
world 2, a tiny HF LlamaForCausalLM: the losses equal the same loop on deepshard's native API with
a hand-written EngineConfig, and, where the bench extra is installed, real DeepSpeed 0.19's.
fp16 becomes fp32 on this CPU-only host (the one-line notice says so), in all three runs.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.compat.compat_harness import all_loops
from tests.gloo_pool import pool

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None  # find, not import: it prints a banner
CONFIGS = ("ds_zero2_fp16", "ds_zero3_offload")
N_MICRO = 8  # ZeRO-2: train_batch_size 16 = 4 x accumulation 2 x world 2 -> 4 updates; ZeRO-3: 8 updates
_RUNS: dict[str, list[dict[str, list[float]]]] = {}


def runs(name: str) -> list[dict[str, list[float]]]:
    """One 2-rank launch per config runs every loop (a launch costs 10-20 s here)."""
    if name not in _RUNS:
        _RUNS[name] = pool(2).run(all_loops, name, N_MICRO, HAVE_DEEPSPEED)
    return _RUNS[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_compat_loop_equals_native_api(name):
    for rank, out in enumerate(runs(name)):
        assert len(out["compat"]) == N_MICRO
        assert out["compat"] == pytest.approx(out["native"], abs=1e-5), f"rank {rank}"
        assert out["compat"][-1] < out["compat"][0]  # it trains


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_compat_loop_equals_real_deepspeed(name):
    pytest.importorskip("deepspeed")
    for rank, out in enumerate(runs(name)):
        assert out["compat"] == pytest.approx(out["deepspeed"], abs=1e-5), f"rank {rank}"
