"""``parallel.sp`` (and ``model.mlp_tiles``) that cannot work is refused before any worker starts, in one line naming the keys,
the values and what is valid (the launcher's checks, run in this process: no launch)."""

from __future__ import annotations

import pytest

from tests.app.prelaunch import prelaunch_error

TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
        "data.seq_len=64", "launcher.nproc_per_node=4"]

CASES = [
    (["parallel.sp=3", "model.dim=96", "model.n_heads=6", "model.n_kv_heads=3"],
     ["parallel.sp=3", "world size 4"]),  # sp does not divide the world
    (["parallel.sp=2", "data.seq_len=63"], ["data.seq_len=63", "parallel.sp=2", "multiple of 2"]),
    (["parallel.sp=4", "model.n_heads=2", "model.n_kv_heads=1", "model.dim=64"],
     ["parallel.sp=4", "model.n_heads=2", "divisors of 2"]),
    (["parallel.sp=2", "parallel.tp=2", "model.n_heads=2", "model.n_kv_heads=2"],
     ["parallel.sp=2", "parallel.tp=2", "1 heads per tp rank"]),
    (["parallel.sp=2", "parallel.pp=2", "pipeline.microbatches=2"], ["parallel.sp=2", "parallel.pp=2", "pp=1"]),
    (["parallel.sp=0"], ["parallel.sp=0", "positive integer"]),
    (["parallel.sp=2", "model.mlp_tiles=33"], ["model.mlp_tiles=33", "data.seq_len=64 / parallel.sp=2 = 32"]),
    (["parallel.tp=2", "model.mlp_tiles=2"], ["model.mlp_tiles=2", "parallel.tp=2"]),
    (["model.mlp_tiles=0"], ["model.mlp_tiles=0", ">= 1"]),
]


@pytest.mark.parametrize("overrides,expected", CASES)
def test_bad_sp_is_one_line_before_any_worker(tmp_path, monkeypatch, overrides, expected):
    line = prelaunch_error([*TINY, *overrides], tmp_path / "run", monkeypatch)
    for part in expected:
        assert part in line, line


def test_good_sp_passes_the_checks():
    """sp=4 over 4 ranks with 2 kv heads (replicated to line up) is accepted; dp is what sp leaves."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from deepshard.finetune.config import register, validate
    from tests.app.prelaunch import CONF

    register()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=[*TINY, "parallel.sp=4"])
    s = validate(OmegaConf.to_container(cfg, resolve=True))
    assert (s.parallel.sp, s.parallel.dp) == (4, 1)
