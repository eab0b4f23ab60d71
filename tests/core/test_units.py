"""Single-process pieces: loss scaler, LR schedules, bucket layout, config validation."""

from __future__ import annotations

import math
import re

import pytest
import torch

from deepshard.core import (
    LossScaleAtMinimum,
    LossScaler,
    LRSchedule,
    PrecisionConfig,
    SchedulerConfig,
    ZeroConfig,
)
from deepshard.core.config import EngineConfig, OptimConfig
from deepshard.core.config_error import ConfigError, named
from deepshard.core.mesh import ParallelDims
from deepshard.core.zero.layout import BucketLayout, group_into_buckets, shard_rows


def test_loss_scaler_follows_deepspeed_hysteresis_and_window():
    s = LossScaler(PrecisionConfig(dtype="fp16", initial_scale_power=4, loss_scale_window=3, hysteresis=2))
    assert s.scale == 16
    s.update(True)  # first overflow only uses up hysteresis
    assert s.scale == 16
    s.update(True)
    assert s.scale == 8
    for _ in range(3):  # DeepSpeed does not count the first clean step after an overflow
        s.update(False)
    assert s.scale == 8
    s.update(False)  # a window of 3 stable steps after that first one: grow
    assert s.scale == 16


def test_loss_scaler_static_and_floor():
    static = LossScaler(PrecisionConfig(dtype="fp16", loss_scale=128))
    static.update(True)
    assert static.scale == 128
    floor = LossScaler(PrecisionConfig(dtype="fp16", initial_scale_power=1, hysteresis=1, min_loss_scale=1,
                                       raise_error_at_min_scale=False))
    for _ in range(3):
        floor.update(True)
    assert floor.scale == 1
    at_min = LossScaler(PrecisionConfig(dtype="fp16", initial_scale_power=1, hysteresis=1, min_loss_scale=1))
    at_min.update(True)  # 2 -> 1
    with pytest.raises(LossScaleAtMinimum, match="precision.min_loss_scale=1"):
        at_min.update(True)  # DeepSpeed's default raise_error_at_min_scale
    assert LossScaler(PrecisionConfig(dtype="bf16")).scale == 1.0


def test_schedules_match_deepspeed_formulas():
    """Update k runs at DeepSpeed's rate for iteration k-1 (its engine steps the scheduler after the
    update); before its first step DeepSpeed's WarmupLR sits at warmup_min_lr, its cosine at ratio 0."""
    warm = LRSchedule(SchedulerConfig("WarmupLR", warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10), 1.0)
    assert warm.lr_at(0) == 0.0 and warm.lr_at(1) == 0.0 and warm.lr_at(6) == 0.5
    assert warm.lr_at(10) == pytest.approx(0.9) and warm.lr_at(11) == 1.0 and warm.lr_at(99) == 1.0
    log = LRSchedule(SchedulerConfig("WarmupLR", warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="log"), 1.0)
    assert log.lr_at(5) == pytest.approx(math.log(5) / math.log(10))
    decay = LRSchedule(SchedulerConfig("WarmupDecayLR", warmup_max_lr=1.0, warmup_num_steps=10,
                                       total_num_steps=20), 1.0)
    assert decay.lr_at(16) == pytest.approx(0.5) and decay.lr_at(21) == 0.0
    cos = LRSchedule(SchedulerConfig("WarmupCosineLR", warmup_num_steps=10, total_num_steps=110,
                                     cos_min_ratio=0.0), 2.0)
    assert cos.lr_at(0) == 0.0 and cos.lr_at(6) == pytest.approx(1.0) and cos.lr_at(60) == pytest.approx(1.0)
    assert cos.lr_at(110) == pytest.approx(0.0, abs=1e-12)
    short = LRSchedule(SchedulerConfig("WarmupLR", warmup_max_lr=1.0, warmup_num_steps=1), 1.0)
    assert [short.lr_at(k) for k in range(4)] == [0.0, 0.0, 0.5, 1.0]  # DeepSpeed: max(2, warmup_num_steps)
    none = LRSchedule(SchedulerConfig("WarmupDecayLR", warmup_max_lr=1.0, warmup_num_steps=0, total_num_steps=4), 1.0)
    assert [none.lr_at(k) for k in range(6)] == [1.0, 1.0, 0.75, 0.5, 0.25, 0.0]  # 0: no warm-up at all


@pytest.mark.parametrize("rows,world", [(7, 2), (5, 4), (1, 4), (12, 3)])
def test_bucket_layout_round_trip(rows, world):
    tensors = [torch.randn(rows, 3), torch.randn(rows + 1), torch.randn(2, 2)]
    layout = BucketLayout([0, 1, 2], [t.shape for t in tensors], world)
    buf = torch.empty(world * layout.segment)
    layout.pack_full(tensors, buf)
    out = [torch.zeros_like(t) for t in tensors]
    layout.unpack_full(buf, out)
    assert all(torch.equal(a, b) for a, b in zip(tensors, out))
    # rank r's segment holds exactly its Shard(0) chunks
    for r in range(world):
        seg = buf.view(world, layout.segment)[r]
        for slot, t in zip(layout.slots, tensors):
            start, end = shard_rows(t.shape[0], world, r)
            chunk = t[start:end].reshape(-1)
            assert torch.equal(seg[slot.offset:slot.offset + chunk.numel()], chunk)


def test_buckets_respect_size_and_dtype():
    assert group_into_buckets([4, 4, 4, 4], [torch.float32] * 4, 8) == [[0, 1], [2, 3]]
    assert group_into_buckets([1, 1], [torch.float32, torch.bfloat16], 8) == [[0], [1]]


@pytest.mark.parametrize("make,key", [
    (lambda: ZeroConfig(stage=4), "stage=4"),
    (lambda: ZeroConfig(reduce_bucket_size=-1), "reduce_bucket_size=-1"),
    (lambda: SchedulerConfig(name="OneCycle"), "name='OneCycle'"),
    (lambda: SchedulerConfig(name="WarmupDecayLR", warmup_num_steps=5, total_num_steps=5), "total_num_steps=5"),
    (lambda: PrecisionConfig(dtype="fp8"), "dtype='fp8'"),
    (lambda: OptimConfig(lr=0), "lr=0"),
    (lambda: EngineConfig(grad_accum=0), "grad_accum=0"),
    (lambda: EngineConfig(ac="some"), "ac='some'"),
])
def test_core_configs_name_their_own_fields(make, key):
    """Core knows its fields, not the user's keys: the caller (app, compat) puts its key in front."""
    with pytest.raises(ConfigError, match="^" + re.escape(key) + ": "):
        make()


def test_a_config_error_goes_under_the_callers_key():
    with pytest.raises(ValueError, match=r"^zero\.stage=4: valid stages"), named("zero"):
        ZeroConfig(stage=4)
    with pytest.raises(ValueError, match=r"^zero_optimization\.stage=4: "), named(lambda f: f"zero_optimization.{f}"):
        ZeroConfig(stage=4)


@pytest.mark.parametrize("make,key", [
    (lambda: ParallelDims(pp=3).resolve(4), "parallel.pp"),
    (lambda: ParallelDims(pp=2, dp=3, tp=1).resolve(4), "parallel.dp"),
])
def test_bad_layout_names_the_keys(make, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        make()
