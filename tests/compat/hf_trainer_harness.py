"""The HF Trainer recipe (issue 26) on a tiny LlamaForCausalLM built from a config: transformers'
own Trainer (plain torch, no DeepSpeed) as the reference, and deepshard's Trainer with
``deepspeed=ds_config``.  Data as users have it: token ids (no tokenizer download) with the prompt
masked by ``labels=-100``, rows of uneven length padded per batch by a collator.  Each function
returns what transformers logged (``trainer.state.log_history``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB, PAD = 256, 0


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="eager", pad_token_id=PAD)
    return LlamaForCausalLM(cfg)


def rows(n: int = 48) -> list[dict[str, list[int]]]:
    """Prompt + response rows of uneven length; only the response is trained on."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        answer = torch.randint(3, VOCAB, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        out.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
    return out


def collate(features: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Right padding to the batch's longest row (labels -100, attention mask 0)."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), width), PAD)
    labels = torch.full((len(features), width), -100)
    mask = torch.zeros((len(features), width), dtype=torch.long)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(f["input_ids"]), torch.tensor(f["labels"]), 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def ds_config(stage: int, *, offload: bool = False) -> dict[str, Any]:
    """The tutorial's ds_config shape: everything the arguments decide left "auto"."""
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": "auto"}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto")
    return {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}},
            "zero_optimization": zero, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}


def arguments(cls: type, out: Path, *, micro: int, accum: int, max_steps: int = 4, **extra: Any) -> Any:
    settings = dict(output_dir=str(out), per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
                    learning_rate=3e-3, weight_decay=0.01, max_grad_norm=0.5, warmup_steps=1,
                    lr_scheduler_type="linear", max_steps=max_steps, logging_steps=1, save_strategy="no",
                    report_to=[], seed=0, train_sampling_strategy="sequential", remove_unused_columns=False,
                    disable_tqdm=True)
    return cls(**{**settings, **extra})


# eval_loss depends on the eval batch by transformers' design (each eval step's loss is its batch's mean; at
# world > 1 transformers weights the steps by their tokens across ranks for models that take loss kwargs,
# as Llama does): one row per device, fixed, so every run compared here evaluates the same batches
EVAL = {"per_device_eval_batch_size": 1}


def reference_trainer(**kwargs: Any) -> Any:
    """transformers' own Trainer (no DeepSpeed), its AdamW decaying every trainable parameter: what
    DeepSpeed does with the ds_config's optimizer section (one group over the parameters transformers
    passes it; transformers alone leaves biases and norms undecayed), so the reference and ours (and
    real DeepSpeed + transformers, the recorded fixture) apply weight decay alike."""
    import transformers

    class DecayAll(transformers.Trainer):
        def get_decay_parameter_names(self, model: Any) -> list[str]:
            return [name for name, p in model.named_parameters() if p.requires_grad]

    return DecayAll(**kwargs)


def logged(trainer: Any) -> list[dict[str, float]]:
    return [{k: float(v) for k, v in h.items() if k in ("loss", "grad_norm", "learning_rate", "step")}
            for h in trainer.state.log_history if "loss" in h]


def reference(out: Path, *, micro: int, accum: int, **extra: Any) -> dict[str, Any]:
    """transformers' own Trainer without DeepSpeed: its logs and its eval_loss after training."""
    import transformers

    args = arguments(transformers.TrainingArguments, out, micro=micro, accum=accum, **EVAL, **extra)
    trainer = reference_trainer(model=tiny_llama(), args=args, train_dataset=rows(), data_collator=collate)
    trainer.train()
    with torch.no_grad():
        logits = trainer.model(**probe_batch()).logits
    return {"logs": logged(trainer), "eval_loss": trainer.evaluate(eval_dataset=rows(8))["eval_loss"],
            "logits": logits.tolist()}


def our_trainer(out: Path, *, stage: int, micro: int, accum: int, offload: bool = False, **extra: Any) -> Any:
    from deepshard.compat.transformers import Trainer, TrainingArguments

    extra.setdefault("deepspeed", ds_config(stage, offload=offload))
    args = arguments(TrainingArguments, out, micro=micro, accum=accum, **extra)
    return Trainer(model=tiny_llama(), args=args, train_dataset=rows(), data_collator=collate)


def ours(out: Path, *, stage: int, micro: int, accum: int, **extra: Any) -> dict[str, Any]:
    trainer = our_trainer(out, stage=stage, micro=micro, accum=accum, **EVAL, **extra)
    trainer.train()
    assert trainer.ds_engine is not None and trainer.ds_engine.engine.config.zero.stage == stage
    with torch.no_grad():
        logits = trainer.ds_engine(**probe_batch()).logits
    return {"logs": logged(trainer), "eval_loss": trainer.evaluate(eval_dataset=rows(8))["eval_loss"],
            "logits": logits.tolist()}


def probe_batch() -> dict[str, torch.Tensor]:
    return collate(rows(52)[48:])


def lifecycle(tmp: str) -> dict[str, Any]:
    """World 2, ZeRO-3: train 4 steps saving checkpoint-2 and checkpoint-4, evaluate, save_model; a
    fresh Trainer resumed from checkpoint-2.  Rank 0 loads the saved model with from_pretrained and
    measures its logits against the engine's."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    out = Path(tmp)
    full = our_trainer(out / "run", stage=3, micro=2, accum=2, save_strategy="steps", save_steps=2, **EVAL)
    full.train()
    eval_loss = full.evaluate(eval_dataset=rows(8))["eval_loss"]
    predict_loss = full.predict(rows(8)).metrics["test_loss"]
    full.save_model(str(out / "final"))
    with torch.no_grad():
        ours_logits = full.ds_engine(**probe_batch()).logits
    gap = None
    if dist.get_rank() == 0:
        loaded = AutoModelForCausalLM.from_pretrained(str(out / "final"))
        with torch.no_grad():
            gap = (loaded(**probe_batch()).logits - ours_logits).abs().max().item()
    resumed = our_trainer(out / "resumed", stage=3, micro=2, accum=2, **EVAL)
    resumed.train(resume_from_checkpoint=str(out / "run" / "checkpoint-2"))
    return {"full": logged(full), "resumed": logged(resumed), "eval_loss": eval_loss, "predict_loss": predict_loss, "logit_gap": gap,
            "checkpoints": sorted(p.name for p in (out / "run").glob("checkpoint-*")),
            "files": sorted(p.name for p in (out / "run" / "checkpoint-2").iterdir())}


def resume_at_world1(tmp: str) -> list[dict[str, float]]:
    """The world-2 ZeRO-3 checkpoint-2 resumed at world 1, ZeRO 0 (micro 4: the same rows per step)."""
    trainer = our_trainer(Path(tmp) / "resumed_w1", stage=0, micro=4, accum=2)
    trainer.train(resume_from_checkpoint=str(Path(tmp) / "run" / "checkpoint-2"))
    return logged(trainer)


def lora_llama():
    """The tiny Llama with LoRA on q/v (random B, so the adapter's values matter from step 0)."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                   lora_dropout=0.0, init_lora_weights=False))


def lora_reference(out: Path) -> dict[str, Any]:
    """transformers' own Trainer on the LoRA model, one process: logs and held-out logits."""
    import transformers

    args = arguments(transformers.TrainingArguments, out, micro=4, accum=2)
    trainer = reference_trainer(model=lora_llama(), args=args, train_dataset=rows(), data_collator=collate)
    trainer.train()
    with torch.no_grad():
        logits = trainer.model(**probe_batch()).logits
    return {"logs": logged(trainer), "logits": logits.tolist()}


def lora_ours(out: Path) -> dict[str, Any]:
    """Ours at ZeRO-3 on the LoRA model; save_model() writes the adapter, which rank 0 loads with
    PeftModel.from_pretrained on a fresh base (its logits against the engine's)."""
    import torch.distributed as dist
    from peft import PeftModel

    from deepshard.compat.transformers import Trainer, TrainingArguments

    args = arguments(TrainingArguments, out, micro=2, accum=2, deepspeed=ds_config(3))
    trainer = Trainer(model=lora_llama(), args=args, train_dataset=rows(), data_collator=collate)
    trainer.train()
    trainer.save_model(str(out / "adapter"))
    with torch.no_grad():
        logits = trainer.ds_engine(**probe_batch()).logits
    gap = None
    if dist.get_rank() == 0:
        loaded = PeftModel.from_pretrained(tiny_llama(), str(out / "adapter"))
        with torch.no_grad():
            gap = (loaded(**probe_batch()).logits - logits).abs().max().item()
    return {"logs": logged(trainer), "logits": logits.tolist(), "loaded_gap": gap,
            "files": sorted(p.name for p in (out / "adapter").iterdir())}


def from_json_file(out: Path) -> list[dict[str, float]]:
    """transformers' documented ZeRO-2 config with a WarmupDecayLR section, all "auto", as a JSON path."""
    import json

    ds = {**ds_config(2), "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "ds_config.json").write_text(json.dumps(ds))
    trainer = our_trainer(out, stage=2, micro=4, accum=2, deepspeed=str(out / "ds_config.json"),
                          report_to=["tensorboard"])
    trainer.train()
    return logged(trainer)


SHORT_LAST = {"max_steps": -1, "num_train_epochs": 1}  # 12 batches of 4 at accumulation 5: the last step has 2


def short_last_reference(out: Path) -> list[dict[str, float]]:
    import transformers

    args = arguments(transformers.TrainingArguments, out, micro=4, accum=5, **SHORT_LAST)
    trainer = reference_trainer(model=tiny_llama(), args=args, train_dataset=rows(), data_collator=collate)
    trainer.train()
    return logged(trainer)


def short_last_ours(out: Path) -> list[dict[str, float]]:
    trainer = our_trainer(out, stage=0, micro=4, accum=5, **SHORT_LAST)
    trainer.train()
    return logged(trainer)


def world1(tmp: str) -> dict[str, Any]:
    """The reference (micro 4 x accumulation 2) and ours at ZeRO 0 and 3 with the same batches; then
    world 2's checkpoint (in ``tmp``) resumed here."""
    out = Path(tmp)
    return {"reference": reference(out / "ref", micro=4, accum=2),
            **{f"zero{s}": ours(out / f"w1z{s}", stage=s, micro=4, accum=2) for s in (0, 3)},
            # the tutorial's fp16=True: on a CPU-only host the engine trains in fp32 (one notice)
            "zero2_fp16": ours(out / "w1z2fp16", stage=2, micro=4, accum=2, fp16=True),
            "resumed_w1": resume_at_world1(tmp), "lora_reference": lora_reference(out / "lora_ref"),
            "json_file": from_json_file(out / "json"),
            "short_last_reference": short_last_reference(out / "short_ref"), "short_last": short_last_ours(out / "short")}


def world2(tmp: str) -> dict[str, list[dict[str, float]]]:
    """Ours at 2 ranks, micro 2 each: rank r takes batches r, r+2, ... of 2 rows, so a step sees the
    reference's rows.  transformers' own Trainer with DDP on the same 2 ranks gives the eval_loss to
    compare with (transformers' eval_loss at 2 ranks is not its 1-rank value)."""
    out = Path(tmp)
    return {"ddp": reference(out / "ddp", micro=2, accum=2, use_cpu=True),
            **{f"zero{s}": ours(out / f"w2z{s}", stage=s, micro=2, accum=2) for s in (0, 2, 3)},
            # one row per micro-batch, 4 of them per rank: each step still sees the reference's 8 rows
            "zero2_accum4": ours(out / "w2z2a4", stage=2, micro=1, accum=4),
            "zero3_offload": ours(out / "w2z3off", stage=3, micro=2, accum=2, offload=True),
            "zero3_ac": ours(out / "w2z3ac", stage=3, micro=2, accum=2, activation_checkpointing=True),
            "lora": lora_ours(out / "lora"),
            **lifecycle(tmp)}
