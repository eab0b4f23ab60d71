"""ZeRO++ and HSDP settings: the app's keys compose and validate, bad input fails before any worker
starts with one line naming the keys, and DeepSpeed's ZeRO++ keys translate."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from deepshard.compat.ds_config import translate
from deepshard.finetune.config import register, validate

CONF = Path(__file__).resolve().parents[2] / "conf"
register()


def _settings(overrides: list[str], world: int = 4):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    return validate(OmegaConf.to_container(cfg, resolve=True), world_size=world)


def test_hsdp_and_zeropp_keys_validate():
    s = _settings(["+zero=stage3", "parallel.dp_shard=2", "parallel.dp_replicate=2", "zero.quantized_weights=true",
                   "zero.quantized_gradients=true", "zero.quantized_gradients_bits=4"])
    assert (s.parallel.dp, s.parallel.dp_shard, s.parallel.dp_replicate) == (4, 2, 2)
    z = s.engine.zero
    assert (z.quantized_weights, z.quantized_gradients, z.quantized_gradients_bits) == (True, True, 4)
    assert _settings(["+zero=stage3"]).parallel.dp_shard == 4  # flat: the whole dp axis shards
    assert _settings(["+zero=stage3", "zero.hpz_partition_size=2"]).engine.zero.hpz_partition_size == 2


def test_zeropp_shards_over_dp_times_sp():
    """Issue 45 item 10: ``parallel.sp=2 zero.quantized_weights=true`` at world 2 (dp 1) was refused as
    "a shard group of one rank", though ZeRO-3 shards over dp x sp = 2 ranks (core.mesh.zero_mesh; the
    run itself: tests/sp/test_ulysses_parity.py, layout sp2_zero3_quantized)."""
    s = _settings(["+zero=stage3", "parallel.sp=2", "zero.quantized_weights=true", "zero.quantized_gradients=true"], 2)
    assert (s.parallel.dp, s.parallel.sp) == (1, 2)
    assert s.engine.zero.quantized_weights and s.engine.zero.quantized_gradients


@pytest.mark.parametrize("overrides,world,message", [
    (["+zero=stage3", "parallel.dp_shard=3", "parallel.dp_replicate=2"], 4,
     r"^parallel.dp_shard=3 x parallel.dp_replicate=2 = 6 != the data-parallel size 4"),
    (["+zero=stage3", "parallel.dp_replicate=3"], 4, r"^parallel.dp_replicate=3 does not divide the data-parallel size 4"),
    (["+zero=stage2", "parallel.dp_replicate=2"], 4, r"^parallel.dp_replicate=2 needs zero.stage=3"),
    (["+zero=stage3", "parallel.dp_replicate=2", "parallel.sp=2"], 8, r"^parallel.dp_replicate=2 with parallel.sp=2"),
    (["+zero=stage2", "zero.quantized_gradients=true"], 2, r"^zero.quantized_gradients=True: .* stage 3's"),
    (["+zero=stage3", "zero.quantized_weights=true"], 1, r"^zero.quantized_weights=true with a ZeRO-3 shard group of one"),
    (["+zero=stage3", "parallel.dp_replicate=2", "zero.quantized_gradients=true"], 2, r"shard group of one rank"),
    (["+zero=stage3", "zero.hpz_partition_size=3"], 4, r"^zero.hpz_partition_size=3 does not divide the ZeRO group's 4"),
    (["+zero=stage3", "zero.hpz_partition_size=2", "parallel.dp_replicate=2"], 4, r"^zero.hpz_partition_size=2 with HSDP"),
    (["+zero=stage2", "zero.hpz_partition_size=2"], 4, r"^zero.hpz_partition_size=2: hpZ's secondary partition .* stage=3"),
    (["+zero=stage3", "zero.hpz_partition_size=2", "zero.reshard_after_forward=false"], 4,
     r"^zero.hpz_partition_size=2: .*reshard_after_forward=false"),
    (["+zero=stage3", "zero.quantized_gradients_bits=2"], 4, r"^zero.quantized_gradients_bits=2: valid values are 8 and 4"),
    (["+zero=stage3", "zero.loco=true"], 4, r"^zero.loco=True: LoCo's error feedback .* quantized_gradients=true"),
    (["+zero=stage3", "zero.quantized_gradients=true", "zero.loco=true", "zero.loco_err_beta=1.5"], 4,
     r"^zero.loco_err_beta=1.5: must be in \[0, 1\]"),
    (["+zero=stage3", "zero.quantized_gradients=true", "zero.loco=true", "zero.loco_reset_t=0"], 4,
     r"^zero.loco_reset_t=0: must be >= 1"),
])
def test_bad_input_refused_before_start(overrides, world, message):
    with pytest.raises(ValueError, match=message) as err:
        _settings(overrides, world)
    assert "\n" not in str(err.value)


def test_ds_config_zeropp_keys_map():
    t = translate({"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
                                         "zero_hpz_partition_size": 1,
                                         "zeropp_loco_param": {"err_beta": 0.7, "reset_T": 512}}})
    assert {"+zero=stage3", "zero.quantized_weights=true", "zero.quantized_gradients=true",
            "zero.quantized_gradients_bits=4", "zero.hpz_partition_size=1", "zero.loco=true",
            "zero.loco_err_beta=0.7", "zero.loco_reset_t=512"} <= set(t.overrides)
    assert t.unsupported == []
    z = _settings(t.overrides).engine.zero  # the app takes them
    assert (z.loco, z.loco_err_beta, z.loco_reset_t) == (True, 0.7, 512)
    t = translate({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True, "zeropp_loco_param": {}}})
    assert "zero.loco=true" in t.overrides  # DeepSpeed's defaults (0.8, 1024) are ZeroConfig's
    assert _settings(t.overrides).engine.zero.loco_err_beta == 0.8
