"""TRL's ``SFTTrainer`` as users write it (issue 41): chat data, loss on the completions only,
``SFTConfig(deepspeed="ds_config.json")``, the model by path (at ZeRO-3 transformers builds it under
``deepspeed.zero.Init``).  No deepshard import: started by ``deepshard --num_gpus 2 sft.py`` (or by
``deepspeed --num_gpus 2 sft.py`` for bench/record_hf_stack_ds.py); rank 0 writes the logged losses to
``--result``.  The model directory and rows are hf_stack_harness.py's."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch.distributed as dist
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path: the repo root, for tests.*
from tests.compat.hf_stack_harness import chat_rows  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag in ("--model", "--ds_config", "--out", "--result"):
        ap.add_argument(flag, required=True)
    opts, _ = ap.parse_known_args()  # --local_rank=N from the launcher
    args = SFTConfig(output_dir=opts.out, deepspeed=opts.ds_config, per_device_train_batch_size=2,
                     gradient_accumulation_steps=2, learning_rate=3e-3, max_steps=4, logging_steps=1,
                     save_strategy="no", report_to=[], seed=0, bf16=False, fp16=False, max_length=64,
                     completion_only_loss=True, train_sampling_strategy="sequential", disable_tqdm=True,
                     model_init_kwargs={"dtype": "float32"})
    trainer = SFTTrainer(model=opts.model, args=args, train_dataset=Dataset.from_list(chat_rows()))
    trainer.train()
    if dist.get_rank() == 0:
        logs = [{k: float(v) for k, v in h.items() if k in ("loss", "grad_norm", "learning_rate", "step")}
                for h in trainer.state.log_history if "loss" in h]
        import deepspeed

        Path(opts.result).write_text(json.dumps({"logs": logs, "deepspeed": deepspeed.__version__,
                                                 "engine": type(trainer.model_wrapped).__module__,
                                                 "world_size": dist.get_world_size()}))


if __name__ == "__main__":
    main()
