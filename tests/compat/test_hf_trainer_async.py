"""Issue 26 with issue 30: the HF Trainer on the compat engine's asynchronous saves (ds_config
``checkpoint.writer.decoupled: true``), in process at world 1 (~5 s)."""

from __future__ import annotations

from pathlib import Path

from deepshard.compat.transformers import checkpoints
from tests.compat.hf_trainer_harness import collate, ds_config, logged, rows, tiny_llama


def test_asynchronous_saves_are_sealed_before_rotation_and_at_the_end(tmp_path):
    """ds_config ``checkpoint.writer.decoupled: true`` (the compat engine's asynchronous save, issue 30):
    each save is written by the engine's writer thread while training goes on; the Trainer waits for it
    before the next save's rotation and at the end of ``train()``, so what survives ``save_total_limit``
    is sealed, and the logs are the synchronous run's."""
    from deepshard.compat.transformers import Trainer, TrainingArguments

    def run(out: Path, *, decoupled: bool):
        ds = {**ds_config(0), "checkpoint": {"writer": {"decoupled": decoupled}}}
        args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, learning_rate=3e-3, max_steps=4,
                                 logging_steps=1, save_strategy="steps", save_steps=1, save_total_limit=2,
                                 report_to=[], seed=0, train_sampling_strategy="sequential",
                                 remove_unused_columns=False, disable_tqdm=True, deepspeed=ds)
        trainer = Trainer(model=tiny_llama(), args=args, train_dataset=rows(16), data_collator=collate)
        trainer.train()
        return trainer

    sync, asynchronous = run(tmp_path / "sync", decoupled=False), run(tmp_path / "async", decoupled=True)
    assert asynchronous.ds_engine.compat.async_save and asynchronous.ds_engine._writer is not None
    assert not asynchronous.ds_engine._writer.in_flight  # train() returned with its last save sealed
    assert logged(asynchronous) == logged(sync)
    out = tmp_path / "async"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-3", "checkpoint-4"]
    assert all(checkpoints.problem(out / f"checkpoint-{n}", n) is None for n in (3, 4))
