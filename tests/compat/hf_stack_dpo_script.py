"""TRL's ``DPOTrainer`` as users write it (issue 41): conversational preference rows (prompt, chosen,
rejected), ``DPOConfig(deepspeed="ds_config.json")``, the policy by path and no ``ref_model`` argument: TRL
loads the reference from the same path and hands it to ``deepspeed.initialize`` without an optimizer
(``trl.models.prepare_deepspeed``: stage 0 beside a ZeRO-2 policy, sharded beside a ZeRO-3 one).  No
deepshard import: started by ``deepshard --num_gpus 2 dpo.py`` (or ``deepspeed --num_gpus 2`` for
bench/record_hf_stack_ds.py); rank 0 writes the logged losses and rewards to ``--result``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch.distributed as dist
from datasets import Dataset
from trl import DPOConfig, DPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path: the repo root, for tests.*
from tests.compat.hf_stack_harness import preference_rows  # noqa: E402

LOGGED = ("loss", "grad_norm", "learning_rate", "step", "rewards/chosen", "rewards/rejected", "rewards/margins",
          "logps/chosen", "logps/rejected")


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag in ("--model", "--ds_config", "--out", "--result"):
        ap.add_argument(flag, required=True)
    opts, _ = ap.parse_known_args()  # --local_rank=N from the launcher
    args = DPOConfig(output_dir=opts.out, deepspeed=opts.ds_config, per_device_train_batch_size=2,
                     gradient_accumulation_steps=2, learning_rate=3e-3, max_steps=4, logging_steps=1, beta=0.1,
                     save_strategy="no", report_to=[], seed=0, bf16=False, fp16=False, max_length=64,
                     train_sampling_strategy="sequential", disable_tqdm=True, model_init_kwargs={"dtype": "float32"})
    trainer = DPOTrainer(model=opts.model, args=args, train_dataset=Dataset.from_list(preference_rows()))
    trainer.train()
    if dist.get_rank() == 0:
        logs = [{k: float(v) for k, v in h.items() if k in LOGGED} for h in trainer.state.log_history if "loss" in h]
        import deepspeed

        Path(opts.result).write_text(json.dumps({
            "logs": logs, "deepspeed": deepspeed.__version__, "engine": type(trainer.model_wrapped).__module__,
            "ref_engine": f"{type(trainer.ref_model).__module__}.{type(trainer.ref_model).__name__}",
            "world_size": dist.get_world_size()}))


if __name__ == "__main__":
    main()
