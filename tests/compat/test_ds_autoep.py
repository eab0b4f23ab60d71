"""DeepSpeed 0.19.8's AutoEP section (``expert_parallel``, read by deepspeed/module_inject/auto_ep_config.py
``parse_autoep_config``) through the ds_config translation: each key family mapped onto ``parallel.ep`` or
noted, or refused in one line naming the key (``compat/ds_autoep.py``)."""

from __future__ import annotations

import pytest

from deepshard.compat.ds_config import translate

# every key parse_autoep_config reads in DeepSpeed 0.19.8 (grep "param_dict" in auto_ep_config.py)
DEEPSPEED_KEYS = (
    "enabled", "autoep_size", "expert_tensor_parallel_size", "validate_folding_routing", "async_split_plan",
    "preset_model", "moe_layer_pattern", "expert_pattern", "router_pattern", "use_grouped_mm",
    "disable_triton_grouped_mm", "route_norm", "route_scale", "score_apply", "combine_impl", "row_weighting_impl",
    "gate_up_impl", "comm_backend", "comm_num_sm", "comm_qp_margin", "comm_max_tokens_per_rank", "num_expert_groups",
    "num_limited_groups", "score_func", "top_k", "load_balance_coeff", "routed_scaling_factor", "expert_w1",
    "expert_w2", "expert_w3", "num_experts_attr", "top_k_attr", "has_shared_experts", "shared_experts_pattern",
    "shared_experts_gate_pattern", "expert_activation")


def _ep(**section) -> dict:
    return {"expert_parallel": {"enabled": True, **section}}


def test_every_autoep_key_is_mapped_noted_or_refused():
    from deepshard.compat.ds_autoep import AUTOEP_KEYS

    assert sorted(AUTOEP_KEYS) == sorted(DEEPSPEED_KEYS)


def test_autoep_size_is_parallel_ep():
    t = translate(_ep(autoep_size=4, preset_model="qwen3_moe", top_k="auto", route_norm=None, score_func="softmax",
                      comm_backend="comm", expert_tensor_parallel_size=1, load_balance_coeff=None))
    assert "parallel.ep=4" in t.overrides and not t.unsupported
    assert any("expert_parallel.preset_model" in n for n in t.notes)
    assert "parallel.ep=4" not in translate({"expert_parallel": {"enabled": False, "autoep_size": 4}}).overrides
    for bad in (0, "2", True):
        with pytest.raises(ValueError, match=r"expert_parallel\.autoep_size=.*positive integer"):
            translate(_ep(autoep_size=bad))
    with pytest.raises(ValueError, match=r"expert_parallel\.enabled='yes': must be true or false"):
        translate({"expert_parallel": {"enabled": "yes"}})


def test_kernel_choices_are_noted():
    from deepshard.compat.ds_autoep import SAME_MATH

    t = translate(_ep(autoep_size=2, **{k: "auto" for k in SAME_MATH}))
    assert not t.unsupported and {n.split(":")[0] for n in t.notes} >= {f"expert_parallel.{k}" for k in SAME_MATH}


@pytest.mark.parametrize(("key", "value"), [
    ("top_k", 2), ("route_norm", True), ("score_func", "sigmoid"), ("routed_scaling_factor", 2.5),
    ("route_scale", 0.5), ("score_apply", "pre"), ("num_expert_groups", 8), ("num_limited_groups", 4),
    ("load_balance_coeff", 0.01), ("expert_activation", "geglu_tanh"), ("expert_tensor_parallel_size", 2),
    ("comm_backend", "deepep"), ("preset_model", "deepseek_v3"), ("moe_layer_pattern", r"model\.layers\.\d+\.mlp"),
    ("expert_w3", None)])
def test_what_would_route_or_run_differently_is_refused_by_name(key, value):
    if key == "expert_w3":  # a discovery key left null asks for nothing
        assert not translate(_ep(autoep_size=2, expert_w3=None)).unsupported
        return
    with pytest.raises(ValueError, match=rf"expert_parallel\.{key}="):
        translate(_ep(autoep_size=2, **{key: value}))


def test_expert_data_order_and_the_compat_engine():
    from deepshard.compat.deepspeed.config import compat_config

    assert not translate({"use_data_before_expert_parallelism": False}).unsupported
    with pytest.raises(ValueError, match="use_data_before_expert_parallelism=True: expert groups are consecutive"):
        translate({"use_data_before_expert_parallelism": True})
    with pytest.raises(ValueError, match=r"expert_parallel\.autoep_size=2: deepshard\.compat\.deepspeed trains"):
        compat_config({"train_micro_batch_size_per_gpu": 1, **_ep(autoep_size=2)}, dp=1, cuda=False)
