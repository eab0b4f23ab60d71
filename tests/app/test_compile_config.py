"""``compile=true`` from every front door, and what it refuses: the app's key (layouts that cannot
run refused before start, one line naming the key), the ds_config ``compile`` section key by key,
HF's ``TrainingArguments(torch_compile=True)``, ``engine.compile()``; and a recompile storm stops
with one line naming the input change."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from deepshard.compat.ds_config import translate
from deepshard.finetune.config import register, validate

CONF = Path(__file__).resolve().parents[2] / "conf"
register()


def _settings(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=["launcher.nproc_per_node=2", *overrides])
    return validate(OmegaConf.to_container(cfg, resolve=True))


def test_compile_key_reaches_the_engine_and_defaults_off():
    assert _settings([]).engine.compile is False
    s = _settings(["compile=true", "+zero=stage3", "ac=full", "+peft=lora"])
    assert s.engine.compile is True
    assert _settings(["compile=true", "parallel.sp=2"]).engine.compile is True  # tests/app/test_compile.py
    assert _settings(["compile=true", "parallel.tp=2"]).engine.compile is True  # full-length rows: one length
    assert _settings(["compile=true", "parallel.tp=2", "data.seq_len=64", "data.pack=false",
                      "data.pad_to_multiple_of=16"]).engine.compile is True  # 4 lengths x 2 kinds


@pytest.mark.parametrize(("overrides", "line"), [
    (["parallel.pp=2"], r"^compile=true with parallel.pp=2: "),
    (["parallel.tp=2", "data.seq_len=64", "data.pack=false", "data.pad_to_multiple_of=8"],
     r"^compile=true with parallel.tp=2 and data.pad_to_multiple_of=8: tp blocks compile a static graph per "
     r"length .* is 8 lengths x 2 graph kinds > the recompile limit 8; use data.pad_to_multiple_of >= 16, "),
    (["model.mlp_tiles=2"], r"^compile=true with model.mlp_tiles=2: "),
    (["+zero=stage3", "+offload=nvme", "offload.params=nvme", "offload.nvme_path=/tmp"], r"^compile=true with offload.params=nvme: "),
    (["compile=2"], r"^compile=2: must be true or false"),
])
def test_layouts_compile_cannot_run_are_refused_before_start(overrides, line):
    with pytest.raises(ValueError, match=line) as err:
        _settings(["compile=true", *overrides] if overrides != ["compile=2"] else overrides)
    assert "\n" not in str(err.value)


def test_ds_config_compile_section_key_by_key():
    t = translate({"compile": {"enabled": True, "backend": "inductor", "offload_activation": False}})
    assert t.entries["compile"] == ("value", True) and "compile=true" in t.overrides
    assert any(n.startswith("compile.offload_activation: read only by DeepCompile") for n in t.notes)
    assert not t.unsupported
    assert "compile" not in translate({"compile": {"deepcompile": False, "free_activation": True}}).entries
    assert translate({"compile": {"enabled": True, "kwargs": {"mode": "max-autotune"}}}).unsupported == [
        "compile.kwargs={'mode': 'max-autotune'}"]
    with pytest.raises(ValueError, match=r"^compile.deepcompile=true: DeepCompile rewrites"):
        translate({"compile": {"deepcompile": True}})
    with pytest.raises(ValueError, match=r"^compile.backend='eager': only 'inductor'"):
        translate({"compile": {"enabled": True, "backend": "eager"}})


def test_ds_config_compile_reaches_compat_engine_config():
    from deepshard.compat.deepspeed.config import compat_config

    cfg = compat_config({"train_micro_batch_size_per_gpu": 1, "compile": {"enabled": True}}, dp=1, cuda=False)
    assert cfg.engine.compile is True


def test_hf_torch_compile_is_accepted_and_modes_refused(tmp_path):
    from deepshard.compat.transformers import TrainingArguments

    ds = {"zero_optimization": {"stage": 2}}
    args = TrainingArguments(output_dir=str(tmp_path), deepspeed=ds, torch_compile=True, report_to=[])
    assert args.torch_compile
    with pytest.raises(ValueError, match=r"^TrainingArguments\(torch_compile_mode='max-autotune'\)"):
        TrainingArguments(output_dir=str(tmp_path), deepspeed=ds, torch_compile=True,
                          torch_compile_mode="max-autotune", report_to=[])


def test_engine_compile_compiles_blocks_and_refuses_deepcompile_schedule():
    import deepshard.compat.deepspeed as deepspeed
    from deepshard.core.compile import is_compiled
    from deepshard.finetune.models.llama.model import Llama, LlamaConfig

    model = Llama(LlamaConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=32,
                              max_seq_len=16))
    model.init_weights(0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config={"train_micro_batch_size_per_gpu": 1,
                                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    with pytest.raises(ValueError, match=r"^engine.compile\(schedule=...\): compile.deepcompile=true"):
        engine.compile(schedule=[(0, ["prefetch"])])
    assert not engine.is_compiled
    engine.compile()
    assert engine.is_compiled and all(is_compiled(b) for b in engine.module.layers)


def test_recompile_storm_stops_with_one_line_naming_the_change(inductor_cache, monkeypatch):
    """A block whose input shape changes past the limit (1 here) stops with one line naming the change,
    rather than running on in eager."""
    import torch._dynamo

    from deepshard.core import compile as ds_compile

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", inductor_cache)
    blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8)])  # the mechanism, not the model: a cheap graph
    dynamo = torch._dynamo.config
    with dynamo.patch(recompile_limit=dynamo.recompile_limit, automatic_dynamic_shapes=dynamo.automatic_dynamic_shapes,
                      fail_on_recompile_limit_hit=dynamo.fail_on_recompile_limit_hit):
        try:
            torch._dynamo.reset()
            ds_compile.configure_compile(recompile_limit=1)
            ds_compile.apply_compile(blocks)
            with torch.no_grad():
                blocks[0](torch.randn(2, 16, 8))
                with pytest.raises(ds_compile.RecompileStorm) as err:
                    blocks[0](torch.randn(2, 24, 8))
        finally:
            torch._dynamo.reset()
            ds_compile._CONFIGURED.clear()
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("compile=true: block 0 hit torch._dynamo.config.recompile_limit=1")
    assert "[2, 16, 8] float32 (no grad) -> [2, 24, 8] float32 (no grad)" in line
