"""What the decoder families refuse before any worker starts (world 1, the app's own settings
validation on tiny HF folders saved by transformers): a tied head (Llama 3.2, SmolLM2, the small
Qwen2.5 / Qwen3 checkpoints: ``tie_word_embeddings``) with more than two pipeline stages, one line
naming the keys; at two stages, and untied at four, they are let through.  (The layouts they run are trained in
tests/models/test_family_training.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.hf_refs import save_hf


def _settings(hf_dir: Path, *overrides: str, world: int = 2):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from deepshard.finetune.config import register, validate

    register()
    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose(config_name="config", overrides=["model=hf", f"model.path={hf_dir}", "data.seq_len=32",
                                                       "+zero=stage1", "pipeline.microbatches=2", *overrides])
    return validate(OmegaConf.to_container(cfg, resolve=True), world_size=world)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_a_tied_head_runs_at_pp2_and_is_refused_in_one_line_at_larger_pp(tmp_path, family):
    """pp=2 keeps the head as the last stage's copy of the embedding, their gradients summed over the
    pp group of two (trained in tests/models/test_family_training.py's ``pp2_llama``); more stages are
    refused."""
    save_hf(family, tmp_path / "tied", tie_word_embeddings=True, num_hidden_layers=4)
    assert _settings(tmp_path / "tied", "parallel.pp=2").parallel.pp == 2
    with pytest.raises(ValueError, match=r"^parallel.pp=4: the model ties its head to its embedding \(model.tie_"
                                         r"embeddings=True, config.json tie_word_embeddings\); the first and last "
                                         r"stages sum their two copies' gradients at parallel.pp=2 only; use "
                                         r"parallel.pp=2$") as err:
        _settings(tmp_path / "tied", "parallel.pp=4", "pipeline.schedule=gpipe", world=4)
    assert "\n" not in str(err.value)
    save_hf(family, tmp_path / "untied", tie_word_embeddings=False, num_hidden_layers=4)
    assert _settings(tmp_path / "untied", "parallel.pp=4", "pipeline.schedule=gpipe", world=4).parallel.pp == 4
