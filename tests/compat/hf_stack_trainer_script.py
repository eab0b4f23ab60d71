"""The plain ``transformers.Trainer`` with ``TrainingArguments(deepspeed="ds_config.json")``, as users
write it with DeepSpeed installed (issue 41): no deepshard import.  Started by ``deepshard --num_gpus 2``,
whose workers find deepshard's engine under the name ``deepspeed``.  One launch checks training,
checkpoint-N, resume and saving: train 4 steps saving checkpoint-2 and -4, ``save_model`` (the engine's
logits on held-out rows go with the result, for the test to hold ``from_pretrained`` of the saved model
against), then a fresh Trainer resumes from checkpoint-2.  ``--evaluate``: ``evaluate()`` on held-out rows (one per device) by
a fresh Trainer before any ``train()`` (transformers' ``deepspeed_init(inference=True)``: ``deepspeed.initialize``
without an optimizer) and by the trained one after it: each gives its ``eval_loss`` or the one line of what stopped
it.  Rank 0 writes what happened to ``--result`` (JSON).  The model, rows and
arguments are bench/record_hf_trainer_ds.py's (hf_trainer_harness.py), so the logs compare with its
recording of real DeepSpeed."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path: the repo root, for tests.*
from tests.compat.hf_trainer_harness import arguments, collate, logged, probe_batch, rows, tiny_llama  # noqa: E402

# per device: each eval step is one row per rank (the test's world-1 reference takes 2 rows per batch)
EVAL_BATCH = 1


def eval_rows() -> list[dict[str, list[int]]]:
    """8 held-out rows (the training never sees rows 48-55) of uneven length, prompts masked; the fourth is
    prompt-only (every label -100), as a truncated row is."""
    held_out = rows(56)[48:]
    held_out[3] = {**held_out[3], "labels": [-100] * len(held_out[3]["labels"])}
    return held_out


def evaluated(trainer: transformers.Trainer) -> dict:
    """``evaluate()``'s ``eval_loss``, or what stopped it in one line."""
    try:
        return {"eval_loss": float(trainer.evaluate(eval_dataset=eval_rows())["eval_loss"])}
    except (AssertionError, ValueError) as err:
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}


def trainer(out: Path, ds_config: str, **extra: object) -> transformers.Trainer:
    args = arguments(transformers.TrainingArguments, out, micro=2, accum=2, deepspeed=ds_config,
                     per_device_eval_batch_size=EVAL_BATCH, **extra)
    return transformers.Trainer(model=tiny_llama(), args=args, train_dataset=rows(), data_collator=collate)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ds_config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--evaluate", action="store_true", help="evaluate() before and after train()")
    opts, _ = ap.parse_known_args()  # --local_rank=N from the launcher
    out = Path(opts.out)
    import deepspeed

    # before train(), on a trainer of its own: under DeepSpeed transformers 5.25's train() after an evaluate()
    # fails (transformers#44889)
    eval_before = evaluated(trainer(out / "eval", opts.ds_config)) if opts.evaluate else None
    full = trainer(out / "run", opts.ds_config, save_strategy="steps", save_steps=2)
    assert full.is_deepspeed_enabled, "transformers did not take the DeepSpeed path"
    full.train()
    eval_after = evaluated(full) if opts.evaluate else None
    engine = full.model_wrapped
    full.save_model(str(out / "final"))
    with torch.no_grad():  # the test loads out/final with from_pretrained (no ZeRO-3 there) and compares
        logits = engine(**probe_batch()).logits
    resumed = trainer(out / "resumed", opts.ds_config)
    resumed.train(resume_from_checkpoint=str(out / "run" / "checkpoint-2"))
    if dist.get_rank() == 0:
        result = {"logs": logged(full), "resumed": logged(resumed), "logits": logits.tolist(),
                  "eval_before": eval_before, "eval_after": eval_after,
                  "engine": f"{type(engine).__module__}.{type(engine).__name__}",
                  "deepspeed": deepspeed.__version__, "world_size": dist.get_world_size(),
                  "checkpoints": sorted(p.name for p in (out / "run").glob("checkpoint-*")),
                  "checkpoint_files": sorted(p.name for p in (out / "run" / "checkpoint-2").iterdir()),
                  "final_files": sorted(p.name for p in (out / "final").iterdir())}
        Path(opts.result).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
