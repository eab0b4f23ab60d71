"""Bad offload settings fail before training with the key, the value and what is valid."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from deepshard.core.state_store import DeviceStateStore
from deepshard.core.update_rule import AdamW
from deepshard.offload import (
    AioConfig,
    CpuStateStore,
    NvmeStateStore,
    OffloadConfig,
    make_store_factory,
    validate_aio,
    validate_nvme,
    validate_offload,
)


def nvme(path, **kw) -> OffloadConfig:
    return OffloadConfig(device="nvme", nvme_path=str(path), **kw)


def test_missing_or_unwritable_path(tmp_path):
    with pytest.raises(ValueError, match="nvme_path=None"):
        validate_nvme(OffloadConfig(device="nvme"), 1)
    with pytest.raises(ValueError, match=r"nvme_path='.*nope'.*does not exist"):
        validate_nvme(nvme(tmp_path / "nope"), 1)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        target = ro if not os.access(ro, os.W_OK) else "/proc"  # root ignores modes; /proc takes no files
        with pytest.raises(ValueError, match="nvme_path=.*not writable"):
            validate_nvme(nvme(target), 1)
    finally:
        ro.chmod(0o700)


def test_not_enough_space_names_bytes(tmp_path):
    with pytest.raises(ValueError, match=r"needs 1000000000000000000 bytes .* only \d+ bytes are free"):
        validate_nvme(nvme(tmp_path), 10**18)


def test_buffer_smaller_than_largest_group(tmp_path):
    cfg = nvme(tmp_path, sub_group_size=4096, buffer_size=1024)
    with pytest.raises(ValueError, match=r"buffer_size=1024 .* largest sub-group \(4096 elements"):
        validate_nvme(cfg, 1)
    with pytest.raises(ValueError, match="buffer_size=1024"):  # the store checks its real groups
        NvmeStateStore([torch.zeros(3000)], [0.0], AdamW(), config=cfg)
    store = NvmeStateStore([torch.zeros(1000)], [0.0], AdamW(), config=cfg)  # one group of 1000 fits
    store.close()


def test_offload_needs_zero_stage(tmp_path):
    with pytest.raises(ValueError, match=r"device='cpu'.*ZeRO stage 1, 2 or 3"):
        validate_offload(0, "cpu")
    with pytest.raises(ValueError, match=r"params='cpu'.*stage 3 \(zero.stage is 2\)"):
        validate_offload(2, "cpu", "cpu")
    with pytest.raises(ValueError, match=r"device='disk'.*'none', 'cpu', 'nvme'"):
        validate_offload(1, "disk")
    validate_offload(0, "none")
    validate_offload(3, "nvme", "cpu")


@pytest.mark.parametrize("knob,value,match", [
    ("block_size", 1000, r"aio.block_size=1000 .*multiple of 4096"),
    ("block_size", 0, r"aio.block_size=0 .*>= 1"),
    ("queue_depth", 0, r"aio.queue_depth=0"),
    ("thread_count", -1, r"aio.thread_count=-1"),
    ("single_submit", "yes", r"aio.single_submit='yes' .*true or false"),
    ("overlap_events", 1, r"aio.overlap_events=1"),
])
def test_bad_aio_knobs(tmp_path, knob, value, match):
    aio = dataclasses.replace(AioConfig(), **{knob: value})
    with pytest.raises(ValueError, match=match):
        validate_aio(aio)
    with pytest.raises(ValueError, match=match):  # the factory validates before any store exists
        make_store_factory(nvme(tmp_path, aio=aio), 0, "x")


@pytest.mark.parametrize("key", ["sub_group_size", "buffer_count", "buffer_size"])
def test_bad_sizes(tmp_path, key):
    with pytest.raises(ValueError, match=f"{key}=0"):
        make_store_factory(dataclasses.replace(nvme(tmp_path), **{key: 0}), 0, "x")


def test_factory_picks_store(tmp_path):
    assert make_store_factory(OffloadConfig(), 0, "x") is DeviceStateStore
    assert make_store_factory(OffloadConfig(device="cpu"), 0, "x") is CpuStateStore
    store = make_store_factory(nvme(tmp_path), 3, "run7")([torch.zeros(10)], [0.0], AdamW())
    try:
        assert isinstance(store, NvmeStateStore)
        assert store.dir.parent == tmp_path / "deepshard-run7" / "rank3"
    finally:
        store.close()
    with pytest.raises(ValueError, match="run_id"):
        make_store_factory(nvme(tmp_path), 0, "../x")([torch.zeros(10)], [0.0], AdamW())
