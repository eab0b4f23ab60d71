"""TRL's ``DPOTrainer`` as users write it (issue 41): conversational preference rows (prompt, chosen,
rejected), ``DPOConfig(deepspeed="ds_config.json")``, the policy by path and no ``ref_model`` argument: TRL
loads the reference from the same path and hands it to ``deepspeed.initialize`` without an optimizer
(``trl.models.prepare_deepspeed``: stage 0 beside a ZeRO-2 policy, sharded beside a ZeRO-3 one).  No
deepshard import: started by ``deepshard --num_gpus 2 dpo.py`` (or ``deepspeed --num_gpus 2`` for
bench/record_hf_stack_ds.py); rank 0 writes the logged losses and rewards to ``--result``.

``--save``: checkpoint-2 and -4, ``save_model`` (the engine's logits on a probe row go with the result), then a
fresh trainer resumes checkpoint-2 (the reference model loaded and prepared again, as a restarted job does)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import Dataset
from trl import DPOConfig, DPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path: the repo root, for tests.*
from tests.compat.hf_stack_harness import preference_rows  # noqa: E402

LOGGED = ("loss", "grad_norm", "learning_rate", "step", "rewards/chosen", "rewards/rejected", "rewards/margins",
          "logps/chosen", "logps/rejected")


def dpo(opts: argparse.Namespace, out: str, save: bool) -> DPOTrainer:
    args = DPOConfig(output_dir=out, deepspeed=opts.ds_config, per_device_train_batch_size=2,
                     gradient_accumulation_steps=2, learning_rate=3e-3, max_steps=4, logging_steps=1, beta=0.1,
                     save_strategy="steps" if save else "no", save_steps=2, report_to=[], seed=0, bf16=False,
                     fp16=False, max_length=64, train_sampling_strategy="sequential", disable_tqdm=True,
                     model_init_kwargs={"dtype": "float32"})
    return DPOTrainer(model=opts.model, args=args, train_dataset=Dataset.from_list(preference_rows()))


def logged(trainer: DPOTrainer) -> list[dict]:
    return [{k: float(v) for k, v in h.items() if k in LOGGED} for h in trainer.state.log_history if "loss" in h]


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag in ("--model", "--ds_config", "--out", "--result"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--save", action="store_true")
    opts, _ = ap.parse_known_args()  # --local_rank=N from the launcher
    trainer = dpo(opts, opts.out, opts.save)
    trainer.train()
    result: dict = {}
    if opts.save:
        from tests.compat.hf_stack_sft_script import probe

        out = Path(opts.out)
        trainer.save_model(str(out / "final"))
        with torch.no_grad():  # the test loads out/final with from_pretrained and compares
            result["logits"] = trainer.model_wrapped(**probe(opts.model)).logits.tolist()
        resumed = dpo(opts, str(out / "resumed"), save=False)
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
        result["resumed"] = logged(resumed)
        result["checkpoint_files"] = sorted(str(p.relative_to(out / "checkpoint-2"))
                                            for p in (out / "checkpoint-2").rglob("*") if p.is_file())
        result["final_files"] = sorted(p.name for p in (out / "final").iterdir())
    if dist.get_rank() == 0:
        import deepspeed

        Path(opts.result).write_text(json.dumps({
            **result, "logs": logged(trainer), "deepspeed": deepspeed.__version__,
            "engine": type(trainer.model_wrapped).__module__,
            "ref_engine": f"{type(trainer.ref_model).__module__}.{type(trainer.ref_model).__name__}",
            "world_size": dist.get_world_size()}))


if __name__ == "__main__":
    main()
