"""What the HF-stack scripts of issue 41 run on: a local tiny Llama with a tokenizer and chat template
(no download), chat rows in TRL's conversational prompt-completion form, and the ds_configs (the
tutorial's all-"auto" shape of hf_trainer_harness.py, at ZeRO-2 and at ZeRO-3 with optimizer offload)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from tests.compat.hf_trainer_harness import ds_config


def run_launcher(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    """A launcher command (``deepshard``, ``torchrun``, ``accelerate launch``) in its own process group,
    one thread per worker, stopped with its workers on any failure (a timeout too)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

# the app's embedded byte-level BPE and chat template, by path (the DeepSpeed recorder's venv lacks our packages)
ASSETS = Path(__file__).resolve().parents[2] / "apps" / "finetune" / "src" / "deepshard" / "finetune" / "assets"
THINGS = ["apples", "pears", "cups", "books", "stones", "boats", "keys", "birds"]
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven"]


def write_ds_config(path: Path, stage: int, *, optimizer: bool = True) -> str:
    """ZeRO-2, or ZeRO-3 with the optimizer offloaded to the CPU and the weights gathered on save (the
    layouts of the issue and of bench/record_hf_trainer_ds.py).  ``optimizer=False``: no optimizer section,
    as TRL's and accelerate's stock configs have none (Trainer's own AdamW and decay groups then go to
    ``deepspeed.initialize``, and its scheduler is built over the optimizer that returns)."""
    config = ds_config(stage, offload=stage == 3)
    if not optimizer:
        del config["optimizer"]
    if stage == 3:
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    path.write_text(json.dumps(config))
    return str(path)


def chat_rows(n: int = 32) -> list[dict[str, Any]]:
    """Prompt-completion conversations of uneven length: the loss is on the assistant's completion only."""
    rows = []
    for i in range(n):
        a, b = i % 7 + 1, (3 * i) % 5
        thing = THINGS[i % len(THINGS)]
        prompt = [{"role": "user", "content": f"alice has {WORDS[a]} {thing}. bob gives her {WORDS[b]}. "
                                              f"how many {thing} now?"}]
        if i % 3 == 0:
            prompt.insert(0, {"role": "system", "content": "you count things."})
        rows.append({"prompt": prompt,
                     "completion": [{"role": "assistant", "content": f"{WORDS[a + b]} {thing}."}]})
    return rows


def preference_rows(n: int = 32) -> list[dict[str, Any]]:
    """DPO's conversational preference form: each chat row's prompt with the right count chosen and a
    wrong one (of another length) rejected."""
    out = []
    for i, row in enumerate(chat_rows(n)):
        right = row["completion"][0]["content"]
        count, thing = right.split(" ", 1)
        wrong = WORDS[(WORDS.index(count) + 1 + i % 3) % len(WORDS)]
        rejected = f"{wrong} {thing}" if i % 2 else f"i think {wrong} {thing}"
        out.append({"prompt": row["prompt"], "chosen": row["completion"],
                    "rejected": [{"role": "assistant", "content": rejected}]})
    return out


def make_model_dir(path: Path) -> str:
    """A tiny LlamaForCausalLM (seed 0) saved with the app's embedded byte-level tokenizer and chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    asset = ASSETS / "tokenizer.json"
    tok = PreTrainedTokenizerFast(tokenizer_file=str(asset), bos_token="<|bos|>", eos_token="<|eos|>",
                                  pad_token="<|pad|>", chat_template=(asset.parent / "chat_template.jinja").read_text())
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def make_id_model_dir(path: Path) -> str:
    """hf_trainer_harness's tiny Llama (seed 0, token-id rows, no tokenizer) saved for ``from_pretrained``:
    the accelerate loop loads it by path (under ``zero.Init`` at ZeRO-3 with ``zero3_init_flag``)."""
    from tests.compat.hf_trainer_harness import tiny_llama

    tiny_llama().save_pretrained(path)
    return str(path)


def write_accelerate_config(folder: Path, stage: int) -> str:
    """accelerate's own DeepSpeed yaml, as ``accelerate config`` writes it (TRL's deepspeed_zero*.yaml shape) for
    2 processes and 2 accumulation steps: ZeRO-2 through a ``deepspeed_config_file`` (a ds_config with "auto"
    values accelerate fills), ZeRO-3 through the yaml's own keys with the optimizer offloaded to the CPU and
    ``zero3_init_flag`` (the model by path is built under ``zero.Init``)."""
    import yaml

    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": "DEEPSPEED",
        "downcast_bf16": "no", "machine_rank": 0, "main_training_function": "main",
        "num_machines": 1, "num_processes": 2, "rdzv_backend": "static", "same_network": True, "tpu_env": [],
        "tpu_use_cluster": False, "tpu_use_sudo": False, "use_cpu": False}
    if stage == 3:  # (with a deepspeed_config_file accelerate refuses mixed_precision in the yaml: the file says)
        cfg["mixed_precision"] = "no"
        cfg["deepspeed_config"] = {"deepspeed_multinode_launcher": "standard", "gradient_accumulation_steps": 2,
                                   "offload_optimizer_device": "cpu", "offload_param_device": "none",
                                   "zero3_init_flag": True, "zero3_save_16bit_model": True, "zero_stage": 3}
    else:
        ds = {"zero_optimization": {"stage": stage, "reduce_bucket_size": "auto"}, "gradient_accumulation_steps": 2,
              "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_clipping": "auto",
              "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}
        (folder / "ds_config.json").write_text(json.dumps(ds))
        cfg["deepspeed_config"] = {"deepspeed_config_file": str(folder / "ds_config.json"),
                                   "deepspeed_multinode_launcher": "standard", "zero3_init_flag": False}
    path = folder / f"accelerate_zero{stage}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def forward_only_engines() -> dict[str, Any]:
    """On each rank of a pool: ``deepspeed.initialize`` without an optimizer (TRL's reference model) at stage
    0 and at stage 3 (built under ``zero.Init`` from a saved state, as ``from_pretrained`` does), against the
    plain model's logits on this rank's rows; and what training calls answer."""
    import torch

    import deepshard.compat.deepspeed as deepspeed
    from tests.compat.hf_trainer_harness import collate, rows, tiny_llama

    batch = collate(rows(4)[2 * torch.distributed.get_rank():][:2])
    plain = tiny_llama().eval()
    with torch.no_grad():
        expected = plain(**batch).logits
    out: dict[str, Any] = {}
    for stage in (0, 3):
        config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": 2}
        if stage == 3:
            with deepspeed.zero.Init(config_dict_or_path=config):
                model = tiny_llama()
            with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
                if torch.distributed.get_rank() == 0:
                    model.load_state_dict(plain.state_dict())
        else:
            model = tiny_llama()
        engine, optimizer, loader, scheduler = deepspeed.initialize(model=model, config=config)
        engine.eval()
        with torch.no_grad():
            logits = engine(**batch).logits
        engine.destroy()  # accelerate's free_memory() (Trainer.train() after an evaluate()) calls it
        try:
            engine.backward(logits.sum())
            refused = ""
        except ValueError as err:
            refused = str(err)
        out[f"stage{stage}"] = {"gap": (logits - expected).abs().max().item(), "type": type(engine).__name__,
                                "rest": [optimizer, loader, scheduler], "refused": refused,
                                "sharded": any(type(p).__name__ == "DTensor" for p in engine.module.parameters())}
    return out


def lora_under_zero_init() -> dict[str, Any]:
    """On each rank of a pool: a tiny Llama built under ``zero.Init`` and loaded in ``GatheredParameters`` (what
    ``from_pretrained`` does at ZeRO-3), LoRA added by ``peft.get_peft_model`` (PEFT patched as the provider
    patches it), then ``initialize`` at stage 3: the adapters keep rank 0's values (A as drawn, B zero), so the
    logits are the base model's."""
    import peft
    import peft.tuners.tuners_utils as tuners
    import torch

    import deepshard.compat.deepspeed as deepspeed
    from deepshard.compat.peft_zero3 import patch_adapter_device
    from tests.compat.hf_trainer_harness import collate, rows, tiny_llama

    patch_adapter_device(tuners)
    plain = tiny_llama().eval()
    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = tiny_llama()
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if torch.distributed.get_rank() == 0:
            model.load_state_dict(plain.state_dict())
    torch.manual_seed(torch.distributed.get_rank())  # ranks draw different adapters: rank 0's must win
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    drawn = q.lora_A["default"].weight.detach().clone()
    real = all(not p.is_meta for n, p in model.named_parameters() if "lora_" in n)
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    batch = collate(rows(4)[2 * torch.distributed.get_rank():][:2])
    with torch.no_grad():
        gap = (engine(**batch).logits - plain(**batch).logits).abs().max().item()
    a = q.lora_A["default"].weight.full_tensor()
    b = q.lora_B["default"].weight.full_tensor()
    return {"real": real, "gap": gap, "b_zero": bool((b == 0).all()), "drawn": drawn.tolist(), "a": a.tolist()}
