"""HF safetensors in and out: export a sharded checkpoint and load it with transformers; import a
tiny Llama saved by transformers.  Logits agree within 1e-5 both ways."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepshard.core.checkpoint.consolidate import iter_full_tensors
from deepshard.finetune.models.hf import load_hf_weights
from deepshard.finetune.models.llama import Llama
from deepshard.finetune.models.llama.hf import llama_config_from_hf
from deepshard.finetune.tools.export import main
from deepshard.finetune.tools.hf_export import export_checkpoint
from tests.checkpoint.ckpt_harness import MICRO, SPLIT
from tests.checkpoint.hf_fixtures import save_tiny_hf_llama

ROOT = Path(__file__).resolve().parents[2]


def _ours_from_checkpoint(path: Path) -> Llama:
    model = Llama(MICRO)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for info, t in iter_full_tensors(path, "model."):
            params[info.key[len("model."):]].copy_(t)
    return model


@pytest.mark.parametrize("shard_size", [10**9, 30_000])
def test_export_loads_in_transformers_with_the_same_logits(world2, tmp_path, shard_size):
    from transformers import AutoModelForCausalLM

    _, root = world2
    ckpt = root / "stage2" / f"step-{SPLIT:08d}"
    summary = export_checkpoint(ckpt, tmp_path / "hf", max_shard_bytes=shard_size)
    assert summary["tensors"] == len(list(Llama(MICRO).parameters()))
    assert (summary["files"] > 1) == (shard_size < 10**6)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ours = _ours_from_checkpoint(ckpt).eval()
    tokens = torch.randint(0, MICRO.vocab_size, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf(tokens).logits - ours(tokens)).abs().max().item()
    assert diff < 1e-5


def test_export_cli_refuses_a_damaged_checkpoint(world2, tmp_path, capsys):
    _, root = world2
    assert main([str(root / "stage2" / "no-such"), str(tmp_path / "out")]) == 2
    assert "no such directory" in capsys.readouterr().err


@pytest.mark.parametrize("tie", [False, True])
def test_tiny_llama_from_save_pretrained_imports_with_the_same_logits(tmp_path, tie):
    from transformers import AutoModelForCausalLM

    save_tiny_hf_llama(tmp_path, tie=tie)
    cfg = llama_config_from_hf(tmp_path)
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden, cfg.tie_embeddings) == (
        64, 2, 4, 2, 128, tie)
    ours = Llama(cfg)
    load_hf_weights(ours, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (hf(tokens).logits - ours.eval()(tokens)).abs().max().item() < 1e-5


def test_unsupported_hf_configs_are_refused_by_key(tmp_path):
    save_tiny_hf_llama(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key, value, match in (("attention_bias", True, "attention_bias"), ("hidden_act", "gelu", "hidden_act"),
                              ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}, "rope_type")):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ValueError, match=match):
            llama_config_from_hf(tmp_path)


def test_model_hf_composes_and_validates(tmp_path):
    from deepshard.finetune.config import validate
    from tests.app.test_config import _compose

    save_tiny_hf_llama(tmp_path)
    settings = validate(_compose(["model=hf", f"model.path={tmp_path}"]))
    assert settings.model.dim == 64 and settings.model_name == "hf"
    with pytest.raises(ValueError, match="model.path"):
        validate(_compose(["model=hf"]))
