"""The device choices as pure functions: which GPU a process takes, the injectable compute device,
and the clipping norm (foreach, fp32, on the compute device) against a plain reference."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepshard.core.mesh import cuda_index, local_device, use_local_device
from deepshard.core.optim import global_grad_sq_norm
from tests.devices.device_recorder import fake_world


@pytest.mark.parametrize(("env", "count", "expected"), [
    ({"LOCAL_RANK": "5"}, 8, 5),  # torchrun, every process sees the node's 8 GPUs
    ({"LOCAL_RANK": "3"}, 1, 0),  # --gpus-per-task=1: local rank 3 sees one GPU, index 0
    ({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "3"}, 1, 0),
    ({"LOCAL_RANK": "5"}, 2, 1),  # two GPUs per task
    ({"SLURM_LOCALID": "2"}, 4, 2),  # srun without torchrun
    ({}, 1, 0),
])
def test_cuda_index(env: dict[str, str], count: int, expected: int) -> None:
    assert cuda_index(env, count) == expected


def test_cuda_index_bad_input_names_the_value() -> None:
    with pytest.raises(ValueError, match="LOCAL_RANK='x'"):
        cuda_index({"LOCAL_RANK": "x"}, 2)
    with pytest.raises(ValueError, match="no CUDA device visible.*''"):
        cuda_index({"CUDA_VISIBLE_DEVICES": ""}, 0)


def test_use_local_device_overrides_and_restores() -> None:
    host = local_device()
    with use_local_device("meta") as d:
        assert d == local_device() == torch.device("meta")
        with use_local_device("cpu"):
            assert local_device() == torch.device("cpu")
        assert local_device() == torch.device("meta")
    assert local_device() == host


def _reference(grads: list[torch.Tensor], replication: list[int]) -> float:
    """Plain fp64 sum of squares, each tensor weighted 1/r."""
    return sum(float(g.double().pow(2).sum()) / r for g, r in zip(grads, replication))


def _grads() -> tuple[list[torch.Tensor], list[int]]:
    torch.manual_seed(0)
    grads = [torch.randn(17, 5), torch.randn(0), torch.randn(33).bfloat16(),
             (torch.randn(40) * 300).half(),  # squares overflow fp16 (> 65504): summed in fp32
             torch.randn(3, 3, 3), torch.randn(1)]
    return grads, [1, 1, 2, 1, 2, 4]


def test_grad_norm_equals_plain_reference() -> None:
    grads, rep = _grads()
    with fake_world(world_size=1):
        total = global_grad_sq_norm(grads, rep)
    assert total.dtype == torch.float32 and total.device == local_device()
    assert math.isfinite(total.item())
    assert total.item() == pytest.approx(_reference(grads, rep), rel=1e-5)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_grad_norm_non_finite_anywhere(bad: float) -> None:
    grads, rep = _grads()
    grads[2][3] = bad
    with fake_world(world_size=1):
        assert not torch.isfinite(global_grad_sq_norm(grads, rep))


def test_grad_norm_no_grads_is_zero_on_the_compute_device() -> None:
    with fake_world(world_size=1), use_local_device("meta"):
        assert global_grad_sq_norm([], []).device == torch.device("meta")


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_grad_norm_launches_per_group_not_per_parameter() -> None:
    """200 parameters of one dtype: a handful of ops, not two per parameter."""
    grads = [torch.randn(7) for _ in range(200)]
    with fake_world(world_size=1), _Ops() as rec:
        total = global_grad_sq_norm(grads, [1] * 200)
    assert total.item() == pytest.approx(_reference(grads, [1] * 200), rel=1e-5)
    assert sum("_foreach_norm" in op for op in rec.ops) == 1, rec.ops
    assert len(rec.ops) < 15, rec.ops
