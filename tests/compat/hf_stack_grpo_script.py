"""TRL's ``GRPOTrainer`` as users write it (issue 41): prompt-only chat rows, a reward function, the policy by
path, ``GRPOConfig(deepspeed="ds_config.json", use_vllm=False)``.  At ZeRO-3 TRL generates with the policy
inside ``unwrap_model_for_generation``: ``deepspeed.zero.GatheredParameters`` over the engine's parameters,
the ZeRO-3 hooks removed for the generation (``optimizer.parameter_offload``'s ``forward_hooks``,
``ds_active_sub_modules``) and put back (``param_coordinator``, ``_register_deepspeed_module``).  With
``beta > 0`` TRL loads a reference model and shards it beside the policy (``trl.models.prepare_deepspeed``:
``deepspeed.initialize`` without an optimizer at ZeRO-3), so the loss carries a KL term after step 1.

Two additions a user would not need, the same on both engines: the global RNG is seeded at the start of each
step (per rank), so both engines sample the same tokens from the same logits (DeepSpeed's ``zero.Init`` and
ours draw different amounts of initial randomness); and the time spent inside TRL's
``unwrap_model_for_generation`` (gather + generate + release) is measured per step.  No deepshard import:
started by ``deepshard --num_gpus 2 grpo.py`` (or ``deepspeed --num_gpus 2`` for bench/record_hf_stack_ds.py);
rank 0 writes the logs to ``--result``.

``--save``: checkpoint-3, ``save_model`` (the engine's logits on a probe row go with the result), then a fresh
trainer resumes checkpoint-3 (the reference model loaded and prepared again, as a restarted job does) for steps
4-5; the per-step seed makes its sampled tokens those of the uninterrupted run."""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import trl.trainer.grpo_trainer as grpo_module
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path: the repo root, for tests.*
from tests.compat.hf_stack_harness import chat_rows  # noqa: E402

LOGGED = ("loss", "grad_norm", "learning_rate", "step", "reward", "reward_std", "rewards/vowels/mean", "kl",
          "completions/mean_length", "entropy", "num_tokens")
GENERATION_SECONDS: list[float] = []


def vowels(completions: list, **kwargs: object) -> list[float]:
    """The share of vowels in each completion's text: a cheap reward that differs between samples."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch in "aeiou" for ch in t) / (len(t) + 1) for t in texts]


class SeedEachStep(TrainerCallback):
    """The sampling RNG from the step and the rank only, not from what ran before."""

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201 - transformers' signature
        torch.manual_seed(1000 + 10 * state.global_step + dist.get_rank())


def timed_unwrap(unwrap):  # noqa: ANN001, ANN201
    unwrap = getattr(unwrap, "untimed", unwrap)  # patched by an earlier script in this worker (hf_stack_runner.py)

    @contextmanager
    def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        start = time.perf_counter()
        with unwrap(*args, **kwargs) as model:
            yield model
        GENERATION_SECONDS.append(time.perf_counter() - start)
    wrapped.untimed = unwrap
    return wrapped


def grpo(opts: argparse.Namespace, out: str, save: bool) -> GRPOTrainer:
    args = GRPOConfig(output_dir=out, deepspeed=opts.ds_config, use_vllm=False, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=8, learning_rate=1e-2, beta=0.1, max_steps=5,
                      logging_steps=1, save_strategy="steps" if save else "no", save_steps=3, report_to=[], seed=0,
                      bf16=False, fp16=False, disable_tqdm=True, model_init_kwargs={"dtype": "float32"})
    rows = [{"prompt": row["prompt"]} for row in chat_rows(16)]
    return GRPOTrainer(model=opts.model, reward_funcs=vowels, args=args, train_dataset=Dataset.from_list(rows),
                       callbacks=[SeedEachStep()])


def logged(trainer: GRPOTrainer) -> list[dict]:
    return [{k: float(v) for k, v in h.items() if k in LOGGED} for h in trainer.state.log_history if "loss" in h]


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag in ("--model", "--ds_config", "--out", "--result"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--save", action="store_true")
    opts, _ = ap.parse_known_args()  # --local_rank=N from the launcher
    grpo_module.unwrap_model_for_generation = timed_unwrap(grpo_module.unwrap_model_for_generation)
    trainer = grpo(opts, opts.out, opts.save)
    trainer.train()
    result: dict = {"generation_seconds": list(GENERATION_SECONDS)}  # the uninterrupted run's steps only
    if opts.save:
        from tests.compat.hf_stack_sft_script import probe

        out = Path(opts.out)
        trainer.save_model(str(out / "final"))
        with torch.no_grad():  # the test loads out/final with from_pretrained and compares
            result["logits"] = trainer.model_wrapped(**probe(opts.model)).logits.tolist()
        resumed = grpo(opts, str(out / "resumed"), save=False)
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
        result["resumed"] = logged(resumed)
        result["checkpoint_files"] = sorted(str(p.relative_to(out / "checkpoint-3"))
                                            for p in (out / "checkpoint-3").rglob("*") if p.is_file())
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
