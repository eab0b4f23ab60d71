"""DTensor placements on a real 1-rank gloo mesh: supported layouts match the plain result, layouts
that shard a reduced dimension raise ValueError instead of computing a wrong answer."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from deepshard.kernels import (
    RMSNorm,
    apply_rotary,
    apply_rotary_reference,
    linear_cross_entropy,
    linear_cross_entropy_reference,
    rms_norm,
    rms_norm_reference,
    swiglu,
    swiglu_reference,
)


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    owned = not dist.is_initialized()
    if owned:
        with tempfile.NamedTemporaryFile(delete=False) as f:
            init_file = f.name
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    if dist.get_world_size() != 1:
        pytest.skip("needs a 1-rank default group")
    yield init_device_mesh("cpu", (1,))
    if owned:
        dist.destroy_process_group()


def put(t: torch.Tensor, mesh: DeviceMesh, placement) -> DTensor:
    return distribute_tensor(t, mesh, [placement])


def partial(t: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    return DTensor.from_local(t, mesh, [Partial()])


def test_rms_norm_sequence_sharded_matches_and_weight_grad_flows(mesh: DeviceMesh) -> None:
    x = torch.randn(2, 7, 16)
    norm = RMSNorm(16)
    norm.weight = torch.nn.Parameter(put(torch.rand(16), mesh, Replicate()))
    y = norm(put(x, mesh, Shard(1)))
    assert isinstance(y, DTensor) and y.placements == (Shard(1),)
    torch.testing.assert_close(y.full_tensor(), rms_norm_reference(x, norm.weight.full_tensor()))
    y.sum().backward()
    assert isinstance(norm.weight.grad, DTensor) and norm.weight.grad.shape == (16,)


@pytest.mark.parametrize("placement", [Shard(2), Shard(-1)], ids=str)
def test_rms_norm_hidden_sharded_is_a_value_error(mesh: DeviceMesh, placement) -> None:
    with pytest.raises(ValueError, match="rms_norm.*x.*hidden"):
        rms_norm(put(torch.randn(2, 3, 8), mesh, placement), put(torch.ones(8), mesh, Replicate()))


def test_rms_norm_partial_or_sharded_weight_is_a_value_error(mesh: DeviceMesh) -> None:
    x = put(torch.randn(2, 8), mesh, Replicate())
    with pytest.raises(ValueError, match="rms_norm"):
        rms_norm(partial(torch.randn(2, 8), mesh), put(torch.ones(8), mesh, Replicate()))
    with pytest.raises(ValueError, match="rms_norm.*weight"):
        rms_norm(x, put(torch.ones(8), mesh, Shard(0)))


def test_swiglu_sharded_matches_and_mismatch_is_a_value_error(mesh: DeviceMesh) -> None:
    g, u = torch.randn(3, 10), torch.randn(3, 10)
    out = swiglu(put(g, mesh, Shard(1)), put(u, mesh, Shard(1)))
    assert out.placements == (Shard(1),)
    torch.testing.assert_close(out.full_tensor(), swiglu_reference(g, u))
    with pytest.raises(ValueError, match="swiglu.*differ"):
        swiglu(put(g, mesh, Shard(1)), put(u, mesh, Shard(0)))
    with pytest.raises(ValueError, match="swiglu.*not linear"):
        swiglu(partial(g, mesh), partial(u, mesh))


def test_rope_head_sharded_matches_seq_sharded_is_a_value_error(mesh: DeviceMesh) -> None:
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    cos, sin = torch.randn(5, 8), torch.randn(5, 8)
    q_out, k_out = apply_rotary(put(q, mesh, Shard(1)), put(k, mesh, Shard(1)), cos, sin)
    q_ref, k_ref = apply_rotary_reference(q, k, cos, sin)
    torch.testing.assert_close(q_out.full_tensor(), q_ref)
    torch.testing.assert_close(k_out.full_tensor(), k_ref)
    with pytest.raises(ValueError, match="apply_rotary.*q"):
        apply_rotary(put(q, mesh, Shard(2)), put(k, mesh, Shard(2)), cos, sin)
    with pytest.raises(ValueError, match="apply_rotary.*cos"):
        apply_rotary(put(q, mesh, Shard(1)), put(k, mesh, Shard(1)), put(cos, mesh, Shard(0)), sin)


def test_linear_ce_replicated_matches(mesh: DeviceMesh) -> None:
    hidden, weight, targets = torch.randn(9, 8), torch.randn(20, 8), torch.randint(0, 20, (9,))
    loss = linear_cross_entropy(
        put(hidden, mesh, Replicate()), put(weight, mesh, Replicate()), put(targets, mesh, Replicate()),
        chunk_size=4,
    )
    torch.testing.assert_close(loss.full_tensor(), linear_cross_entropy_reference(hidden, weight, targets))


@pytest.mark.parametrize(
    "arg,placement", [("weight", Shard(0)), ("weight", Shard(1)), ("hidden", Shard(1))], ids=str
)
def test_linear_ce_vocab_or_hidden_sharded_is_a_value_error(mesh: DeviceMesh, arg: str, placement) -> None:
    tensors = {"hidden": torch.randn(9, 8), "weight": torch.randn(20, 8)}
    args = {name: put(t, mesh, placement if name == arg else Replicate()) for name, t in tensors.items()}
    with pytest.raises(ValueError, match=f"linear_cross_entropy.*{arg}.*vocab"):
        linear_cross_entropy(args["hidden"], args["weight"], torch.randint(0, 20, (9,)))

