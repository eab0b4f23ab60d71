"""Typed offload configuration and the checks that run before training starts.

Bad values fail here with a ValueError naming the config key, the value and what is valid, so a
run never discovers a full disk or a too-small buffer hours into training.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field

ALIGN = 4096  # O_DIRECT alignment of addresses, lengths and offsets (portable choice)


@dataclass(frozen=True)
class AioConfig:
    """DeepSpeed's aio knobs, as our ThreadPoolExecutor + preadv/pwritev engine applies them.

    - ``block_size``: bytes per preadv/pwritev syscall; a request is cut into chunks of this size.
    - ``queue_depth``: most submissions handed to the thread pool and not yet finished; further
      chunks wait in the engine's software queue (never blocking the submitting thread).
    - ``thread_count``: worker threads, i.e. syscalls that can run in parallel.
    - ``single_submit``: True submits every chunk as its own pool task (one syscall each, chunks of
      different requests interleave); False submits each request as at most ``thread_count``
      tasks that each issue a contiguous run of chunks (fewer submissions, sequential per thread).
    - ``overlap_events``: True pipelines the optimizer step (read group i+1 and write group i-1
      while group i is stepped); False waits for every read and write as soon as it is issued.
    """

    block_size: int = 8 * 2**20
    queue_depth: int = 8
    thread_count: int = 2
    single_submit: bool = False
    overlap_events: bool = True


@dataclass(frozen=True)
class OffloadConfig:
    """Where optimizer state lives (``device``) and how NVMe swapping is staged.

    ``sub_group_size`` and ``buffer_size`` count elements (of each of master, exp_avg, exp_avg_sq);
    one pool buffer holds one sub-group of all three plus its fp32 gradient, so ``buffer_size``
    caps the largest sub-group (buffers are allocated at the largest group's size, 16 bytes per
    element, ``buffer_count`` of them).  ``params`` is the ZeRO-3 parameter-offload switch
    (validated here, applied by core's ``initialize(offload_params=...)``): ``cpu`` rests the
    sharded params in host memory, ``nvme`` (needs ``device='nvme'``) in swap files beside the
    optimizer state (ZeRO-Infinity, :mod:`deepshard.offload.param_swap`); there the deferred AdamW
    update streams each unit through ``buffer_count`` buffers in pieces of
    ``min(sub_group_size, buffer_size)`` elements (rounded down to 1024, at least 1024), so its
    buffers (16 bytes per element) follow the piece, not the largest unit
    (:mod:`deepshard.offload.deferred_step`).

    Parameter swap (``params='nvme'``), DeepSpeed's ``offload_param`` keys: each FSDP unit (a
    block, or the root's embeddings + head) is read from NVMe into one of ``param_buffer_count``
    aligned buffers of ``param_buffer_size`` elements (>= the largest unit's shard) before its
    all-gather, ``param_prefetch`` units ahead of use (forward order, reversed in backward);
    ``max_in_cpu`` elements of used shards may stay resident instead of being re-read (0: every
    shard is released right after its all-gather).
    """

    device: str = "none"
    nvme_path: str | None = None
    params: str = "none"
    sub_group_size: int = 2**24
    buffer_count: int = 3
    buffer_size: int = 2**24
    param_prefetch: int = 2
    param_buffer_count: int = 4
    param_buffer_size: int = 2**24
    max_in_cpu: int = 0
    aio: AioConfig = field(default_factory=AioConfig)


def _bad(key: str, value: object, valid: str) -> ValueError:
    return ValueError(f"offload.{key}={value!r} is invalid; {valid}")


def _positive_int(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(key, value, "expected an integer >= 1")


def validate_aio(aio: AioConfig) -> None:
    """Reject aio knobs the engine cannot honour (block_size must keep O_DIRECT alignment)."""
    _positive_int("aio.block_size", aio.block_size)
    if aio.block_size % ALIGN:
        raise _bad("aio.block_size", aio.block_size, f"expected a positive multiple of {ALIGN} bytes")
    _positive_int("aio.queue_depth", aio.queue_depth)
    _positive_int("aio.thread_count", aio.thread_count)
    for key in ("single_submit", "overlap_events"):
        if not isinstance(getattr(aio, key), bool):
            raise _bad(f"aio.{key}", getattr(aio, key), "expected true or false")


def _check_choices(device: str, params: str) -> None:
    """The values ``device`` and ``params`` may take, and how they combine (no stage needed)."""
    if device not in ("none", "cpu", "nvme"):
        raise _bad("device", device, "expected one of 'none', 'cpu', 'nvme'")
    if params not in ("none", "cpu", "nvme"):
        raise _bad("params", params, "expected one of 'none', 'cpu', 'nvme'")
    if params == "nvme" and device != "nvme":
        raise _bad("params", params, f"parameter swap to NVMe needs the optimizer state there too: "
                                     f"offload.device='nvme' (+offload=nvme), got offload.device={device!r}")


def validate_offload(stage: int, device: str, params: str = "none") -> None:
    """Offload needs sharded optimizer state (ZeRO >= 1); parameter offload needs ZeRO-3."""
    _check_choices(device, params)
    if device != "none" and stage == 0:
        raise _bad("device", device, "optimizer offload needs ZeRO stage 1, 2 or 3 (zero.stage is 0)")
    if params != "none" and stage != 3:
        raise _bad("params", params, f"parameter offload needs ZeRO stage 3 (zero.stage is {stage})")


def validate_config(config: OffloadConfig) -> None:
    """Checks that need no knowledge of the model: value ranges, aio knobs, the nvme_path.

    Every value's range is checked whatever the device: one that only NVMe reads (``buffer_count``
    under ``device='cpu'``) is still a mistake, and would otherwise surface the day the run moves to
    NVMe.  The stage-dependent checks (offload needs ZeRO >= 1, params ZeRO-3) are the caller's
    :func:`validate_offload`, which knows the stage."""
    _check_choices(config.device, config.params)
    for key in ("sub_group_size", "buffer_count", "buffer_size", "param_buffer_count", "param_buffer_size"):
        _positive_int(key, getattr(config, key))
    if isinstance(config.param_prefetch, bool) or not isinstance(config.param_prefetch, int) \
            or config.param_prefetch < 0:
        raise _bad("param_prefetch", config.param_prefetch, "expected an integer >= 0 (units read ahead)")
    if isinstance(config.max_in_cpu, bool) or not isinstance(config.max_in_cpu, int) or config.max_in_cpu < 0:
        raise _bad("max_in_cpu", config.max_in_cpu, "expected an integer >= 0 (elements)")
    validate_aio(config.aio)
    if config.params == "nvme" and config.param_prefetch >= config.param_buffer_count:
        raise _bad("param_prefetch", config.param_prefetch,
                   f"must be < param_buffer_count={config.param_buffer_count} (one buffer per unit read "
                   "ahead, one for the unit in use)")
    if config.device != "nvme":
        return
    path = config.nvme_path
    if not path:
        raise _bad("nvme_path", path, "device='nvme' needs a directory on a local disk")
    if not os.path.isdir(path):
        raise _bad("nvme_path", path, "the directory does not exist")
    try:  # a real create catches read-only mounts too (os.access does not, and root passes it)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise _bad("nvme_path", path, f"the directory is not writable ({e.strerror})") from e


def validate_param_swap(config: OffloadConfig, bytes_needed: int, largest_unit: int, largest_unit_name: str) -> None:
    """Before a parameter swap starts: pool buffers hold the largest unit; the disk holds it all.

    ``bytes_needed`` covers params, gradients and both Adam moments (16 bytes per element);
    ``largest_unit`` is the largest gathered FSDP unit's shard in elements (a tiled embedding or
    head is read in rows, never whole), ``largest_unit_name`` names it.  ``buffer_size`` needs no
    check here: it caps the deferred update's pieces.
    """
    validate_config(config)
    if config.param_buffer_size < largest_unit:
        raise _bad("param_buffer_size", config.param_buffer_size,
                   f"must be >= the largest block shard ({largest_unit} elements, {largest_unit_name!r}): "
                   "one buffer holds one block's shard")
    free = shutil.disk_usage(config.nvme_path).free
    if bytes_needed > free:
        raise _bad("nvme_path", config.nvme_path,
                   f"needs {bytes_needed} bytes of swap space (params + grads + optimizer state) but only "
                   f"{free} bytes are free")


def validate_nvme(config: OffloadConfig, bytes_needed: int, largest_group: int | None = None) -> None:
    """Everything :func:`validate_config` checks, plus free space and the buffer size for a model.

    ``bytes_needed`` is the swap-file size this store will allocate; ``largest_group`` is the
    largest sub-group in elements (defaults to ``sub_group_size``).
    """
    validate_config(config)
    largest = config.sub_group_size if largest_group is None else largest_group
    if config.buffer_size < largest:
        raise _bad("buffer_size", config.buffer_size,
                   f"must be >= the largest sub-group ({largest} elements; see sub_group_size)")
    free = shutil.disk_usage(config.nvme_path).free
    if bytes_needed > free:
        raise _bad("nvme_path", config.nvme_path,
                   f"needs {bytes_needed} bytes of swap space but only {free} bytes are free")
