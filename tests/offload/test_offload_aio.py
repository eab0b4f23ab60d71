"""The aio engine moves bytes correctly and each knob changes how I/O is issued."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from deepshard.core.update_rule import AdamW
from deepshard.offload import AioConfig, AioEngine, NvmeStateStore, OffloadConfig, SwapFile, aligned_empty
from deepshard.offload import aio as aio_mod
from deepshard.offload.aio import as_buffer


class Recorder:
    """Wraps the engine's syscall loop: records tasks, chunk sizes and peak concurrency."""

    def __init__(self, monkeypatch, delay: float = 0.0) -> None:
        self.tasks: list[list[int]] = []
        self.active = self.peak = 0
        self.lock = threading.Lock()
        real = aio_mod._run_chunks

        def run(fd, chunks, write):
            with self.lock:
                self.tasks.append([len(v) for v, _ in chunks])
                self.active += 1
                self.peak = max(self.peak, self.active)
            try:
                time.sleep(delay)
                real(fd, chunks, write)
            finally:
                with self.lock:
                    self.active -= 1

        monkeypatch.setattr(aio_mod, "_run_chunks", run)


def round_trip(path, cfg: AioConfig, nbytes: int = 64 * 1024) -> None:
    f = SwapFile(str(path / "f.swp"), nbytes)
    engine = AioEngine(cfg)
    try:
        src, dst = aligned_empty(nbytes), aligned_empty(nbytes)
        src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
        engine.write(f.fd, as_buffer(src), 0).wait()
        engine.read(f.fd, as_buffer(dst), 0).wait()
        assert torch.equal(src, dst)
        assert engine.bytes == {True: nbytes, False: nbytes}
    finally:
        engine.close()
        f.close()


def test_aligned_empty_is_page_aligned():
    for n in (4096, 12288, 1):
        assert aligned_empty(n).data_ptr() % 4096 == 0


@pytest.mark.parametrize("single_submit", [True, False])
def test_block_size_and_single_submit(tmp_path, monkeypatch, single_submit):
    rec = Recorder(monkeypatch)
    round_trip(tmp_path, AioConfig(block_size=8192, thread_count=3, single_submit=single_submit))
    chunks = [c for t in rec.tasks for c in t]
    assert chunks == [8192] * 16  # block_size: 64 KiB in 8 syscalls each way
    if single_submit:
        assert len(rec.tasks) == 16  # one pool task per syscall
    else:
        assert len(rec.tasks) == 6 and all(len(t) == 3 for t in rec.tasks[:2])  # <= thread_count runs


@pytest.mark.parametrize("queue_depth,thread_count,peak", [(2, 4, 2), (8, 4, 4), (8, 1, 1)])
def test_queue_depth_and_thread_count_bound_concurrency(tmp_path, monkeypatch, queue_depth, thread_count, peak):
    rec = Recorder(monkeypatch, delay=0.02)
    round_trip(tmp_path, AioConfig(block_size=4096, queue_depth=queue_depth, thread_count=thread_count,
                                   single_submit=True))
    assert rec.peak == peak


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_events_pipelines_groups(tmp_path, monkeypatch, overlap):
    rec = Recorder(monkeypatch, delay=0.005)
    cfg = OffloadConfig(device="nvme", nvme_path=str(tmp_path), sub_group_size=4096, buffer_size=4096,
                        buffer_count=3, aio=AioConfig(block_size=16384, queue_depth=32, thread_count=8,
                                                      overlap_events=overlap))
    params = [torch.randn(6 * 4096)]
    store = NvmeStateStore(params, [0.0], AdamW(), config=cfg)
    try:
        rec.peak = 0
        store.step([torch.randn(6 * 4096)], lr=1e-3, step=1)
        # a group is 3 one-syscall requests (16 KiB each); overlap keeps two groups in flight
        assert (rec.peak > 3) == overlap
    finally:
        store.close()


def test_io_errors_reach_the_waiter(tmp_path):
    engine = AioEngine(AioConfig(block_size=4096))
    fd = os.open(tmp_path / "ro", os.O_RDONLY | os.O_CREAT, 0o600)
    try:
        req = engine.write(fd, as_buffer(aligned_empty(8192)), 0)
        with pytest.raises(OSError):
            req.wait()
    finally:
        os.close(fd)
        engine.close()
