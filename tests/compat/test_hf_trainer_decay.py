"""Issue 26: weight decay as transformers + DeepSpeed apply it, when the ds_config has no optimizer
section.  transformers then builds its own AdamW (biases and norms undecayed, by
``Trainer.get_decay_parameter_names``) and hands it to DeepSpeed; ours must decay the same parameters.
(With an optimizer section DeepSpeed decays every parameter: hf_trainer_harness.reference_trainer.)
In process at world 1, ZeRO-2, ~5 s; the reference is transformers' own Trainer without DeepSpeed."""

from __future__ import annotations

import pytest
import torch

from tests.compat.hf_trainer_harness import (
    arguments,
    collate,
    ds_config,
    logged,
    our_trainer,
    probe_batch,
    rows,
    tiny_llama,
)


def test_without_an_optimizer_section_transformers_decay_groups_apply(tmp_path):
    import transformers

    no_optimizer = {k: v for k, v in ds_config(2).items() if k != "optimizer"}
    args = arguments(transformers.TrainingArguments, tmp_path / "ref", micro=4, accum=2, weight_decay=0.1)
    ref = transformers.Trainer(model=tiny_llama(), args=args, train_dataset=rows(), data_collator=collate)
    ref.train()
    ours = our_trainer(tmp_path / "ours", stage=2, micro=4, accum=2, weight_decay=0.1, deepspeed=no_optimizer)
    ours.train()
    for mine, theirs in zip(logged(ours), logged(ref), strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
    with torch.no_grad():
        gap = (ours.ds_engine(**probe_batch()).logits - ref.model(**probe_batch()).logits).abs().max().item()
    assert gap < 1e-5, f"held-out logits differ by {gap} (norms decayed?)"
