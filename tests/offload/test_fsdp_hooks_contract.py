"""The torch-private names offload.fsdp_hooks relies on still exist, with the signatures it calls.

The parameter swap hooks FSDP2 where torch offers no public hook.  When a torch upgrade renames or
reshapes one of those internals, these tests fail naming the private attribute that moved, before
any training run trips over it.  One process, torch's fake process group: no launch.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

from deepshard.offload import fsdp_hooks
from tests.devices.device_recorder import fake_world


def _moved(owner: str, name: str, why: str) -> str:
    return f"torch {torch.__version__}: {owner}.{name} {why}: deepshard.offload.fsdp_hooks needs updating"


def _need(obj: object, owner: str, name: str) -> object:
    assert hasattr(obj, name), _moved(owner, name, "is gone")
    return getattr(obj, name)


def _params_of(fn: object) -> list[inspect.Parameter]:
    return list(inspect.signature(fn).parameters.values())


@pytest.fixture(scope="module")
def unit():
    """A two-block model under fully_shard in a 1-rank fake world: (the root, one block)."""
    with fake_world(world_size=1):
        mesh = init_device_mesh("cpu", (1,))
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        yield model, model[0]


def test_every_private_owner_is_checked():
    """A name added to PRIVATE without a check here fails this test (the owners below are checked)."""
    checked = {"torch.distributed.fsdp._fully_shard._fsdp_common", "FSDPModule", "FSDPState", "FSDPParamGroup",
               "FSDPParam", "torch.autograd", "torch.UntypedStorage", "DTensor", "torch._ops.OpOverload", "torch"}
    assert set(fsdp_hooks.PRIVATE) == checked


def test_fsdp_state_and_param_group(unit):
    _, block = unit
    get_state = _need(block, "FSDPModule", "_get_fsdp_state")
    state = get_state()
    group = _need(state, "FSDPState", "_fsdp_param_group")
    assert group is not None, _moved("FSDPState", "_fsdp_param_group", "is None for a unit with params")
    assert _params_of(_need(state, "FSDPState", "_lazy_init")) == [], _moved("FSDPState", "_lazy_init()", "takes arguments")
    assert fsdp_hooks.param_group(block) is group and fsdp_hooks.is_unit(block)
    assert fsdp_hooks.param_group(nn.Linear(2, 2)) is None and not fsdp_hooks.is_unit(nn.Linear(2, 2))


def test_param_group_methods_we_wrap_and_read(unit):
    _, block = unit
    group = fsdp_hooks.param_group(block)
    unshard = _params_of(_need(group, "FSDPParamGroup", "unshard"))
    assert [p.name for p in unshard] == ["async_op"], _moved("FSDPParamGroup", "unshard(async_op)", "changed signature")
    assert _params_of(_need(group, "FSDPParamGroup", "wait_for_unshard")) == [], \
        _moved("FSDPParamGroup", "wait_for_unshard()", "changed signature")
    post = _params_of(_need(group, "FSDPParamGroup", "post_backward"))
    assert [p.kind for p in post] == [inspect.Parameter.VAR_POSITIONAL], \
        _moved("FSDPParamGroup", "post_backward(*unused)", "changed signature")
    for prop in ("is_sharded", "is_unsharded"):
        assert isinstance(_need(type(group), "FSDPParamGroup", prop), property), _moved("FSDPParamGroup", prop, "is no property")
    assert isinstance(_need(group, "FSDPParamGroup", "_training_state"), TrainingState), \
        _moved("FSDPParamGroup", "_training_state", "is no TrainingState")
    assert hasattr(TrainingState, "PRE_BACKWARD"), _moved("TrainingState", "PRE_BACKWARD", "is gone")
    assert fsdp_hooks.is_sharded(group) and not fsdp_hooks.in_backward(group)


def test_fsdp_param_shard_storage(unit):
    _, block = unit
    group = fsdp_hooks.param_group(block)
    _need(group, "FSDPParamGroup", "fsdp_params")
    fps = fsdp_hooks.group_params(group)
    assert len(fps) == 2, "FSDPParamGroup.fsdp_params: one per parameter of the unit"
    for fp in fps:
        data = _need(fp, "FSDPParam", "_sharded_param_data")
        assert isinstance(data, torch.Tensor) and data.dim() == 1, _moved("FSDPParam", "_sharded_param_data", "is no flat tensor")
        sharded = _need(fp, "FSDPParam", "sharded_param")
        assert isinstance(_need(sharded, "DTensor", "_local_tensor"), torch.Tensor)
        assert fsdp_hooks.local_numel(fp) == sharded.numel()  # one rank: the shard is the whole param
    assert fsdp_hooks.shard_width(fps[0]) == 8


def test_hooks_run_around_unshard_and_post_backward(unit):
    """Wrapped on the instance: the callbacks run in order in a forward and backward."""
    model, _ = unit
    seen: list[str] = []
    for i, block in enumerate(model):
        fsdp_hooks.hook_group(fsdp_hooks.param_group(block), before_unshard=lambda i=i: seen.append(f"unshard{i}"),
                              after_unshard=lambda i=i: seen.append(f"gathered{i}"),
                              after_post_backward=lambda i=i: seen.append(f"reduced{i}"))
    model(torch.randn(3, 8)).sum().backward()
    assert seen.index("unshard0") < seen.index("gathered0") < seen.index("unshard1") < seen.index("reduced1") \
        < seen.index("reduced0"), seen
    for block in model:
        for fp in fsdp_hooks.group_params(fsdp_hooks.param_group(block)):
            grad = fsdp_hooks.take_local_grad(fp)
            assert grad is not None and grad.numel() == fsdp_hooks.local_numel(fp)
            fsdp_hooks.drop_grad(fp)
            assert fsdp_hooks.take_local_grad(fp) is None


def test_torch_internals_outside_fsdp():
    t = torch.zeros(4)
    preserve = _need(torch.autograd, "torch.autograd", "_unsafe_preserve_version_counter")
    version = t._version
    with preserve(t):
        t.add_(1)
    assert t._version == version, _moved("torch.autograd", "_unsafe_preserve_version_counter", "keeps no version")
    assert isinstance(_need(t.untyped_storage(), "torch.UntypedStorage", "_cdata"), int)
    assert fsdp_hooks.storage_key(t) == fsdp_hooks.storage_key(t[1:])
    assert fsdp_hooks.mutates(torch.ops.aten.add_.Tensor) and not fsdp_hooks.mutates(torch.ops.aten.add.Tensor), \
        _moved("torch._ops.OpOverload", "_schema.is_mutable", "changed")
    _need(torch, "torch", "_foreach_norm")
    norms = fsdp_hooks.foreach_norm([torch.tensor([3.0, 4.0]), torch.zeros(0)])
    assert [float(n) for n in norms] == [5.0, 0.0]
