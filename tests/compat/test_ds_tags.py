"""Issue 32: a checkpoint tag is a name, not a path.  A ``latest`` file (or a tag= argument) naming
``../other_dir`` must not send DeepSpeed-checkpoint readers outside the checkpoint directory:
``from_deepspeed``'s ``resolve_tag_dir`` and the engine's ``load_checkpoint`` / ``save_checkpoint``
refuse it, naming where it came from (a tag the user gave is named; what a file holds is not)."""

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
    with pytest.raises(ValueError, match=r"latest: names no checkpoint tag"):
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
    with pytest.raises(ValueError, match=r"latest: names no checkpoint tag"):
        engine.load_checkpoint(ckpt)
    with pytest.raises(ValueError, match=r"tag '../other_dir' is not a checkpoint name"):
        engine.load_checkpoint(tmp_path / "ckpt", tag="../other_dir")
    with pytest.raises(ValueError, match=r"save_checkpoint\(.*tag '../escape' is not a checkpoint name"):
        engine.save_checkpoint(ckpt, tag="../escape")
    assert not (tmp_path / "escape").exists()
    assert engine.save_checkpoint(ckpt, tag="2.3456")  # a loss as a tag (DeepSpeed-Chat style) is a name


KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA/BG5vbmU\n-----END OPENSSH PRIVATE KEY-----\n"


def test_a_latest_linked_to_a_key_file_is_refused_naming_the_link_not_the_key(tmp_path):
    """Issue 45: a shared or downloaded checkpoint dir can carry ``latest -> ~/.ssh/id_ed25519``; the error
    named the tag it read: the whole key.  Now the link is refused unread, as the HF Trainer path does."""
    key = tmp_path / "id_ed25519"
    key.write_text(KEY)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest").symlink_to(key)
    with pytest.raises(ValueError, match=rf"^{ckpt / 'latest'}: is not a regular file \(a symlink\)") as err:
        resolve_tag_dir(ckpt, None)
    engine = tiny_engine()
    with pytest.raises(ValueError, match=rf"^{ckpt / 'latest'}: is not a regular file \(a symlink\)") as err2:
        engine.load_checkpoint(ckpt)
    for line in (str(err.value), str(err2.value)):
        assert "PRIVATE" not in line and "b3BlbnNz" not in line and "\n" not in line, line
    (ckpt / "latest").unlink()  # a plain latest naming a tag with no directory: the tag is not echoed either
    (ckpt / "latest").write_text("b3BlbnNzaC1rZXktdjEAAAAA\n")
    with pytest.raises(ValueError, match=rf"^{ckpt / 'latest'}: the tag it names has no directory") as err:
        resolve_tag_dir(ckpt, None)
    assert "b3BlbnNz" not in str(err.value)


def test_a_latest_that_is_not_utf8_is_named(tmp_path):
    """Issue 45: a non-UTF-8 ``latest`` gave Python's codec message, which names no file."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "global_step1").mkdir(parents=True)
    (ckpt / "latest").write_bytes(b"global_step1\xff\xfe")
    with pytest.raises(ValueError, match=rf"^{ckpt / 'latest'}: is not UTF-8 text; it should name a checkpoint tag$"):
        resolve_tag_dir(ckpt, None)
