"""TRL's ``SFTTrainer`` as users write it (issue 41): chat data, loss on the completions only,
``SFTConfig(deepspeed="ds_config.json")``, the model by path (at ZeRO-3 transformers builds it under
``deepspeed.zero.Init``).  No deepshard import: started by ``deepshard --num_gpus 2 sft.py`` (or by
``deepspeed --num_gpus 2 sft.py`` for bench/record_hf_stack_ds.py); rank 0 writes the logged losses to
``--result``.  The model directory and rows are hf_stack_harness.py's.

``--lora``: ``SFTTrainer(peft_config=LoraConfig(...))``, TRL's most common run.  ``--save``: checkpoint-2 and
-4, ``save_model`` (the engine's logits on a probe row go with the result), then a fresh trainer resumes
checkpoint-2.  Without ``--ds_config`` the DeepSpeed settings come from accelerate's environment
(``accelerate launch --config_file`` or ``deepshard --accelerate_config``).

``--evaluate before after``: ``trainer.evaluate()`` on held-out chat rows (11: the last batch of a rank
is short), two rows per device, before training (a fresh trainer's) and/or after it; each gives its metrics,
or the one line of what stopped it (below ZeRO-3 transformers refuses an evaluate() before train()).  ``--no_deepspeed``: transformers'
own multi-process CPU path (``use_cpu``, DDP over gloo), the reference for those evaluations."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path: the repo root, for tests.*
from tests.compat.hf_stack_harness import chat_rows  # noqa: E402


def probe(model_dir: str) -> dict:
    """One chat row's token ids (the test feeds the same ids to the saved adapter on the base model)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    row = chat_rows(3)[2]
    ids = tok.apply_chat_template(row["prompt"] + row["completion"], tokenize=True, return_dict=False)
    return {"input_ids": torch.tensor([list(ids)])}


EVAL_ROWS = slice(32, 43)  # chat_rows(43)[EVAL_ROWS]: rows the training never sees


def sft(opts: argparse.Namespace, out: str, save: bool) -> SFTTrainer:
    args = SFTConfig(output_dir=out, deepspeed=opts.ds_config, use_cpu=opts.no_deepspeed, per_device_eval_batch_size=2, per_device_train_batch_size=2,
                     gradient_accumulation_steps=2, learning_rate=3e-3, max_steps=4, logging_steps=1,
                     save_strategy="steps" if save else "no", save_steps=2, report_to=[], seed=0, bf16=False,
                     fp16=False, max_length=64, completion_only_loss=True, train_sampling_strategy="sequential",
                     disable_tqdm=True, model_init_kwargs={"dtype": "float32"})
    peft_config = None
    if opts.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"])
    eval_dataset = Dataset.from_list(chat_rows(43)[EVAL_ROWS]) if opts.evaluate else None
    return SFTTrainer(model=opts.model, args=args, train_dataset=Dataset.from_list(chat_rows()),
                      eval_dataset=eval_dataset, peft_config=peft_config)


def evaluated(trainer: SFTTrainer) -> dict:
    """``evaluate()``'s metrics (without the timings), or what stopped it in one line."""
    try:
        metrics = trainer.evaluate()
    except (AssertionError, ValueError) as err:
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    return {k: float(v) for k, v in metrics.items() if "runtime" not in k and "per_second" not in k}


def logged(trainer: SFTTrainer) -> list[dict]:
    return [{k: float(v) for k, v in h.items() if k in ("loss", "grad_norm", "learning_rate", "step")}
            for h in trainer.state.log_history if "loss" in h]


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag in ("--model", "--out", "--result"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--ds_config", default=None)
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--save", action="store_true")
    ap.add_argument("--evaluate", nargs="*", choices=["before", "after"], default=[])
    ap.add_argument("--no_deepspeed", action="store_true")
    opts, _ = ap.parse_known_args()  # --local_rank=N from the launcher
    trainer = sft(opts, opts.out, opts.save)
    result: dict = {}
    if "before" in opts.evaluate:  # on a trainer of its own: under DeepSpeed, transformers 5.25's train() after
        result["eval_before"] = evaluated(sft(opts, opts.out, False))  # an evaluate() fails (transformers#44889)
    trainer.train()
    if "after" in opts.evaluate:
        result["eval_after"] = evaluated(trainer)
    if opts.save:
        out = Path(opts.out)
        trainer.save_model(str(out / "final"))
        with torch.no_grad():  # the test loads out/final (an adapter with --lora) and compares
            result["logits"] = trainer.model_wrapped(**probe(opts.model)).logits.tolist()
        resumed = sft(opts, str(out / "resumed"), save=False)
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
        result["resumed"] = logged(resumed)
        result["checkpoint_files"] = sorted(str(p.relative_to(out / "checkpoint-2"))
                                            for p in (out / "checkpoint-2").rglob("*") if p.is_file())
        result["final_files"] = sorted(p.name for p in (out / "final").iterdir())
    if dist.get_rank() == 0:
        version = None  # transformers' own path: the engine there is DDP
        if not opts.no_deepspeed:
            import deepspeed

            version = deepspeed.__version__
        trainable = sum(getattr(p, "ds_numel", p.numel()) for p in trainer.model.parameters()
                        if p.requires_grad)
        Path(opts.result).write_text(json.dumps({**result, "logs": logged(trainer), "deepspeed": version,
                                                 "engine": type(trainer.model_wrapped).__module__,
                                                 "peft": type(trainer.model).__name__, "trainable": trainable,
                                                 "world_size": dist.get_world_size()}))


if __name__ == "__main__":
    main()
