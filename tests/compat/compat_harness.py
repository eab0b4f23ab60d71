"""The DeepSpeed user's loop (issue 16) with a tiny HF LlamaForCausalLM, run three ways on each rank:
``deepshard.compat.deepspeed``, deepshard's native API with a hand-written EngineConfig, and real
DeepSpeed (the bench extra).  Each returns this rank's per-micro-batch losses."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parents[1] / "finetune_app" / "fixtures"
SEQ = 16
WORDS = ("the cat sat on a warm mat while rain fell outside and the dog slept near the door "
         "every morning birds sang songs about rivers mountains and old stories").split()


def rows(n: int = 64) -> list[str]:
    g = torch.Generator().manual_seed(7)
    return [" ".join(WORDS[i] for i in torch.randint(len(WORDS), (int(torch.randint(4, 12, (1,), generator=g)),),
                                                     generator=g).tolist()) for _ in range(n)]


def tokenizer():
    from deepshard.finetune.data.tokenizer import load_tokenizer

    return load_tokenizer()  # the project's embedded byte-level BPE, as a PreTrainedTokenizerFast


def tiny_llama(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="eager")
    return LlamaForCausalLM(cfg)


def ds_config(name: str, *, for_deepspeed: bool = False) -> dict:
    ds = json.loads((FIXTURES / f"{name}.json").read_text())
    if for_deepspeed:  # real DeepSpeed on this CPU: fp32 (we fall back the same way), no side outputs
        ds.pop("fp16", None)
        ds.pop("tensorboard", None)
        ds.pop("comms_logger", None)
        ds["steps_per_print"] = 10**9
    return ds


def batches(rank: int, world: int, micro: int, n_micro: int, device):
    """This rank's micro-batches: the loop's ``tokenizer(batch["text"], return_tensors="pt")``."""
    tok = tokenizer()
    data = rows()
    for i in range(n_micro):
        start = (i * world + rank) * micro
        text = data[start:start + micro]
        inputs = tok(text, return_tensors="pt", padding="max_length", truncation=True, max_length=SEQ)
        labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
        inputs.pop("token_type_ids", None)
        yield {**{k: v.to(device) for k, v in inputs.items()}, "labels": labels.to(device)}


def _quiet() -> None:
    sys.stdout.flush()
    os.dup2(2, 1)


def compat_loop(name: str, n_micro: int) -> list[float]:
    """The issue's loop, verbatim but for the import."""
    import deepshard.compat.deepspeed as deepspeed

    deepspeed.init_distributed()
    model = tiny_llama(len(tokenizer()))
    model_engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                         config_params=ds_config(name))
    losses = []
    for inputs in batches(model_engine.global_rank, model_engine.world_size,
                          model_engine.train_micro_batch_size_per_gpu(), n_micro, model_engine.device):
        loss = model_engine(**inputs).loss
        model_engine.backward(loss)
        model_engine.step()
        losses.append(loss.item())
    return losses


def native_config(name: str):
    """The ds_config written by hand as core's EngineConfig, and DeepSpeed's rate for each update
    (its engine applies the scheduler one update late: update k runs at the value for iteration k-1,
    the first at warmup_min_lr; worked out from deepspeed/runtime/lr_schedules.py's formulas)."""
    from deepshard.core import EngineConfig, OptimConfig, SchedulerConfig, ZeroConfig

    if name == "ds_zero2_fp16":  # fp16 -> fp32 on this CPU-only host
        return EngineConfig(zero=ZeroConfig(stage=2), grad_accum=2,
                            optim=OptimConfig(lr=1e-3, betas=(0.8, 0.999), eps=1e-8, weight_decay=3e-7, grad_clip=1.0),
                            scheduler=SchedulerConfig(name="WarmupLR", warmup_min_lr=0.0, warmup_max_lr=1e-3,
                                                      warmup_num_steps=2, warmup_type="log")), 4, False, \
            [0.0, 0.0] + [1e-3] * 8
    assert name == "ds_zero3_offload"
    return EngineConfig(zero=ZeroConfig(stage=3), grad_accum=1,
                        optim=OptimConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, grad_clip=1.0),
                        scheduler=SchedulerConfig(name="WarmupDecayLR", warmup_min_lr=0.0, warmup_max_lr=1e-3,
                                                  warmup_num_steps=2, total_num_steps=6, warmup_type="log")), 4, True, \
        [0.0, 0.0, 1e-3, 1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0, 0.0]


def native_loop(name: str, n_micro: int) -> list[float]:
    from deepshard.core import DeviceStateStore, init_distributed, initialize
    from deepshard.core.mesh import local_device
    from deepshard.core.zero import CpuParamOffload
    from deepshard.offload import CpuStateStore

    rank, world = init_distributed()
    config, micro, offload, ds_lrs = native_config(name)
    model = tiny_llama(len(tokenizer())).to(local_device())
    engine = initialize(model, config, blocks=model.model.layers,
                        store_factory=CpuStateStore if offload else DeviceStateStore,
                        offload_params=CpuParamOffload() if offload else None)
    ours = [engine.optimizer.lr_at(k) for k in range(len(ds_lrs))]  # core's schedule, no override
    assert max(abs(a - b) for a, b in zip(ours, ds_lrs)) < 1e-15, (ours, ds_lrs)
    losses = []
    for inputs in batches(rank, world, micro, n_micro, local_device()):
        loss = engine(**inputs).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def deepspeed_loop(name: str, n_micro: int) -> list[float]:
    _quiet()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    model = tiny_llama(len(tokenizer()))
    decay = [p for p in model.parameters() if p.dim() >= 2]  # our AdamW decays matrices only
    groups = [{"params": decay}, {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    ds = ds_config(name, for_deepspeed=True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=ds)
    losses = []
    for inputs in batches(engine.global_rank, engine.world_size, engine.train_micro_batch_size_per_gpu(),
                          n_micro, engine.device):
        loss = engine(**inputs).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def all_loops(name: str, n_micro: int, with_deepspeed: bool) -> dict[str, list[float]]:
    """One launch: each loop in its own process group would cost a launch each, so the ranks run the
    compat and native loops one after the other in the same group (fresh models, same seeds)."""
    out = {"compat": compat_loop(name, n_micro), "native": native_loop(name, n_micro)}
    if with_deepspeed:
        out["deepspeed"] = deepspeed_loop(name, n_micro)
    return out
