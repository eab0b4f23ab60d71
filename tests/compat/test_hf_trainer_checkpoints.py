"""Issue 26: ``save_total_limit`` with deepshard's retention rules, and ``resume_from_checkpoint=True``.

One in-process Trainer run at world 1 (ZeRO 0, 4 steps, a save every step, ``save_total_limit=2``)
whose checkpoints get damaged between saves the way runs damage them: checkpoint-2 is left unsealed
(its ``trainer_state.json``, which transformers writes last, is gone: the save died), checkpoint-3's
engine shard rots (one byte flipped).  A user's own folder named ``checkpoint-0`` sits in the output
dir.  transformers' rotation would keep checkpoint-3 and -4 only (one good checkpoint left) and
delete the user's folder.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from transformers import TrainerCallback

from deepshard.compat.transformers import checkpoints
from tests.compat.hf_trainer_harness import collate, ds_config, logged, rows, tiny_llama


def _flip_a_byte(checkpoint: Path) -> None:
    shard = max(checkpoint.glob("global_step*/step-*/*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


class Damage(TrainerCallback):
    """After save 2 the save 'dies' before trainer_state.json; after save 3 a shard rots."""

    def on_save(self, args, state, control, **kwargs):
        ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.global_step == 2:
            (ckpt / "trainer_state.json").unlink()
        elif state.global_step == 3:
            _flip_a_byte(ckpt)
        time.sleep(0.02)  # distinct mtimes, as transformers' own rotation orders by them


def _trainer(out: Path, **extra):
    from deepshard.compat.transformers import Trainer, TrainingArguments

    settings = dict(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=1,
                    learning_rate=3e-3, max_steps=4, logging_steps=1, save_strategy="steps", save_steps=1,
                    report_to=[], seed=0, train_sampling_strategy="sequential", remove_unused_columns=False,
                    disable_tqdm=True, deepspeed=ds_config(0))
    args = TrainingArguments(**{**settings, **extra})
    return Trainer(model=tiny_llama(), args=args, train_dataset=rows(16), data_collator=collate,
                   callbacks=[Damage()])


def test_save_total_limit_keeps_the_newest_good_checkpoints(tmp_path):
    out = tmp_path / "run"
    mine = out / "checkpoint-0"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("a user's folder, not a checkpoint")
    trainer = _trainer(out, save_total_limit=2)
    trainer.train()
    full = logged(trainer)

    names = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
    # 4 and 1 are the two newest good ones; 3 (rotten) and 2 (unsealed) are newer than 1: left for a look
    assert names == ["checkpoint-0", "checkpoint-1", "checkpoint-2", "checkpoint-3", "checkpoint-4"]
    assert (mine / "notes.txt").read_text() == "a user's folder, not a checkpoint"
    verdicts = {n: checkpoints.problem(out / n, int(n.split("-")[1])) for n in names[1:]}
    assert verdicts["checkpoint-1"] is None and verdicts["checkpoint-4"] is None
    assert "trainer_state.json unreadable" in verdicts["checkpoint-2"]
    assert "crc32" in verdicts["checkpoint-3"]
    assert not checkpoints.is_ours(mine)

    # resume_from_checkpoint=True takes the newest that verifies: with 4 rotten too, that is 1
    assert checkpoints.newest_good(out) == out / "checkpoint-4"
    _flip_a_byte(out / "checkpoint-4")
    assert checkpoints.newest_good(out) == out / "checkpoint-1"
    resumed = _trainer(out)
    resumed.callback_handler.callbacks = [c for c in resumed.callback_handler.callbacks if not isinstance(c, Damage)]
    resumed.args.save_strategy = "no"
    resumed.train(resume_from_checkpoint=True)
    again = logged(resumed)  # checkpoint-1's history, then the resumed steps
    assert [h["step"] for h in again] == [1.0, 2.0, 3.0, 4.0]
    for mine_h, theirs in zip(again, full, strict=True):
        assert mine_h["loss"] == pytest.approx(theirs["loss"], abs=1e-6)


def test_rotation_removes_only_our_checkpoints(tmp_path):
    """A later save with limit 1: our older checkpoints go (good, unsealed or rotten alike, as in
    deepshard's retention); a ``checkpoint-N`` without a deepshard engine checkpoint stays."""
    out = tmp_path / "run"
    trainer = _trainer(out, save_total_limit=1, max_steps=3)
    trainer.callback_handler.callbacks = [c for c in trainer.callback_handler.callbacks if not isinstance(c, Damage)]
    foreign = out / "checkpoint-1000"
    foreign.mkdir(parents=True)
    (foreign / "trainer_state.json").write_text(json.dumps({"global_step": 1000}))
    trainer.train()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-1000", "checkpoint-3"]


def _twice(trainer) -> list[list[dict]]:
    trainer.train()
    first = logged(trainer)
    trainer.args.max_steps = 3  # a second call of another length: its own schedule from step 0
    trainer.train()
    return [first, logged(trainer)]


def test_train_called_twice_continues_as_transformers_does(tmp_path):
    """A second ``train()`` on the same Trainer (transformers allows it): the weights and Adam's moments
    and step count carry over, the step count and the rate's schedule restart.  Against transformers'
    own Trainer, one process, no DeepSpeed, called twice the same way; ours at ZeRO-3."""
    import transformers

    from tests.compat.hf_trainer_harness import arguments, our_trainer

    # no weight decay: which parameters decay (transformers' rule or DeepSpeed's) is not what this is about
    args = arguments(transformers.TrainingArguments, tmp_path / "ref", micro=4, accum=2, weight_decay=0.0)
    ref = _twice(transformers.Trainer(model=tiny_llama(), args=args, train_dataset=rows(), data_collator=collate))
    ours = _twice(our_trainer(tmp_path / "ours", stage=3, micro=4, accum=2, weight_decay=0.0))
    assert [len(c) for c in ours] == [len(c) for c in ref] == [4, 3]
    assert ref[1][0]["loss"] < ref[0][0]["loss"]  # the second call starts from the trained weights
    # (restarting Adam's step count instead of keeping it moves the second call's 3rd loss by 2e-2)
    for mine, theirs in zip(ours[0] + ours[1], ref[0] + ref[1], strict=True):
        assert mine["step"] == theirs["step"]
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
        assert mine["learning_rate"] == pytest.approx(theirs["learning_rate"], abs=1e-12)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
