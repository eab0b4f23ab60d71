"""Bounded memory, as a test: confined to a cgroup v1 memory group of limit L, ZeRO-3 with
``offload.params=nvme`` + ``offload.device=nvme`` trains a Llama whose fp32 model states (16 bytes per
parameter) are more than twice L, for 3 steps, with the same losses as the run without offload
outside the group (which itself needs more anonymous memory than L).  World 1: one process, so the
limit is the whole job's.  The offload's host buffers are what the estimator says: the param pool
throughout, and in the forward the deferred AdamW step's buffers beside it (its host figure, the
peak); the backward has given those back, and the process's anonymous memory drops by as much.  Needs root and the memory controller (skipped otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.bench_infinity import cgroup_available, llama_spec, run_worker  # noqa: E402
from deepshard.finetune.models.llama import LlamaConfig  # noqa: E402
from deepshard.finetune.models.memory_plan import largest_unit, offload_buffers  # noqa: E402
from deepshard.offload import OffloadConfig  # noqa: E402

# torch + gloo alone take ~200 MiB of it; the forward also holds the deferred update's buffer_count
# buffers of 16 bytes per element of the largest unit (infinity_store.DeferredStep)
LIMIT = 384 * 2**20
SPEC = {"steps": 3, "model": llama_spec(52, dim=256), "ac": "full", "buffer_count": 2, "param_buffer_count": 3,
        "param_prefetch": 2}
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not cgroup_available(), reason="needs root and the cgroup v1 memory controller")]


@pytest.fixture(scope="module")
def whole_units(tmp_path_factory) -> tuple[dict, Path]:
    """The confined offload run with whole-unit buffers (its own process): both tests read it, the second
    as the reference of its piecewise run.  Also its NVMe folder, which the run must leave empty."""
    nvme = tmp_path_factory.mktemp("nvme")
    return run_worker({**SPEC, "nvme_path": str(nvme), "offload": True}, limit_bytes=LIMIT), nvme


def test_model_states_twice_the_limit_train_in_it(tmp_path, whole_units):
    spec = {**SPEC, "nvme_path": str(tmp_path)}
    confined, nvme = whole_units
    assert confined["ok"], confined.get("stderr_tail")
    assert confined["model_state_bytes"] >= 2 * LIMIT
    assert confined["peak_bytes"] <= LIMIT
    assert not any(nvme.iterdir()), "swap files left behind"
    # measured: the host buffers mapped after the forward (updates owed since step(): the step's
    # buffers held beside the param pool) and after the backward (given back at the first unit's
    # gradient: more units than buffers), and anonymous memory at the same points
    mapped, anon = confined["buffers_mapped"], confined["rss_anon"]
    held = anon["after_forward"] - anon["after_backward"]
    est = offload_buffers(LlamaConfig(**spec["model"]), OffloadConfig(
        device="nvme", params="nvme", param_buffer_count=spec["param_buffer_count"],
        buffer_count=spec["buffer_count"]), world=1)
    # 2 buffers of 16 B per element of a block (the largest unit), 4 regions each rounded up to 4 KiB
    assert 0 <= est.deferred - 2 * 16 * largest_unit(LlamaConfig(**spec["model"])) < 2 * 4 * 4096
    assert mapped["after_forward"] == est.peak, (mapped, est)
    assert mapped["after_backward"] == est.pool, (mapped, est)
    # the forward's checkpointed block inputs (ac=full) are a few MiB beside the 2 x ~11 MiB buffers
    assert 0.9 * est.deferred <= held <= est.deferred + 8 * 2**20, (held, est)
    free = run_worker({**spec, "offload": False}, limit_bytes=None)
    assert free["rss_anon"]["after_backward"] > LIMIT  # the same run without offload would not fit
    assert confined["losses"] == pytest.approx(free["losses"], rel=1e-6)


def test_deferred_step_buffers_follow_the_piece_not_the_unit(tmp_path, whole_units):
    """``offload.sub_group_size`` below a block's shard: the deferred AdamW step streams each unit in
    pieces of that many elements, so its buffers (measured: the host buffers mapped after the forward,
    beside the param pool) are buffer_count x 16 B x the piece, a tenth of a block's here, as the estimate
    says; it trains in the same limit with the losses of the run with whole-unit buffers."""
    piece = 2**16
    spec = {**SPEC, "nvme_path": str(tmp_path)}
    cfg = LlamaConfig(**spec["model"])
    assert largest_unit(cfg) > 10 * piece
    confined = run_worker({**spec, "offload": True, "sub_group_size": piece}, limit_bytes=LIMIT)
    assert confined["ok"], confined.get("stderr_tail")
    est = offload_buffers(cfg, OffloadConfig(device="nvme", params="nvme", param_buffer_count=3, buffer_count=2,
                                             sub_group_size=piece, buffer_size=piece), world=1)
    assert est.deferred == 2 * 16 * piece
    mapped = confined["buffers_mapped"]
    assert mapped["after_forward"] == est.peak, (mapped, est)
    assert mapped["after_backward"] == est.pool, (mapped, est)
    whole, _ = whole_units  # {**spec, "offload": True} in the same limit
    assert whole["ok"], whole.get("stderr_tail")
    assert confined["losses"] == whole["losses"]  # the same arithmetic, bit for bit
