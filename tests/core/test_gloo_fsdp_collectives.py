"""Stage 3's gloo collectives (FSDP2's custom all-gather and reduce-scatter hooks) against results
written here from every rank's inputs, and installed on every FSDP unit of a stage-3 engine on gloo."""

from __future__ import annotations

import torch

SEG = 1003  # odd: nothing lines up by chance


def _inputs(rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s input: the same on every rank that builds it, so each can write the expected result."""
    return torch.randn(world * SEG, generator=torch.Generator().manual_seed(17 + rank))


def _worker() -> dict:
    import torch.distributed as dist

    from deepshard.core import EngineConfig, OptimConfig, ZeroConfig, init_distributed, initialize
    from deepshard.core.zero.collectives import GlooAllGather, GlooReduceScatter

    init_distributed()
    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    every = [_inputs(r, world) for r in range(world)]
    out = {}

    gather = GlooAllGather()
    for async_op in (False, True):
        buf = torch.full((world * SEG,), float("nan"))
        mine = every[rank][:SEG]
        work = gather(buf, mine, group, async_op=async_op)
        if async_op:
            assert isinstance(work, dist.Work)  # FSDP2 waits only on a Work
            work.wait()
        out[f"gather_async={async_op}"] = torch.equal(buf, torch.cat([x[:SEG] for x in every]))

    scatter = GlooReduceScatter()
    total = every[0].clone()
    for x in every[1:]:
        total += x
    want = total[rank * SEG:(rank + 1) * SEG]
    for name, op, expect in (("sum", dist.ReduceOp.SUM, want), ("avg", dist.ReduceOp.AVG, want / world)):
        got = torch.full((SEG,), float("nan"))
        scatter(got, every[rank].clone(), group, op)
        out[f"scatter_{name}"] = float((got - expect).abs().max())

    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    initialize(model, EngineConfig(zero=ZeroConfig(stage=3), optim=OptimConfig(lr=1e-3)), blocks=list(model)[:3])
    comms = [(type(g._all_gather_comm).__name__, type(g._reduce_scatter_comm).__name__)
             for unit in [*model[:3], model] for g in unit._get_fsdp_state()._fsdp_param_groups]
    out["installed"] = comms
    return out


def test_gloo_all_gather_and_reduce_scatter_equal_the_collectives_definition_world2_and_3(gloo_pool):
    for world in (2, 3):  # world 3: the reduce-scatter falls back to gloo's own
        for rank, res in enumerate(gloo_pool(world).run(_worker)):
            assert res["gather_async=False"] and res["gather_async=True"], (world, rank, res)
            assert res["scatter_sum"] < 1e-6 and res["scatter_avg"] < 1e-6, (world, rank, res)
            assert res["installed"] == [("GlooAllGather", "GlooReduceScatter")] * 4, (world, rank, res)
