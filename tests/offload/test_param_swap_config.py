"""offload.params=nvme: bad settings stop before any worker with the key, the value and what is valid,
and DeepSpeed's ``offload_param`` (device nvme and its buffer keys) maps onto ours."""

from __future__ import annotations

import pytest

from deepshard.finetune.config.ds_config import translate
from deepshard.offload import OffloadConfig, validate_config
from deepshard.offload.config import validate_param_swap


def _nvme(tmp_path, **kw) -> OffloadConfig:
    return OffloadConfig(device="nvme", nvme_path=str(tmp_path), params="nvme", **kw)


def test_param_swap_needs_the_optimizer_state_on_nvme(tmp_path):
    with pytest.raises(ValueError, match=r"offload.params='nvme' .*offload.device='nvme'.*got offload.device='cpu'"):
        validate_config(OffloadConfig(device="cpu", params="nvme"))


@pytest.mark.parametrize(("kw", "match"), [
    ({"param_buffer_count": 0}, r"offload.param_buffer_count=0 .*>= 1"),
    ({"param_buffer_size": -1}, r"offload.param_buffer_size=-1 .*>= 1"),
    ({"param_prefetch": -1}, r"offload.param_prefetch=-1 .*>= 0"),
    ({"param_prefetch": 4, "param_buffer_count": 4}, r"offload.param_prefetch=4 .*< param_buffer_count=4"),
    ({"max_in_cpu": -5}, r"offload.max_in_cpu=-5 .*>= 0"),
])
def test_pool_keys_are_checked(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        validate_config(_nvme(tmp_path, **kw))


def test_buffer_smaller_than_a_block_and_too_little_disk_are_named(tmp_path):
    cfg = _nvme(tmp_path, param_buffer_size=1000)
    with pytest.raises(ValueError, match=r"offload.param_buffer_size=1000 .*largest block shard \(5000 elements, 'block3'\)"):
        validate_param_swap(cfg, 16 * 5000, 5000, "block3")
    with pytest.raises(ValueError, match=r"offload.nvme_path=.*needs \d+ bytes of swap space \(params \+ grads"):
        validate_param_swap(_nvme(tmp_path), 2**62, 10, "root")


def test_deepspeed_offload_param_nvme_maps_to_ours():
    ds = {"zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 4},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 5, "buffer_size": 1e8,
                          "max_in_cpu": 1e9, "pin_memory": True}}}
    t = translate(ds)
    assert t.unsupported == []
    for o in ("+zero=stage3", "+offload=nvme", "offload.nvme_path=/local_nvme", "offload.params=nvme",
              "offload.param_buffer_count=5", "offload.param_buffer_size=100000000", "offload.max_in_cpu=1000000000"):
        assert o in t.overrides, (o, t.overrides)
    assert sum(o.startswith("offload.nvme_path=") for o in t.overrides) == 1  # one swap directory


def test_estimator_knows_the_infinity_layout():
    from deepshard.core.memory import residence as estimate
    from deepshard.finetune.tools.estimate import all_estimates, options

    e = estimate(10_000, stage=3, dp=2, dtype="bf16", offload="nvme", offload_params="nvme", param_buffer_bytes=640)
    assert (e.device, e.host, e.nvme) == (0, 640, 16 * 10_000 // 2)  # params = fp32 masters, grads, 2 moments
    assert options(e) == "+zero=stage3 +offload=nvme offload.params=nvme"
    rows = [options(r) for r in all_estimates(10_000, dp=2, dtype="fp32")]
    assert rows.count("+zero=stage3 +offload=nvme offload.params=nvme") == 1
    assert not any("offload.params=nvme" in r for r in rows if "stage3 +offload=nvme" not in r)


def test_app_checks_buffers_against_the_model_before_any_worker(tmp_path):
    from deepshard.finetune.config import validate
    from deepshard.finetune.tools.estimate import compose

    base = ["+zero=stage3", "+offload=nvme", "offload.params=nvme", f"offload.nvme_path={tmp_path}",
            "launcher.nproc_per_node=2"]
    assert validate(compose(base)).offload.params == "nvme"
    with pytest.raises(ValueError, match=r"offload.param_buffer_size=1000 .*largest block shard \(\d+ elements"):
        validate(compose([*base, "offload.param_buffer_size=1000"]))
    with pytest.raises(ValueError, match=r"offload.params='nvme' .*not with parallel.pp/tp > 1"):
        validate(compose([*base, "parallel.pp=2", "launcher.nproc_per_node=4"]))


def _infinity_host(path, *overrides: str) -> int:
    from deepshard.finetune.tools.estimate import compose, options, report

    base = ["+zero=stage3", "+offload=nvme", "offload.params=nvme", f"offload.nvme_path={path}", "model=tiny",
            "launcher.nproc_per_node=2"]
    _, rows, *_ = report(compose([*base, *overrides]))
    (row,) = [r for r in rows if options(r) == "+zero=stage3 +offload=nvme offload.params=nvme"]
    return row.host


def test_estimate_counts_the_deferred_steps_buffers(tmp_path):
    """The host figure of offload.params=nvme is the forward's: the param pool (param_buffer_count x
    4 B per element of the largest unit's shard) and the deferred AdamW step's buffer_count buffers of
    16 B per element (param, two moments, grad), owed from step() until each unit's next unshard; no
    more buffers than units."""
    # tiny (LlamaConfig's defaults): the largest unit is the root, embedding + head (2048 x 256 each)
    # and the final norm (256), halved at world 2; every O_DIRECT region rounds up by < 4096 bytes
    shard = (2 * 2048 * 256 + 256) // 2
    host = _infinity_host(tmp_path, "offload.param_buffer_count=4", "offload.buffer_count=2")
    assert 0 <= host - (4 * 4 * shard + 2 * 16 * shard) < (4 + 2 * 4) * 4096
    more = _infinity_host(tmp_path, "offload.param_buffer_count=4", "offload.buffer_count=5")
    assert 0 <= more - host - 3 * 16 * shard < 3 * 4 * 4096
    # one block: two units (the root and the block), so the step never holds more than two buffers
    two = ["model.n_layers=1", "offload.param_buffer_count=4"]
    assert _infinity_host(tmp_path, *two, "offload.buffer_count=5") == _infinity_host(tmp_path, *two, "offload.buffer_count=2")
    assert _infinity_host(tmp_path, *two, "offload.buffer_count=2") - _infinity_host(tmp_path, *two, "offload.buffer_count=1") \
        >= 16 * shard


def test_default_param_buffer_size_follows_the_largest_block(tmp_path):
    """TinyLlama's shape at world 2: a block's shard is 22M elements, over ``param_buffer_size``'s 2**24
    default; left out, it follows the block (the pool allocates the block's size anyway); a smaller
    value given is a cap the block breaks, refused before any worker starts, even the default's 2**24."""
    from deepshard.finetune.config import validate
    from deepshard.finetune.tools.estimate import compose

    base = ["model.dim=2048", "model.n_layers=22", "model.n_heads=32", "model.n_kv_heads=4", "model.ffn_hidden=5632",
            "model.vocab_size=32000", "launcher.nproc_per_node=2", "+zero=stage3", "+offload=nvme",
            "offload.params=nvme", f"offload.nvme_path={tmp_path}"]
    block = 2 * 2048 * 2048 + 2 * 2048 * 256 + 3 * 2048 * 5632 + 2 * 2048  # q,o + k,v + MLP + two norms
    assert validate(compose(base)).offload.param_buffer_size == block // 2
    with pytest.raises(ValueError, match=rf"offload.param_buffer_size=16000000 .*largest block shard \({block // 2} "):
        validate(compose([*base, "offload.param_buffer_size=16000000"]))
    with pytest.raises(ValueError, match=rf"offload.param_buffer_size=16777216 .*largest block shard \({block // 2} "):
        validate(compose([*base, "offload.param_buffer_size=16777216"]))  # given, though equal to the default
