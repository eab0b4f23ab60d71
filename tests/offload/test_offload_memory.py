"""offload's ``memory.host_buffers`` states what the stores allocate, from the functions they allocate
with: held here against a live NVMe store's buffers (the bytes its state buffers hold) and against
the arithmetic the app's estimate wrote before the function moved into offload (issue 47)."""

from __future__ import annotations

import torch

from deepshard.core.update_rule import AdamW
from deepshard.offload import AioConfig, NvmeStateStore, OffloadConfig
from deepshard.offload.memory import host_buffers, unit_numel

ADAMW = AdamW(betas=(0.9, 0.95), eps=1e-8)


def _align(n: int) -> int:
    return -(-n // 4096) * 4096


def test_nvme_store_buffers_as_allocated(tmp_path):
    cfg = OffloadConfig(device="nvme", nvme_path=str(tmp_path), sub_group_size=4096, buffer_size=4096,
                        buffer_count=3, aio=AioConfig(block_size=4096))
    store = NvmeStateStore([torch.randn(4096 * 5)], [0.0], ADAMW, config=cfg)
    try:
        held = sum(b.raw.numel() for b in store._buffers)
    finally:
        store.close()
    assert host_buffers(cfg, state_numel=4096 * 5).peak == held == 3 * 4 * 4096 * 4


def test_infinity_buffers_by_the_old_formula():
    """Pool: param_buffer_count x the largest gathered unit; deferred: min(buffer_count, pieces) x four
    regions of a piece (sub_group_size rounded down to 1024, at most the largest unit rounded up)."""
    units = [1_000_003, 2_500_000, 2_500_000]
    cfg = OffloadConfig(device="nvme", params="nvme", sub_group_size=2**20 + 5, buffer_count=2,
                        param_buffer_count=3)
    got = host_buffers(cfg, state_numel=0, units=units, gathered=units[1:], tile_rows=100, tile_width=64, world=2)
    piece = 2**20
    assert got.pool == 3 * _align(2_500_000 * 4)
    assert got.deferred == 2 * 4 * _align(piece * 4)
    assert got.tiles == 2 * (_align(4 * 50 * 64) + 4096)
    assert got.peak == got.pool + got.deferred + got.tiles and got.store == 0
    assert host_buffers(OffloadConfig(device="cpu"), state_numel=10**6).peak == 0


def test_unit_numel_pads_rows_to_the_world_and_starts_shards_on_16():
    # a [5, 3] weight at world 2: 3 rows x 3 a rank = 9 elements, then a [7] bias from 16: 4 -> 20
    assert unit_numel([(5, 15), (7, 7)], 2) == 16 + 4


def test_deferred_buffers_are_forward_only_unless_they_outnumber_the_pieces():
    """``DeferredStep`` frees its buffers at the backward's first gradient, unless ``buffer_count >= pieces``
    (resident: kept through the run); the working set weighs only the former against backward's units."""
    units = [3 * 2**20, 3 * 2**20]
    cfg = OffloadConfig(device="nvme", params="nvme", sub_group_size=2**20, buffer_size=2**20, buffer_count=2)
    freed = host_buffers(cfg, state_numel=0, units=units, gathered=units)  # 6 pieces, 2 buffers
    assert not freed.resident and freed.forward_only == freed.deferred == 2 * 4 * _align(2**20 * 4)
    kept = host_buffers(OffloadConfig(device="nvme", params="nvme", sub_group_size=2**20, buffer_size=2**20,
                                      buffer_count=6), state_numel=0, units=units, gathered=units)
    assert kept.resident and kept.forward_only == 0 and kept.deferred == 6 * 4 * _align(2**20 * 4)
