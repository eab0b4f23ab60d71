"""The memory estimator against engine.memory()["measured"] for ZeRO stages 0-3 at world size 2."""

from __future__ import annotations

from deepshard.core.memory import residence as estimate
from deepshard.finetune.tools.estimate import compose, main, report
from deepshard.launch.local import launch_local


def _worker(cfgs: dict) -> dict:
    import torch

    from deepshard.core import build_mesh, init_distributed, initialize
    from deepshard.core.mesh import local_device
    from deepshard.finetune.config import validate
    from deepshard.finetune.recipe.assemble import build_model

    init_distributed()
    out = {}
    mesh = None
    for stage, cfg in cfgs.items():
        s = validate(cfg)
        mesh = mesh or build_mesh(s.parallel)
        engine = initialize(build_model(s, local_device()), s.engine, mesh=mesh)
        tokens = torch.randint(0, s.model.vocab_size, (2, 33), device=local_device())
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        out[stage] = (engine.memory()["measured"].as_dict(), engine.num_params)
    return out


def test_estimator_within_10_percent_of_measured_at_world_2():
    cfgs = {stage: compose([f"+zero=stage{stage}", "launcher.nproc_per_node=2"]) for stage in range(4)}
    _, rows, per_rank, dp = report(cfgs[0])
    assert dp == 2
    results = launch_local(_worker, 2, cfgs)
    for rank, res in enumerate(results):
        for stage, (measured, num_params) in res.items():
            assert num_params == per_rank
            expected = estimate(per_rank, stage=stage, dp=2, dtype="fp32").device
            assert abs(measured["total"] - expected) <= 0.1 * expected, (rank, stage, measured, expected)
            print(f"stage {stage} rank {rank}: estimated {expected / 2**20:.2f} MiB, "
                  f"measured {measured['total'] / 2**20:.2f} MiB")
    assert [r.device for r in rows if r.offload == "none"] == \
        [estimate(per_rank, stage=s, dp=2, dtype="fp32").device for s in range(4)]


def test_estimator_cli_table(capsys):
    assert main(["model=small", "launcher.nproc_per_node=8", "precision=bf16", "parallel.tp=2"]) == 0
    out = capsys.readouterr().out
    assert "world size 8 (dp=4, tp=2, pp=1), bf16" in out
    assert "+zero=stage3 +offload=cpu offload.params=cpu" in out and "+zero=stage0" in out
    assert main(["launcher.nproc_per_node=3", "parallel.tp=2"]) == 2
