"""Devices on the checkpoint paths, checked on CPU with torch's fake process group and a ``meta``
compute device standing in for a GPU: the preemption flag reaches its all-reduce on the compute
device (nccl takes nothing else), and offloaded (host) optimizer state is checkpointed where it
lives instead of being copied to the compute device by DTensor.from_local."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from deepshard.core.checkpoint.state import training_state
from deepshard.core.update_rule import AdamW
from deepshard.finetune.recipe.checkpointing import Preemption


class CollectiveDevices(TorchDispatchMode):
    """Records the device of every tensor that reaches a c10d collective; ``.item()`` on meta is 0."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d" and "barrier" not in str(func):
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor):
                    self.seen.append((str(func), t.device.type))
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            return 0
        return func(*args, **kwargs)


@pytest.fixture
def fake_world2():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_preemption_flag_is_reduced_on_the_compute_device(fake_world2):
    preemption = Preemption(torch.device("meta"))
    try:
        with CollectiveDevices() as spy:
            assert preemption.agreed() is False
    finally:
        preemption.restore()
    assert spy.seen and all(dev == "meta" for _, dev in spy.seen), spy.seen


def _optimizer(stage: int, params, store_state):
    return SimpleNamespace(stage=SimpleNamespace(zero_stage=stage, names=[f"w{i}" for i in range(len(params))],
                                                 params=params),
                           store=SimpleNamespace(state_dict=lambda: store_state, rule=AdamW()))


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_host_state_is_checkpointed_in_host_memory(fake_world2, stage):
    mesh = DeviceMesh("meta", torch.arange(2), mesh_dim_names=("dp",), _init_backend=False)  # the "GPU" mesh
    full = [torch.Size([6, 4]), torch.Size([5])]
    if stage == 3:  # FSDP2 params are DTensors on the compute mesh
        params = [DTensor.from_local(torch.empty(s[0] // 2 + s[0] % 2, *s[1:], device="meta"), mesh, [Shard(0)],
                                     run_check=False, shape=s, stride=torch.empty(s, device="meta").stride())
                  for s in full]
    else:
        params = [torch.empty(s, device="meta") for s in full]
    local = [(6 if stage == 0 else 3, 4), (5 if stage == 0 else 3,)]
    store_state = {k: [torch.randn(shape) for shape in local] for k in ("master", "exp_avg", "exp_avg_sq")}
    state = training_state(_optimizer(stage, params, store_state), mesh)
    for i in range(2):
        for kind, prefix in (("master", "model."), ("exp_avg", "optim.exp_avg."), ("exp_avg_sq", "optim.exp_avg_sq.")):
            d = state[f"{prefix}w{i}"]
            assert isinstance(d, DTensor) and d.shape == full[i]
            assert d.to_local().device.type == "cpu"
            assert d.to_local().data_ptr() == store_state[kind][i].data_ptr()  # a view: no copy at all
