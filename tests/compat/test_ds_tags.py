"""Issue 32: a checkpoint tag is a name, not a path.  A ``latest`` file (or a tag= argument) naming
``../other_dir`` must not send DeepSpeed-checkpoint readers outside the checkpoint directory:
``from_deepspeed``'s ``resolve_tag_dir`` and the engine's ``load_checkpoint`` / ``save_checkpoint``
refuse it, naming the tag and where it came from."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import deepshard.compat.deepspeed as deepspeed
from deepshard.compat.deepspeed.ds_files import resolve_tag_dir

BAD = ["../other_dir", "..", "a/b", "/abs/path"]


def planted(tmp_path, tag: str):
    """``ckpt/latest`` names ``tag``; ``other_dir`` beside ``ckpt`` looks like a checkpoint."""
    ckpt, other = tmp_path / "ckpt", tmp_path / "other_dir"
    ckpt.mkdir()
    other.mkdir()
    (other / "mp_rank_00_model_states.pt").write_bytes(b"not read")
    (other / "manifest.json").write_text("{}")
    (ckpt / "latest").write_text(tag)
    return ckpt


@pytest.mark.parametrize("tag", BAD)
def test_from_deepspeed_refuses_a_latest_that_is_a_path(tmp_path, tag):
    ckpt = planted(tmp_path, tag)
    with pytest.raises(ValueError, match=rf"latest: tag {tag!r} is not a checkpoint name"):
        resolve_tag_dir(ckpt, None)
    with pytest.raises(ValueError, match="is not a checkpoint name"):
        resolve_tag_dir(ckpt, tag)


def tiny_engine():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                      config={"train_micro_batch_size_per_gpu": 2})
    return engine


def test_engine_checkpoints_refuse_path_tags(tmp_path):
    engine = tiny_engine()
    ckpt = planted(tmp_path, "../other_dir")
    with pytest.raises(ValueError, match=r"latest: tag '../other_dir' is not a checkpoint name"):
        engine.load_checkpoint(ckpt)
    with pytest.raises(ValueError, match=r"tag '../other_dir' is not a checkpoint name"):
        engine.load_checkpoint(tmp_path / "ckpt", tag="../other_dir")
    with pytest.raises(ValueError, match=r"save_checkpoint\(.*tag '../escape' is not a checkpoint name"):
        engine.save_checkpoint(ckpt, tag="../escape")
    assert not (tmp_path / "escape").exists()
    assert engine.save_checkpoint(ckpt, tag="2.3456")  # a loss as a tag (DeepSpeed-Chat style) is a name
