"""The plain ``transformers.Trainer`` with ``TrainingArguments(deepspeed="ds_config.json")``, as users
write it with DeepSpeed installed (issue 41): no deepshard import.  Started by ``deepshard --num_gpus 2``,
whose workers find deepshard's engine under the name ``deepspeed``.  One launch checks training,
checkpoint-N, resume and saving: train 4 steps saving checkpoint-2 and -4, ``save_model`` (the engine's
logits on held-out rows go with the result, for the test to hold ``from_pretrained`` of the saved model
against), then a fresh Trainer resumes from checkpoint-2.  Rank 0 writes what happened to ``--result`` (JSON).  The model, rows and
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


def trainer(out: Path, ds_config: str, **extra: object) -> transformers.Trainer:
    args = arguments(transformers.TrainingArguments, out, micro=2, accum=2, deepspeed=ds_config, **extra)
    return transformers.Trainer(model=tiny_llama(), args=args, train_dataset=rows(), data_collator=collate)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ds_config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--result", required=True)
    opts, _ = ap.parse_known_args()  # --local_rank=N from the launcher
    out = Path(opts.out)
    import deepspeed

    full = trainer(out / "run", opts.ds_config, save_strategy="steps", save_steps=2)
    assert full.is_deepspeed_enabled, "transformers did not take the DeepSpeed path"
    full.train()
    engine = full.model_wrapped
    full.save_model(str(out / "final"))
    with torch.no_grad():  # the test loads out/final with from_pretrained (no ZeRO-3 there) and compares
        logits = engine(**probe_batch()).logits
    resumed = trainer(out / "resumed", opts.ds_config)
    resumed.train(resume_from_checkpoint=str(out / "run" / "checkpoint-2"))
    if dist.get_rank() == 0:
        result = {"logs": logged(full), "resumed": logged(resumed), "logits": logits.tolist(),
                  "engine": f"{type(engine).__module__}.{type(engine).__name__}",
                  "deepspeed": deepspeed.__version__, "world_size": dist.get_world_size(),
                  "checkpoints": sorted(p.name for p in (out / "run").glob("checkpoint-*")),
                  "checkpoint_files": sorted(p.name for p in (out / "run" / "checkpoint-2").iterdir()),
                  "final_files": sorted(p.name for p in (out / "final").iterdir())}
        Path(opts.result).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
