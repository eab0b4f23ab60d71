"""The session's gloo pool (tests/gloo_pool.py): it runs a function on every rank of a real gloo group,
and nothing a test changes in a worker reaches the next test; a rank that raises, dies or hangs fails
that call with one line naming the rank, and the pool comes back for the next call."""

from __future__ import annotations

import os

import pytest

from tests.gloo_pool import PoolFailure


def _sum_of_ranks() -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def _dirty() -> dict:
    """Changes everything the pool must put back, and makes a mesh (sub-groups) and a group."""
    import random

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_default_dtype(torch.float64)
    torch.manual_seed(1234)
    random.seed(1234)
    os.environ["GLOO_POOL_LEAK"] = "1"
    os.environ["MASTER_PORT"] = "1"
    os.chdir("/")
    torch.set_num_threads(3)
    init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp", "tp"))
    dist.new_group([0])
    return _clean()


def _clean() -> dict:
    import random

    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    return {"dtype": torch.get_default_dtype(), "leak": os.environ.get("GLOO_POOL_LEAK"), "cwd": os.getcwd(),
            "port": os.environ["MASTER_PORT"], "threads": torch.get_num_threads(),
            "torch_draw": torch.rand(3).tolist(), "py_draw": random.random(), "groups": len(_world.pg_map),
            "rank": dist.get_rank()}


def _dtensor_on_a_2x2_mesh() -> list[float]:
    """An op on a DTensor (its output's spec, mesh included, comes from DTensor's cache, keyed by the
    mesh's layout), then collectives over the mesh's sub-groups."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = distribute_tensor(torch.arange(4.0), mesh, [Shard(0), Shard(0)])
    return (x * 2).full_tensor().tolist()


def _raise_on_rank_1() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses")
    dist.barrier()  # rank 0 waits on the rank that raised, as a real peer would


def _die_on_rank_1() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(3)


def _hang_on_rank_0() -> None:
    import time

    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(60)


def _destroy_default_group() -> None:
    import torch.distributed as dist

    dist.destroy_process_group()


def _gloo_threads() -> int:
    names = [open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")]
    return sum(n.startswith(("gloo", "pt_gloo")) for n in names)


def _groups_held_by_a_cycle() -> int:
    """Sub-groups whose last references are a reference cycle (as an engine and its meshes hold them)."""
    import torch.distributed as dist

    class Holder:
        pass

    for _ in range(3):
        holder = Holder()
        holder.group, holder.me = dist.new_group([0, 1]), holder
        dist.barrier(group=holder.group)
    return _gloo_threads()


def test_a_destroyed_groups_threads_do_not_outlive_the_call(gloo_pool):
    """Before the pool collected each call's garbage, every such group kept 3 polling gloo threads."""
    idle = gloo_pool(2).run(_gloo_threads)
    assert all(n > idle[0] for n in gloo_pool(2).run(_groups_held_by_a_cycle))
    assert gloo_pool(2).run(_gloo_threads) == idle


def test_a_collective_runs_over_the_whole_world(gloo_pool):
    assert gloo_pool(2).run(_sum_of_ranks) == [3.0, 3.0]


def test_a_test_that_sets_dtype_env_seed_cwd_threads_and_groups_leaves_nothing(gloo_pool):
    fresh = gloo_pool(2).run(_clean)
    dirty = gloo_pool(2).run(_dirty)
    assert all(str(d["dtype"]) == "torch.float64" and d["threads"] == 3 for d in dirty)
    assert all(d["leak"] == "1" and d["cwd"] == "/" and d["groups"] > fresh[0]["groups"] for d in dirty)
    after = gloo_pool(2).run(_clean)
    assert after == fresh  # same dtype, env, cwd, threads, RNG draws and groups as before the dirty test
    assert after[0]["leak"] is None and after[0]["threads"] == 1 and after[0]["groups"] == 1


def test_a_mesh_of_the_same_layout_in_the_next_test_gets_its_own_groups(gloo_pool):
    """The first call's sub-groups are destroyed; the second call's mesh of the same layout must not
    reach them through DTensor's caches (keyed by layout)."""
    first = gloo_pool(4).run(_dtensor_on_a_2x2_mesh)
    assert gloo_pool(4).run(_dtensor_on_a_2x2_mesh) == first
    assert first == [[0.0, 2.0, 4.0, 6.0]] * 4


def test_a_destroyed_default_group_is_rejoined(gloo_pool):
    gloo_pool(2).run(_destroy_default_group)
    assert gloo_pool(2).run(_sum_of_ranks) == [3.0, 3.0]


@pytest.mark.slow  # each restarts the pool (~3 s)
def test_a_rank_that_raises_is_named_and_the_pool_comes_back(gloo_pool):
    with pytest.raises(PoolFailure, match=r"^gloo pool: rank 1: ValueError: rank 1 refuses"):
        gloo_pool(2).run(_raise_on_rank_1)
    assert gloo_pool(2).run(_sum_of_ranks) == [3.0, 3.0]


@pytest.mark.slow  # each restarts the pool (~3 s)
def test_a_rank_that_dies_is_named_and_the_pool_comes_back(gloo_pool):
    with pytest.raises(PoolFailure, match=r"rank 1 died \(exit code 3\); the pool restarts"):
        gloo_pool(2).run(_die_on_rank_1)
    assert gloo_pool(2).run(_sum_of_ranks) == [3.0, 3.0]


@pytest.mark.slow  # each restarts the pool (~3 s)
def test_a_rank_that_hangs_is_named_and_the_pool_comes_back(gloo_pool):
    with pytest.raises(PoolFailure, match=r"rank\(s\) \[0\] gave no answer within 2 s \(hung\)"):
        gloo_pool(2).run(_hang_on_rank_0, timeout_s=2)
    assert gloo_pool(2).run(_sum_of_ranks) == [3.0, 3.0]
