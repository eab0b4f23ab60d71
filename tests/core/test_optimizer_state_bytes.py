"""The expected optimizer bytes follow the update rule: Muon keeps one momentum per hidden matrix and
AdamW's two moments on the rest, bf16 states are half and come with no fp32 master copy.  The expected
figure (``engine.memory()["expected"]``) is checked against the bytes the live tensors hold (the census),
and the app's estimate against a count written here from the model's parameter shapes."""

from __future__ import annotations

from deepshard.core import EngineConfig, OptimConfig, PrecisionConfig, ZeroConfig
from tests.core.zero_harness import build_model

CASES = {  # name -> (optim.name, optim.state_dtype, precision, stage)
    "adamw": ("adamw", "fp32", "fp32", 1),
    "muon": ("muon", "fp32", "fp32", 1),
    "muon_zero3": ("muon", "fp32", "fp32", 3),
    "adamw_bf16_states": ("adamw", "bf16", "bf16", 1),
    "muon_bf16_states": ("muon", "bf16", "bf16", 2),
    "adamw_bf16_compute": ("adamw", "fp32", "bf16", 1),
}


def _worker() -> dict:
    from deepshard.core import init_distributed, initialize
    from deepshard.core.mesh import local_device

    init_distributed()
    out = {}
    for case, (name, states, dtype, stage) in CASES.items():
        config = EngineConfig(zero=ZeroConfig(stage=stage), precision=PrecisionConfig(dtype=dtype),
                              optim=OptimConfig(name=name, state_dtype=states))
        memory = initialize(build_model().to(local_device()), config).memory()
        out[case] = memory["expected"].optimizer, memory["measured"].optimizer
    return out


def test_expected_optimizer_bytes_equal_the_census(gloo_pool):
    got = gloo_pool(1).run(_worker)[0]
    for case, (expected, measured) in got.items():
        assert expected == measured, (case, expected, measured)
    assert got["muon"][1] < got["adamw"][1]  # the rules really differ
    assert got["adamw_bf16_states"][1] * 3 == got["adamw_bf16_compute"][1]  # 4 B vs 8 + 4 (master) B per param


def test_the_estimate_counts_muon_and_bf16_states():
    from deepshard.finetune.models.llama import LlamaConfig
    from deepshard.finetune.models.memory_plan import model_counts

    cfg = LlamaConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16)
    from deepshard.finetune.models.registry import build_meta

    params = list(build_meta(cfg).named_parameters())
    hidden = sum(p.numel() for n, p in params if p.dim() == 2 and "embed" not in n and "lm_head" not in n)
    rest = sum(p.numel() for _, p in params) - hidden
    for states, size in (("fp32", 4), ("bf16", 2)):
        muon = model_counts(cfg, optim=OptimConfig(name="muon", state_dtype=states)).optimizer_states
        adamw = model_counts(cfg, optim=OptimConfig(state_dtype=states)).optimizer_states
        assert muon == size * (hidden + 2 * rest), states  # one momentum per hidden matrix, two moments elsewhere
        assert adamw == 2 * size * (hidden + rest), states
    assert model_counts(cfg, optim=OptimConfig(name="muon"), tp=1, pp=2).optimizer_states == 4 * (hidden + 2 * rest) // 2
