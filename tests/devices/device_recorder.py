"""Test instrumentation: which device every tensor handed to a collective lives on, and who called it.

nccl takes only tensors on the rank's GPU; gloo takes host tensors too, so a CPU-only suite cannot
see the difference by running the code.  These tests run a path with the compute device set to
``meta`` (``deepshard.core.mesh.use_local_device``) over torch's fake process group (one process,
no communication), and a TorchDispatchMode records each ``c10d`` op with the devices of its tensor
arguments and the first frame of our code (packages/ or apps/) that led to it.

The recorder does not replace any collective: the fake backend runs them.  It also lets a meta
tensor be read on the host (``.item()``, ``bool()``) as 0, so code that reads a reduced figure
keeps going; only devices are checked here, never values.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

REPO = Path(__file__).resolve().parents[2]
OURS = (str(REPO / "packages"), str(REPO / "apps"))
TESTS = str(REPO / "tests")
# torch chooses the device of these itself (nccl: the current GPU, set by init_distributed)
OBJECT_COLLECTIVES = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                      "barrier", "monitored_barrier"}


@dataclass(frozen=True)
class Collective:
    op: str  # the c10d op, e.g. "allreduce_"
    devices: tuple[torch.device, ...]
    site: str  # file:line of the nearest frame in packages/ or apps/ (else in tests/)
    by_torch: bool  # an object collective or barrier: its tensors are torch's, on the backend's device

    def __str__(self) -> str:
        return f"{self.site}: {self.op} on {sorted({str(d) for d in self.devices})}"


def _site() -> tuple[str, bool]:
    frame = sys._getframe(2)
    site, test_site, by_torch = "", "", False
    while frame is not None:
        name = frame.f_code.co_filename
        if name.endswith("distributed_c10d.py") and frame.f_code.co_name in OBJECT_COLLECTIVES:
            by_torch = True
        if not site and name.startswith(OURS):
            site = f"{Path(name).relative_to(REPO)}:{frame.f_lineno}"
        if not test_site and name.startswith(TESTS) and not name.endswith("device_recorder.py"):
            test_site = f"{Path(name).relative_to(REPO)}:{frame.f_lineno}"
        frame = frame.f_back
    return site or test_site or "?", by_torch


class CollectiveRecorder(TorchDispatchMode):
    """``with CollectiveRecorder() as rec: ...`` then ``rec.calls`` / ``rec.off_device(device)``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional"):
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            site, by_torch = _site()
            self.calls.append(Collective(func.__name__.split(".")[0], tuple(t.device for t in tensors), site,
                                         by_torch))
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return False if args[0].dtype == torch.bool else 0  # meta has no data: a stand-in value
        return func(*args, **kwargs)

    def ours(self) -> list[Collective]:
        """The collectives whose tensors our code chose (not object collectives / barriers)."""
        return [c for c in self.calls if not c.by_torch]

    def off_device(self, device: torch.device) -> list[str]:
        """Each collective of ours that got a tensor elsewhere than ``device``, with its call site."""
        return [str(c) for c in self.ours() if any(d != device for d in c.devices)]


@contextlib.contextmanager
def fake_world(world_size: int = 2, rank: int = 0) -> Iterator[None]:
    """torch's fake process group: collectives succeed instantly and move no data."""
    assert not dist.is_initialized(), "a process group is already running in this test process"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
