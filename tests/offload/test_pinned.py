"""Exact-size host buffers: sizes, alignment, the CPU fallback, and when pinning is undone.

The reference for "how much memory backs a buffer" is the kernel's own record, /proc/self/maps;
the caching host allocator it replaces would have used the next power of two (512 MiB for
256 MiB + 4 KiB).  cudaHostRegister itself needs a GPU: here its two calls are recorded to show
each buffer is registered once at its exact size and unregistered once, after its last view dies.
"""

from __future__ import annotations

import gc

import pytest
import torch

from deepshard.core.update_rule import AdamW
from deepshard.offload import CpuStateStore, NvmeStateStore, OffloadConfig, pinned
from deepshard.offload.aio import as_buffer
from deepshard.offload.pinned import host_buffer_stats, page_round, pinned_empty, pinned_tensor

MIB = 2**20


def mapping_size(ptr: int) -> int:
    """Bytes of the /proc/self/maps entry that contains ``ptr``."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return hi - lo
    raise AssertionError(f"{ptr:#x} is not mapped")


def delta(before: dict[str, int]) -> dict[str, int]:
    now = host_buffer_stats()
    return {k: now[k] - before[k] for k in now}


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 12289, 256 * MIB + 4096])
def test_exact_page_rounded_size_and_alignment(nbytes):
    gc.collect()
    before = host_buffer_stats()
    t = pinned_empty(nbytes, pin=False)
    assert t.dtype == torch.uint8 and t.numel() == nbytes
    assert t.data_ptr() % 4096 == 0
    # the kernel may merge the mapping with a neighbour, never make it smaller than ours
    assert mapping_size(t.data_ptr()) >= page_round(nbytes)
    assert delta(before) == {"mapped_bytes": page_round(nbytes), "pinned_bytes": 0, "buffers": 1}
    if nbytes == 256 * MIB + 4096:
        assert page_round(nbytes) == 256 * MIB + 4096  # not the allocator's 512 MiB
    del t
    gc.collect()
    assert delta(before) == {"mapped_bytes": 0, "pinned_bytes": 0, "buffers": 0}


def test_default_pins_only_where_cuda_is_and_the_buffer_is_usable():
    cuda = torch.cuda.is_available()  # CPU-only host: the unpinned fallback; GPU host: registered
    before = host_buffer_stats()
    t = pinned_empty(10000)  # pin=None: CUDA decides
    assert delta(before)["pinned_bytes"] == (page_round(10000) if cuda else 0)
    assert t.is_pinned() == cuda
    t.fill_(7)
    assert bytes(as_buffer(t)[:3]) == b"\x07\x07\x07"
    f = pinned_tensor(1001, torch.bfloat16)
    assert f.dtype == torch.bfloat16 and f.numel() == 1001 and f.data_ptr() % 4096 == 0
    assert pinned_empty(0).numel() == 0


def test_register_once_at_exact_size_unregister_after_last_view(monkeypatch):
    calls: list[tuple] = []
    monkeypatch.setattr(pinned, "_register", lambda ptr, n: calls.append(("register", ptr, n)))
    monkeypatch.setattr(pinned, "_unregister", lambda ptr: calls.append(("unregister", ptr)))
    gc.collect()
    before = host_buffer_stats()
    nbytes = 3 * 4096 + 5
    t = pinned_empty(nbytes, pin=True)
    ptr = t.data_ptr()
    assert calls == [("register", ptr, page_round(nbytes))]
    assert delta(before)["pinned_bytes"] == page_round(nbytes)
    views = [t[4096:].view(torch.uint8), t[:8]]
    del t
    gc.collect()
    assert len(calls) == 1  # views still alive: the memory stays registered
    views.pop()
    gc.collect()
    assert len(calls) == 1
    views.clear()
    gc.collect()
    assert calls == [("register", ptr, page_round(nbytes)), ("unregister", ptr)]
    assert delta(before) == {"mapped_bytes": 0, "pinned_bytes": 0, "buffers": 0}


def test_failed_registration_raises_and_leaks_nothing(monkeypatch):
    unregistered: list[int] = []

    def refuse(ptr: int, n: int) -> None:
        raise RuntimeError(f"offload: cudaHostRegister of {n} bytes of host memory failed")

    monkeypatch.setattr(pinned, "_register", refuse)
    monkeypatch.setattr(pinned, "_unregister", unregistered.append)
    gc.collect()
    before = host_buffer_stats()
    with pytest.raises(RuntimeError, match="cudaHostRegister of 8192 bytes"):
        pinned_empty(8192, pin=True)
    gc.collect()
    assert unregistered == [] and delta(before) == {"mapped_bytes": 0, "pinned_bytes": 0, "buffers": 0}


ADAMW = AdamW(betas=(0.9, 0.95), eps=1e-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_store_flat_buffers_at_exact_size(dtype):
    """One buffer per state (+ grad, + master unless fp32 host params are their own masters),
    each the page-rounded state size: 4 * (2**20 + 1024) bytes, where the caching allocator
    would have pinned 8 MiB apiece."""
    numel = 2**20 + 1024
    params = [torch.zeros(numel - 1000, dtype=dtype), torch.zeros(1000, dtype=dtype)]
    gc.collect()
    before = host_buffer_stats()
    store = CpuStateStore(params, [0.0, 0.0], ADAMW)
    num_buffers = 3 if dtype == torch.float32 else 4
    assert delta(before)["buffers"] == num_buffers
    assert delta(before)["mapped_bytes"] == num_buffers * page_round(4 * numel) < num_buffers * 8 * MIB
    store.close()
    del store
    gc.collect()
    assert delta(before)["mapped_bytes"] == 0


def test_nvme_buffers_at_exact_size(tmp_path):
    numel = 2**18 + 16  # one group: 4 regions of align_up(4 * numel) bytes per buffer
    cfg = OffloadConfig(device="nvme", nvme_path=str(tmp_path), sub_group_size=numel, buffer_size=numel,
                        buffer_count=2)
    gc.collect()
    before = host_buffer_stats()
    store = NvmeStateStore([torch.zeros(numel)], [0.0], ADAMW, config=cfg)
    try:
        assert delta(before)["mapped_bytes"] == page_round(4 * page_round(4 * numel))  # 1 group: 1 buffer
    finally:
        store.close()
    gc.collect()
    assert delta(before)["mapped_bytes"] == 0
