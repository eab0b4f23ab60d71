"""A PEFT LoRA adapter folder (``peft.init_from=DIR``) read into our model: its settings checked
against the run's before start, its weights copied into the adapters (plain or sharded params).
Safetensors only: pickled ``.bin`` adapters are never loaded."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from deepshard.core.dtensor_utils import copy_global
from deepshard.finetune.models.hf import from_hf_name
from deepshard.finetune.models.lora import LoraConfig, is_adapter

PEFT_PREFIX = "base_model.model."


def check_init_from(path: str, lora: LoraConfig) -> None:
    """``peft.init_from=DIR`` before start: a PEFT LoRA folder whose settings match this run's."""
    cfg_file = Path(path).expanduser() / "adapter_config.json"
    if not cfg_file.is_file():
        raise ValueError(f"peft.init_from={path!r}: no adapter_config.json there (expected a PEFT adapter folder, "
                         f"e.g. one written by export --adapter or PeftModel.save_pretrained)")
    try:
        c = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({e})") from None
    if c.get("peft_type") != "LORA":
        raise ValueError(f"peft.init_from={path!r}: peft_type={c.get('peft_type')!r}; only LORA adapters load")
    targets = c.get("target_modules") or []
    for key, theirs, ours in (("peft.r", c.get("r"), lora.r), ("peft.alpha", c.get("lora_alpha"), lora.alpha),
                              ("peft.target_modules", sorted(targets), sorted(lora.target_modules))):
        if theirs != ours:
            raise ValueError(f"peft.init_from={path!r}: the adapter has {key.split('.')[1]}={theirs!r} but "
                             f"{key}={ours!r}; set {key} to match")
    if not any((Path(path).expanduser() / n).is_file() for n in ("adapter_model.safetensors",)):
        raise ValueError(f"peft.init_from={path!r}: no adapter_model.safetensors there (pickled .bin adapters "
                         f"are never loaded)")


@torch.no_grad()
def load_peft_adapter(model: nn.Module, path: str) -> int:
    """Copy a PEFT adapter folder's weights into ``model``'s adapters (plain or ZeRO-3 shards); returns
    the number of tensors loaded.  PEFT's keys are transformers' names, read by ``model``'s family (the
    transformers path's are not the decoder's ``model.`` + ours); AC's wrapper is not in them."""
    from peft.utils import load_peft_weights

    from deepshard.finetune.models.registry import spec_of

    cfg = getattr(model, "cfg", None)
    to_ours = spec_of(cfg).hf.from_hf_name if cfg is not None else from_hf_name
    weights = load_peft_weights(str(Path(path).expanduser()), device="cpu")
    params = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in model.named_parameters()}
    wanted = {n for n, p in params.items() if p.requires_grad}
    loaded = set()
    for key, t in weights.items():
        if not key.startswith(PEFT_PREFIX):
            raise ValueError(f"peft.init_from={path!r}: key {key!r} is not a PEFT causal-LM adapter key")
        name = to_ours(key[len(PEFT_PREFIX):]).replace(".modules_to_save", "")
        if name not in wanted:
            raise ValueError(f"peft.init_from={path!r}: {key!r} has no trainable place in this run "
                             f"(check peft.target_modules / peft.modules_to_save)")
        if tuple(t.shape) != tuple(params[name].shape):
            raise ValueError(f"peft.init_from={path!r}: {key} has shape {list(t.shape)}, this run expects "
                             f"{list(params[name].shape)}")
        copy_global(params[name], t)
        loaded.add(name)
    missing = sorted(n for n in wanted - loaded if is_adapter(n))
    if missing:
        raise ValueError(f"peft.init_from={path!r}: no weights for {missing[:3]}")
    return len(loaded)
