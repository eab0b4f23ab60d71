"""The model-family registry: Llama is its first entry, an unknown family is one ValueError naming
the valid ones, and the app builds its model through the family the config belongs to."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch import nn

from deepshard.finetune.config import register, validate
from deepshard.finetune.models import registry
from deepshard.finetune.models.llama import Llama, LlamaConfig
from deepshard.finetune.recipe import assemble

CONF = Path(__file__).resolve().parents[2] / "conf"
register()


def _settings(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides))
    return validate(OmegaConf.to_container(cfg, resolve=True))


def test_llama_is_registered():
    spec = registry.get("llama")
    assert "llama" in registry.names()
    assert spec.config is LlamaConfig and spec.build is Llama
    assert registry.spec_of(LlamaConfig()) is spec
    assert set(spec.presets) == {"tiny", "small"}


def test_unknown_family_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"'gpt7'.*\['gemma2', 'gemma3', 'llama', 'mistral', 'mixtral', 'phi3', 'qwen2', 'qwen2_moe', 'qwen3', 'qwen3_moe'"):
        registry.get("gpt7")


def test_a_taken_name_is_refused():
    spec = registry.get("llama")
    assert registry.register(spec) is spec  # the same spec again: a no-op (re-import)
    with pytest.raises(ValueError, match="already registered"):
        registry.register(dataclasses.replace(spec, build=nn.Linear))


def test_the_app_builds_the_same_model_as_the_constructor():
    """The settings' model through the registry (assemble.build_model) equals the direct Llama, seeded."""
    s = _settings("train.seed=7")
    assert registry.spec_of(s.model).name == "llama"
    built = assemble.build_model(s, torch.device("cpu"))
    torch.manual_seed(0)  # the seeded init owes nothing to the global RNG
    direct = Llama(s.model)
    direct.init_weights(seed=7)
    ours, theirs = dict(built.named_parameters()), dict(direct.named_parameters())
    assert list(ours) == list(theirs)
    for name, p in theirs.items():
        assert torch.equal(ours[name], p), name
    assert assemble.run_meta(s)["family"] == "llama"


@dataclasses.dataclass(frozen=True)
class _ToyConfig:
    dim: int = 4


class _Toy(nn.Module):
    def __init__(self, cfg: _ToyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.seeds: list[int] = []

    def init_weights(self, seed: int = 0) -> None:
        self.seeds.append(seed)


def test_assemble_takes_the_family_of_the_config(monkeypatch):
    """A second family's config reaches its own build and recipe: assemble names no family."""
    calls = []

    def recipe(model, mesh, **kwargs):
        calls.append(kwargs["zero"].stage)

    spec = registry.ModelSpec(name="toy", config=_ToyConfig, build=_Toy, parallelize=recipe, pipeline=None,
                              stage_init=None, check_tp=None, hf=registry.get("llama").hf, activation_memory=None)
    monkeypatch.setitem(registry._SPECS, "toy", spec)
    s = dataclasses.replace(_settings("train.seed=3"), model=_ToyConfig())
    model = assemble.build_model(s, torch.device("cpu"))
    assert isinstance(model, _Toy) and model.seeds == [3] and not model.proj.weight.is_meta
    assert "toy" in registry.names() and assemble.run_meta(s)["family"] == "toy"
    monkeypatch.setattr(assemble, "initialize", lambda model, e, *, parallelize_fn, **kw: parallelize_fn(model))
    monkeypatch.setattr(assemble, "EngineStepper", lambda *a, **kw: None)
    assemble.build_stepper(s, mesh=None, rank=0)
    assert calls == [s.engine.zero.stage]


def test_hf_folders_and_manifests_find_their_family(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert registry.for_hf(tmp_path).name == "qwen2"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert registry.for_hf(tmp_path).name == "transformers"  # no native family: transformers' own class
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt7"}))
    with pytest.raises(ValueError, match=r"model_type='gpt7'.*'gemma2', 'gemma3', 'gemma3_text', 'llama', 'mistral', 'mixtral', 'phi3', 'qwen2', 'qwen2_moe', 'qwen3', 'qwen3_moe'.*"
                                         r"transformers"):
        registry.for_hf(tmp_path)
    assert registry.for_hf(tmp_path / "missing").name == "llama"  # its config_from_hf says what is wrong
    spec, cfg = registry.from_meta({"model": dataclasses.asdict(LlamaConfig(dim=64))})  # before "family"
    assert spec.name == "llama" and cfg == LlamaConfig(dim=64)
