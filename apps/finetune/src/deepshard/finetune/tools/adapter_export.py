"""LoRA checkpoints out and PEFT adapters in: ``export --adapter``, ``export --merge``, ``peft.init_from``.

A ``+peft=lora`` checkpoint holds the adapters (and ``peft.modules_to_save``) with their optimizer
state only; its manifest's ``meta`` names the LoRA settings (``peft``) and the base
(``base``: model name, HF path, seed).

- ``--adapter`` writes a PEFT adapter folder through PEFT's own API: a ``PeftModel`` over a
  meta-device transformers model of the checkpoint's family and architecture gets the adapters
  (``set_peft_model_state_dict``) and ``save_pretrained`` writes ``adapter_config.json`` and
  ``adapter_model.safetensors``; ``PeftModel.from_pretrained(base, OUT)`` loads it.
- ``--merge`` writes a full HF model (today's export format): each base weight, streamed from the
  base's safetensors (or rebuilt from the seed for a model trained from scratch), plus
  ``alpha / r * B @ A`` where it has adapters; trained modules_to_save replace their base copies.
  A QLoRA run's (``peft.base_quant=nf4``) block weights are quantized as training did and
  dequantized first: the merge is the model the adapters were trained on.
- ``peft.init_from=DIR`` loads a PEFT adapter folder (``peft.utils.load_peft_weights``) into a
  run's adapters; its ``adapter_config.json`` must match ``peft.r``/``alpha``/``target_modules``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deepshard.core.checkpoint.consolidate import load_full_tensor, tensor_infos
from deepshard.core.checkpoint.manifest import CheckpointError, read_manifest, sealed_files, verify_checkpoint
from deepshard.finetune.models import registry
from deepshard.finetune.models.hf import plan_shards, safetensors_files, write_safetensors
from deepshard.finetune.models.lora import LoraConfig

PREFIX = "model."
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def lora_meta(ckpt: str | Path) -> tuple[dict[str, Any], Any, LoraConfig, dict[str, Any]] | None:
    """(manifest, model config (its family's), LoRA settings, base reference) of a LoRA checkpoint;
    None for a full one."""
    manifest = verify_checkpoint(ckpt)
    meta = manifest.get("meta", {})
    if "peft" not in meta:
        return None
    if "model" not in meta:
        raise CheckpointError(f"checkpoint {str(ckpt)!r}: its manifest names no model architecture (meta.model)")
    p = dict(meta["peft"])
    lora = LoraConfig(r=p["r"], alpha=p["alpha"], dropout=p["dropout"], target_modules=tuple(p["target_modules"]),
                        modules_to_save=tuple(p["modules_to_save"]), base_quant=p.get("base_quant", "none"))
    base = dict(meta.get("base", {}))
    if lora.base_quant != "none":  # QLoRA: the ZeRO-3 world its NF4 scales were blocked for
        base["nf4_world"] = int(meta.get("nf4", {}).get("world", 1))
    return manifest, registry.from_meta(meta)[1], lora, base


def is_lora_checkpoint(ckpt: str | Path) -> bool:
    """Whether the manifest names LoRA settings (read only: the export that follows verifies)."""
    try:
        return "peft" in read_manifest(ckpt).get("meta", {})
    except (CheckpointError, OSError):
        return False  # the export itself reports what is wrong with it


def _need_lora(ckpt: str | Path, flag: str):
    found = lora_meta(ckpt)
    if found is None:
        raise ValueError(f"{flag}: checkpoint {str(ckpt)!r} was not trained with +peft=lora (it holds every "
                         f"weight); export it without {flag}")
    return found


def peft_config(lora: LoraConfig, base: dict[str, Any]):
    """PEFT's LoraConfig for these settings (``base_model_name_or_path``: the base's HF path, if any)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=list(lora.target_modules),
                          modules_to_save=list(lora.modules_to_save) or None,
                          base_model_name_or_path=base.get("path"), task_type="CAUSAL_LM")


def _copy_tokenizer(ckpt: Path, names: list[str], out: Path) -> bool:
    from deepshard.finetune.tools.hf_export import copy_sealed

    copy_sealed(ckpt, names, out)
    return bool(names)


def _tokenizer_files(ckpt: Path, manifest: dict[str, Any]) -> list[str]:
    """The tokenizer files the manifest lists (anything else in tokenizer/ is refused by name)."""
    from deepshard.finetune.tools.hf_export import TOKENIZER

    return sealed_files(ckpt, manifest, TOKENIZER)


def _peft_key(name: str, to_hf_name: Callable[[str], str]) -> str:
    """Our adapter's name -> its key in PEFT's adapter file: PEFT's prefix + the family's HF name (the
    transformers path's names are transformers' own, not the decoder's ``model.`` + name)."""
    return "base_model.model." + to_hf_name(name.replace("_checkpoint_wrapped_module.", ""))


def export_adapter(ckpt: str | Path, out_dir: str | Path, *, dtype: str = "fp32") -> dict[str, Any]:
    """A PEFT adapter folder from a LoRA checkpoint, written by ``PeftModel.save_pretrained``."""
    from peft import get_peft_model, set_peft_model_state_dict

    start = time.perf_counter()
    ckpt, out = Path(ckpt), Path(out_dir)
    manifest, cfg, lora, base = _need_lora(ckpt, "--adapter")
    tokenizer = _tokenizer_files(ckpt, manifest)
    hf = registry.spec_of(cfg).hf
    split = sorted(hf.split_modules([n for n, _ in registry.build_meta(cfg).named_parameters()])
                   & set(lora.target_modules))
    if split:
        raise ValueError(f"--adapter: checkpoint {str(ckpt)!r} has adapters on {split}, which the family's HF model "
                         f"holds fused (no PEFT adapter fits there); export with --merge")
    with torch.device("meta"):  # the base's weights are not needed to save adapters: no memory for them
        skeleton = hf.causal_lm(hf.config_dict(cfg))
    if base.get("path"):  # what adapter_config.json names as the base (PeftModel reads it from the model)
        skeleton.name_or_path = skeleton.config._name_or_path = str(base["path"])
    model = get_peft_model(skeleton, peft_config(lora, base), low_cpu_mem_usage=True)
    for module in model.modules():  # only what PEFT trains (adapters, modules_to_save) gets real storage
        for name, p in list(module.named_parameters(recurse=False)):
            if p.requires_grad and p.is_meta:
                module._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=DTYPES[dtype]))
    state = {_peft_key(i.key[len(PREFIX):], hf.to_hf_name): load_full_tensor(ckpt, i).to(DTYPES[dtype])
             for i in tensor_infos(ckpt, PREFIX)}
    result = set_peft_model_state_dict(model, state)
    if result.unexpected_keys:
        raise CheckpointError(f"checkpoint {str(ckpt)!r}: tensors {result.unexpected_keys[:3]} have no place in "
                              f"PEFT's model for these LoRA settings")
    missing = [k for k in result.missing_keys if "lora_" in k or "modules_to_save" in k]
    if missing:
        raise CheckpointError(f"checkpoint {str(ckpt)!r}: no tensor for the adapter {missing[0]}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    return {"out_dir": str(out), "step": manifest["step"], "tensors": len(state), "dtype": dtype,
            "format": "peft-lora", "tokenizer": _copy_tokenizer(ckpt, tokenizer, out), "seconds": time.perf_counter() - start}


def _base_lookup(cfg: Any, base: dict[str, Any], base_dir: str | None) -> Callable[[str], torch.Tensor]:
    """Our name -> that base weight: read on demand from a HF folder, or from the run's seeded init."""
    path = base_dir or base.get("path")
    if base.get("model") == "hf" or base_dir:
        if not path or not Path(path).is_dir():
            raise ValueError(f"--base={path!r}: the base model's HF folder is needed to merge (pass --base DIR)")
        from safetensors import safe_open

        hf = registry.spec_of(cfg).hf
        # a tensor the family's checkpoints fuse (Phi-3's qkv_proj, gate_up_proj): our pieces are its rows, in order
        rows = {n: p.shape[0] for n, p in registry.build_meta(cfg).named_parameters()}
        fused = {hf.from_hf_name(h): parts for h, parts in hf.tensors(list(rows)) if len(parts) > 1}
        where: dict[str, tuple[Path, str, slice | None]] = {}
        for f in safetensors_files(path):
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    ours = hf.from_hf_name(k)
                    if ours not in fused:
                        where[ours] = (f, k, None)
                        continue
                    start = 0
                    for part in fused[ours]:
                        where[part] = (f, k, slice(start, start + rows[part]))
                        start += rows[part]

        def read(name: str) -> torch.Tensor:
            if name not in where:
                raise ValueError(f"--base={path!r}: no weight {hf.to_hf_name(name)!r} there")
            f, key, piece = where[name]
            with safe_open(str(f), framework="pt") as st:
                return st.get_tensor(key) if piece is None else st.get_slice(key)[piece]
        return read
    model = registry.build_meta(cfg)
    model.to_empty(device="cpu")
    model.init_weights(int(base.get("seed", 0)))  # the run's seeded init: its frozen base exactly
    params = {n: p.detach() for n, p in model.named_parameters()}
    return params.__getitem__


def _cat(pieces: list[torch.Tensor]) -> torch.Tensor:
    """A fused HF tensor from its pieces (one piece: itself, no copy)."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def export_merged(ckpt: str | Path, out_dir: str | Path, *, dtype: str = "fp32", base_dir: str | None = None,
                  max_shard_bytes: int = 2_000_000_000) -> dict[str, Any]:
    """A full HF folder of the checkpoint's family: the base with ``alpha / r * B @ A`` merged into each target,
    written tensor by tensor as the plain export does."""
    start = time.perf_counter()
    ckpt, out = Path(ckpt), Path(out_dir)
    manifest, cfg, lora, base = _need_lora(ckpt, "--merge")
    tokenizer = _tokenizer_files(ckpt, manifest)
    cfg = dataclasses.replace(cfg, kernels="torch")
    infos = {i.key[len(PREFIX):]: i for i in tensor_infos(ckpt, PREFIX)}
    torch_dtype = DTYPES[dtype]
    base_weight = _base_lookup(cfg, base, base_dir)
    hf = registry.spec_of(cfg).hf
    # names and shapes in our order (a tied head is the embedding: once)
    names = [(n, tuple(p.shape)) for n, p in registry.build_meta(cfg).named_parameters()]

    quantized = set()
    if lora.base_quant == "nf4":  # QLoRA: the adapters learned on the dequantized NF4 base; merge into that
        from deepshard.finetune.models.qlora import nf4_roundtrip, nf4_weights

        quantized = {n for n, _ in nf4_weights(registry.build_meta(cfg))}

    def merged(name: str) -> torch.Tensor:
        w = load_full_tensor(ckpt, infos[name]) if name in infos else base_weight(name)  # trained modules_to_save
        if name in quantized:
            w = nf4_roundtrip(w, world=base["nf4_world"])
        stem = name[:-len(".weight")]
        a, b = infos.get(f"{stem}.lora_A.weight"), infos.get(f"{stem}.lora_B.weight")
        if a is not None and b is not None:
            w = w.float() + lora.scaling * (load_full_tensor(ckpt, b).float() @ load_full_tensor(ckpt, a).float())
        return w.to(torch_dtype)

    shapes = dict(names)
    fused = hf.tensors([n for n, _ in names])  # (HF name, our weights concatenated into it)
    specs = [(h, torch_dtype, (sum(shapes[n][0] for n in parts), *shapes[parts[0]][1:])) for h, parts in fused]
    groups = list(plan_shards(specs, max_shard_bytes))
    weight_map: dict[str, str] = {}
    total = 0
    for k, idx in enumerate(groups, 1):
        fname = "model.safetensors" if len(groups) == 1 else f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        total += write_safetensors(out_dir_ready(out) / fname, [specs[i] for i in idx],
                                   (_cat([merged(n) for n in fused[i][1]]) for i in idx))
        weight_map.update({specs[i][0]: fname for i in idx})
    if len(groups) > 1:
        size = sum(torch_dtype.itemsize * math.prod(shape) for _, _, shape in specs)
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=2))
    tok = manifest.get("meta", {}).get("tokenizer", {})
    config = hf.config_dict(cfg, dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype],
                            bos_token_id=tok.get("bos_token_id"), eos_token_id=tok.get("eos_token_id"),
                            pad_token_id=tok.get("pad_token_id"))
    (out_dir_ready(out) / "config.json").write_text(json.dumps(config, indent=2, default=str))
    return {"out_dir": str(out), "step": manifest["step"], "tensors": len(specs), "files": len(groups),
            "bytes": total, "dtype": dtype, "format": "hf-merged", "tokenizer": _copy_tokenizer(ckpt, tokenizer, out),
            "seconds": time.perf_counter() - start}


def out_dir_ready(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    return out


