"""DeepSpeed-Chat's step-1 SFT (applications/DeepSpeed-Chat/training/step1_supervised_finetuning/main.py
and the dschat/utils helpers it calls), run per rank with ``deepspeed`` given as a parameter (default:
``import deepshard.compat.deepspeed as deepspeed``; bench/record_ds_more_scripts.py passes real DeepSpeed).

Kept as the original: parse_args (its flags, plus add_config_arguments), ``get_accelerator().set_device``,
``init_distributed``, ``get_train_ds_config`` (ZeRO stage, overlap_comm, the stage-3 persistence and
bucket keys, gradient_clipping 1.0...), ``set_random_seed``, ``create_hf_model`` (AutoConfig +
configure_dropout + from_pretrained + resize_token_embeddings), DistributedSampler loaders with
default_data_collator, ``evaluation`` (perplexity, get_all_reduce_mean), ``get_optimizer_grouped_parameters``
(three groups: decay / lora / no-decay by name), FusedAdam (DeepSpeedCPUAdam with --offload),
``transformers.get_scheduler``, ``deepspeed.initialize(model, optimizer, args, config, lr_scheduler,
dist_init_required=True)``, ``model.gradient_checkpointing_enable()``, ``model.backward / model.step``,
``model.tput_timer.update_epoch_count()``, ``save_hf_format`` and ``save_zero_three_model``
(GatheredParameters over ``ds_id`` parameters whose ``ds_status`` is NOT_AVAILABLE).

Lines changed, and why:
  - ``import deepspeed`` -> ``deepspeed`` parameter (the one import); ``deepspeed.ops.adam`` and
    ``...zero.partition_parameters`` are read from that module;
  - the model: a tiny OPT (2 layers, hidden 16, vocab 64) written by ``write_tiny_opt`` to a local
    directory instead of facebook/opt-1.3b from the hub (offline); ``load_hf_tokenizer`` -> ``TinyTokenizer``
    (64 ids, eos 2, ``save_vocabulary``): no tokenizer files offline;
  - ``HfDeepSpeedConfig(ds_config)`` in create_hf_model dropped: it makes transformers' from_pretrained
    build under real DeepSpeed's zero.Init, which a tiny model does not need and ours does not hook;
  - ``create_prompt_dataset`` (Dahoas/rm-static from the hub) -> ``sft_rows``: rows of random token ids
    padded with eos to max_seq_len, labels -100 on the padding, the dataset's own row layout;
  - ``--dtype`` gains ``fp32`` (get_train_ds_config then enables neither fp16 nor bf16): the comparison
    is fp32 on CPU (DeepSpeed trains no fp16 there);
  - ``print_throughput(...)`` and the ``print_rank_0`` / ``--print_loss`` prints dropped; ``main`` returns
    the per-step losses and the evaluations (perplexity, loss) before and after each epoch;
  - ``argv`` and ``deepspeed`` are parameters of ``main`` (the original reads sys.argv).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import random

import numpy as np
import torch
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    SchedulerType,
    default_data_collator,
    get_scheduler,
    set_seed,
)

import deepshard.compat.deepspeed as ours

VOCAB, SEQ = 64, 16


def ds_module(deepspeed, name: str):
    """``deepspeed.<name>`` as ``from deepspeed.<name> import ...`` would load it."""
    return importlib.import_module(f"{deepspeed.__name__}.{name}")


class TinyTokenizer:
    """What the script reads of a tokenizer: eos/pad ids, its length, save_vocabulary."""

    eos_token_id = pad_token_id = 2
    eos_token = "</s>"

    def __len__(self) -> int:
        return VOCAB

    def save_vocabulary(self, output_dir: str) -> tuple[str]:
        path = os.path.join(output_dir, "vocab.json")
        with open(path, "w") as f:
            json.dump({f"<{i}>": i for i in range(VOCAB)}, f)
        return (path,)


def write_tiny_opt(path: str) -> None:
    """The 'pretrained' model every side loads (rank 0 writes it before the script runs)."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(7)
    config = OPTConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, ffn_dim=32, num_attention_heads=2,
                       max_position_embeddings=SEQ + 8, word_embed_proj_dim=16, dropout=0.1,
                       eos_token_id=2, pad_token_id=1, bos_token_id=2)
    OPTForCausalLM(config).save_pretrained(path, safe_serialization=True)


def sft_rows(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(6, SEQ + 1, (1,), generator=g))
        ids = torch.full((SEQ,), TinyTokenizer.eos_token_id)
        ids[:length] = torch.randint(3, VOCAB, (length,), generator=g)
        mask = (torch.arange(SEQ) < length).long()
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)})
    return rows


def parse_args(argv, deepspeed):
    parser = argparse.ArgumentParser(description="Finetune a transformers model on a causal language modeling task")
    parser.add_argument("--data_path", nargs="*", default=["Dahoas/rm-static"])
    parser.add_argument("--data_split", type=str, default="2,4,4")
    parser.add_argument("--sft_only_data_path", nargs="*", default=[])
    parser.add_argument("--data_output_path", type=str, default="/tmp/data_files/")
    parser.add_argument("--model_name_or_path", type=str, required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=16)
    parser.add_argument("--max_seq_len", type=int, default=512)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr_scheduler_type", type=SchedulerType, default="cosine",
                        choices=["linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                                 "constant_with_warmup"])
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument("--output_dir", type=str, default=None)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--dropout", type=float, default=None)
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--dtype", type=str, default="fp16", choices=["fp16", "bf16", "fp32"])  # changed: fp32
    parser.add_argument("--zero_stage", type=int, default=0)
    parser.add_argument("--lora_dim", type=int, default=0)
    parser.add_argument("--lora_module_name", type=str, default="decoder.layers.")
    parser.add_argument("--only_optimize_lora", action="store_true")
    parser.add_argument("--lora_learning_rate", type=float, default=5e-4)
    parser.add_argument("--compute_fp32_loss", action="store_true")
    parser.add_argument("--print_loss", action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def get_train_ds_config(offload, dtype, stage=2, global_batch=32, micro_batch=4):
    device = "cpu" if offload else "none"
    if dtype == "fp16":
        data_type, dtype_config = "fp16", {"enabled": True, "loss_scale_window": 100}
    elif dtype == "bf16":
        data_type, dtype_config = "bfloat16", {"enabled": True}
    else:  # changed: fp32
        data_type, dtype_config = "fp16", {"enabled": False}
    zero_opt_dict = {"stage": stage, "overlap_comm": True, "offload_param": {"device": device},
                     "offload_optimizer": {"device": device}, "stage3_param_persistence_threshold": 1e4,
                     "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7,
                     "memory_efficient_linear": False}
    return {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": micro_batch, "steps_per_print": 10,
            "zero_optimization": zero_opt_dict, data_type: dtype_config, "gradient_clipping": 1.0,
            "prescale_gradients": False, "wall_clock_breakdown": False}


def to_device(batch, device):
    output = {}
    for k, v in batch.items():
        try:
            output[k] = v.to(device)
        except Exception:
            output[k] = v
    return output


def set_random_seed(seed, get_accelerator):
    if seed is not None:
        set_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        get_accelerator().manual_seed_all(seed)


def get_all_reduce_mean(tensor):
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return tensor / torch.distributed.get_world_size()


def configure_dropout(model_config, dropout):
    if dropout is not None:
        for key in ("dropout", "attention_dropout", "hidden_dropout", "activation_dropout"):
            if hasattr(model_config, key):
                setattr(model_config, key, dropout)


def create_hf_model(model_class, model_name_or_path, tokenizer, ds_config=None, dropout=None):
    model_config = AutoConfig.from_pretrained(model_name_or_path)
    configure_dropout(model_config, dropout)
    model = model_class.from_pretrained(model_name_or_path, config=model_config)
    model.config.end_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = model.config.eos_token_id
    model.resize_token_embeddings(int(8 * math.ceil(len(tokenizer) / 8.0)))
    return model


def get_optimizer_grouped_parameters(model, weight_decay, lora_lr=5e-4,
                                     no_decay_name_list=("bias", "layer_norm.weight", "layernorm.weight",
                                                         "norm.weight", "ln_f.weight"),
                                     lora_name_list=("lora_right_weight", "lora_left_weight")):
    def no_decay(n):
        return any(nd in n.lower() for nd in no_decay_name_list)

    def lora(n):
        return any(nd in n.lower() for nd in lora_name_list)

    groups = [
        {"params": [p for n, p in model.named_parameters() if not no_decay(n) and p.requires_grad and not lora(n)],
         "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters() if not no_decay(n) and p.requires_grad and lora(n)],
         "weight_decay": weight_decay, "lr": lora_lr},
        {"params": [p for n, p in model.named_parameters() if no_decay(n) and p.requires_grad],
         "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def save_hf_format(model, tokenizer, args, sub_folder=""):
    model_to_save = model.module if hasattr(model, "module") else model
    output_dir = os.path.join(args.output_dir, sub_folder)
    os.makedirs(output_dir, exist_ok=True)
    save_dict = model_to_save.state_dict()
    for key in list(save_dict.keys()):
        if "lora" in key:
            del save_dict[key]
    torch.save(save_dict, os.path.join(output_dir, "pytorch_model.bin"))
    model_to_save.config.to_json_file(os.path.join(output_dir, "config.json"))
    tokenizer.save_vocabulary(output_dir)


def save_zero_three_model(model_ema, global_rank, save_dir, deepspeed, zero_stage=0):
    status = ds_module(deepspeed, "runtime.zero.partition_parameters").ZeroParamStatus

    def z3_params_to_fetch(param_list):
        return [p for p in param_list if hasattr(p, "ds_id") and p.ds_status == status.NOT_AVAILABLE]

    zero_stage_3 = zero_stage == 3
    os.makedirs(save_dir, exist_ok=True)
    output_model_file = os.path.join(save_dir, "pytorch_model.bin")
    model_to_save = model_ema.module if hasattr(model_ema, "module") else model_ema
    if not zero_stage_3:
        if global_rank == 0:
            torch.save(model_to_save.state_dict(), output_model_file)
    else:
        output_state_dict = {}
        for k, v in model_to_save.named_parameters():
            if hasattr(v, "ds_id"):
                with deepspeed.zero.GatheredParameters(z3_params_to_fetch([v]), enabled=zero_stage_3):
                    v_p = v.data.cpu()
            else:
                v_p = v.cpu()
            if global_rank == 0 and "lora" not in k:
                output_state_dict[k] = v_p
        if global_rank == 0:
            torch.save(output_state_dict, output_model_file)
        del output_state_dict


def main(argv, deepspeed=ours):
    get_accelerator = deepspeed.accelerator.get_accelerator
    args = parse_args(argv, deepspeed)
    if args.local_rank == -1:
        device = torch.device(get_accelerator().device_name())
    else:
        get_accelerator().set_device(args.local_rank)
        device = torch.device(get_accelerator().device_name(), args.local_rank)
        deepspeed.init_distributed()
    args.global_rank = torch.distributed.get_rank()

    ds_config = get_train_ds_config(offload=args.offload, dtype=args.dtype, stage=args.zero_stage)
    ds_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    ds_config["train_batch_size"] = (args.per_device_train_batch_size * torch.distributed.get_world_size()
                                     * args.gradient_accumulation_steps)
    set_random_seed(args.seed, get_accelerator)
    torch.distributed.barrier()

    tokenizer = TinyTokenizer()
    model = create_hf_model(AutoModelForCausalLM, args.model_name_or_path, tokenizer, ds_config, dropout=args.dropout)

    train_dataset, eval_dataset = sft_rows(64, seed=11), sft_rows(16, seed=12)
    if args.local_rank == -1:
        train_sampler, eval_sampler = RandomSampler(train_dataset), SequentialSampler(eval_dataset)
    else:
        train_sampler, eval_sampler = DistributedSampler(train_dataset), DistributedSampler(eval_dataset)
    train_dataloader = DataLoader(train_dataset, collate_fn=default_data_collator, sampler=train_sampler,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator, sampler=eval_sampler,
                                 batch_size=args.per_device_eval_batch_size)

    def evaluation(model, eval_dataloader):
        model.eval()
        losses = 0
        for step, batch in enumerate(eval_dataloader):  # noqa: B007 - read after the loop
            batch = to_device(batch, device)
            with torch.no_grad():
                outputs = model(**batch)
            losses += outputs.loss.float()
        losses = losses / (step + 1)
        try:
            losses = get_all_reduce_mean(losses)
        except Exception:
            pass
        try:
            perplexity = torch.exp(losses).item()
        except OverflowError:
            perplexity = float("inf")
        return perplexity, losses.item()

    optimizer_grouped_parameters = get_optimizer_grouped_parameters(model, args.weight_decay, args.lora_learning_rate)
    adam = ds_module(deepspeed, "ops.adam")
    AdamOptimizer = adam.DeepSpeedCPUAdam if args.offload else adam.FusedAdam  # noqa: N806 - the script's name
    optimizer = AdamOptimizer(optimizer_grouped_parameters, lr=args.learning_rate, betas=(0.9, 0.95))
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    lr_scheduler = get_scheduler(name=args.lr_scheduler_type, optimizer=optimizer,
                                 num_warmup_steps=args.num_warmup_steps,
                                 num_training_steps=args.num_train_epochs * num_update_steps_per_epoch)
    model, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args,
                                                             config=ds_config, lr_scheduler=lr_scheduler,
                                                             dist_init_required=True)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()

    out = {"losses": [], "evals": [evaluation(model, eval_dataloader)], "lrs": []}
    for epoch in range(args.num_train_epochs):  # noqa: B007
        model.train()
        for step, batch in enumerate(train_dataloader):  # noqa: B007
            batch = to_device(batch, device)
            outputs = model(**batch, use_cache=False)
            loss = outputs.loss
            model.backward(loss)
            model.step()
            out["losses"].append(loss.item())
        out["lrs"].append(lr_scheduler.get_last_lr()[0])
        out["evals"].append(evaluation(model, eval_dataloader))
        model.tput_timer.update_epoch_count()

    if args.output_dir is not None:
        if args.global_rank == 0:
            save_hf_format(model, tokenizer, args)
        if args.zero_stage == 3:
            save_zero_three_model(model, args.global_rank, args.output_dir, deepspeed, zero_stage=args.zero_stage)
    return out


def sft_argv(model_dir: str, output_dir: str, stage: int = 3) -> list[str]:
    """The run here and in the recorder: DeepSpeed-Chat's run_1.3b.sh flags on the tiny model, fp32."""
    return ["--model_name_or_path", model_dir, "--per_device_train_batch_size", "4",
            "--per_device_eval_batch_size", "4", "--max_seq_len", str(SEQ), "--learning_rate", "1e-2",
            "--weight_decay", "0.1", "--num_train_epochs", "2", "--gradient_accumulation_steps", "2",
            "--lr_scheduler_type", "cosine", "--num_warmup_steps", "2", "--seed", "1234",
            "--gradient_checkpointing", "--zero_stage", str(stage), "--dtype", "fp32", "--dropout", "0.0",
            "--deepspeed", "--output_dir", output_dir, "--local_rank", os.environ.get("LOCAL_RANK", "0")]
