"""+peft=lora: the config group, its validation before start, and the estimator's LoRA layout."""

from __future__ import annotations

import pytest

from deepshard.core.memory import residence as estimate
from deepshard.finetune.config import validate
from deepshard.finetune.tools.estimate import compose, options, report

# the tiny preset: dim 256, 6 layers, 8 heads of 32, 4 kv heads, ffn 704, vocab 2048
DIM, LAYERS, KV, FFN, VOCAB = 256, 6, 4 * 32, 704, 2048
BASE = VOCAB * DIM * 2 + LAYERS * (DIM * DIM * 2 + DIM * KV * 2 + DIM * FFN * 3 + 2 * DIM) + DIM


def adapters(r: int) -> int:
    """r x (in + out) for q, k, v, o, gate, up, down of every layer, written out."""
    per_layer = (DIM + DIM) + (DIM + KV) * 2 + (DIM + DIM) + (DIM + FFN) * 3
    return LAYERS * r * per_layer


def test_lora_group_composes_with_defaults():
    s = validate(compose(["+peft=lora", "peft.r=4", "peft.modules_to_save=[lm_head]"]))
    assert s.peft is not None and s.peft.r == 4 and s.peft.alpha == 16.0
    assert s.peft.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert s.peft.modules_to_save == ("lm_head",)
    assert validate(compose([])).peft is None


@pytest.mark.parametrize("override,message", [
    ("peft.r=0", r"peft.r=0: the LoRA rank must be a positive integer"),
    ("peft.target_modules=[q_proj,qkv]", r"peft.target_modules=\['q_proj', 'qkv'\]: unknown module name 'qkv'; "
                                         r"valid names are \['q_proj'"),
    ("peft.modules_to_save=[head]", r"peft.modules_to_save=\['head'\]: unknown module name 'head'"),
    ("peft.dropout=1.5", r"peft.dropout=1.5: must be in \[0, 1\)"),
])
def test_bad_lora_settings_fail_before_start(override, message):
    with pytest.raises(ValueError, match=message):
        validate(compose(["+peft=lora", override, "launcher.nproc_per_node=2"]))


def test_lora_layouts_pp_and_tp_are_accepted_and_dropout_under_tp_is_refused():
    """Adapters split with their layers under pp/tp (tests/lora/test_lora_parallel.py trains them); the one
    combination left out is dropout on tensor-parallel activations (one mask across tp ranks)."""
    with pytest.raises(ValueError, match=r"peft\.dropout=0\.1 with parallel\.tp=2: LoRA dropout on "
                                         r"tensor-parallel activations .* set peft\.dropout=0"):
        validate(compose(["+peft=lora", "peft.dropout=0.1", "parallel.tp=2", "launcher.nproc_per_node=2"]))
    for overrides in (["parallel.pp=2", "peft.dropout=0.1", "peft.modules_to_save=[embed_tokens,lm_head]"],
                      ["parallel.tp=2", "peft.modules_to_save=[lm_head,norm]", "peft.target_modules=[q_proj,down_proj]"]):
        assert validate(compose(["+peft=lora", "launcher.nproc_per_node=2", *overrides])).peft is not None


def test_estimator_counts_adapters_as_trainable_and_the_base_as_params_only():
    _, rows, per_rank, dp = report(compose(["+peft=lora", "peft.r=8", "launcher.nproc_per_node=2"]))
    assert dp == 2 and per_rank == adapters(8)
    n, frozen = adapters(8), BASE
    by = {options(r): r for r in rows}
    # fp32: trainable 4 + 4 + 8 bytes (grads and Adam sharded per the stage), frozen base 4 bytes, no state
    assert by["+zero=stage0"].device == 16 * n + 4 * frozen
    assert by["+zero=stage1"].device == 4 * n + 4 * n + 8 * n // 2 + 4 * frozen
    assert by["+zero=stage2"].device == 4 * n + (4 * n + 8 * n) // 2 + 4 * frozen
    assert by["+zero=stage3"].device == 16 * n // 2 + 4 * frozen // 2
    # the optimizer state alone is 8 bytes x adapters / N at stage >= 1 (what the parity test measures)
    assert estimate(n, stage=1, dp=2, dtype="fp32", offload="cpu").host == 12 * n // 2


def test_estimator_text_names_the_lora_split(capsys):
    from deepshard.finetune.tools.estimate import main

    assert main(["+peft=lora", "launcher.nproc_per_node=2"]) == 0
    out = capsys.readouterr().out
    assert f"{adapters(8) / 1e6:.3f}M trainable" in out and "frozen base (params only)" in out
