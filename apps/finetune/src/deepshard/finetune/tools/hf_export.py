"""A checkpoint as a HF transformers folder of its family (``export_checkpoint``), the CLI's default export.

The checkpoint is verified, then consolidated one tensor at a time (core's streaming reader) and
written straight into safetensors shards, so memory stays near one tensor whatever the model size.
No process group is needed: it runs on a laptop from a cluster's checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from deepshard.core.checkpoint.consolidate import load_full_tensor, tensor_infos
from deepshard.core.checkpoint.manifest import CheckpointError, sealed_files, verify_checkpoint
from deepshard.finetune.models import registry
from deepshard.finetune.models.hf import plan_shards, write_safetensors

DTYPES = {"fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16"), "fp16": (torch.float16, "float16")}
PREFIX = "model."
TOKENIZER = "tokenizer"  # the folder a save's write_extra gives the tokenizer


def export_checkpoint(ckpt: str | Path, out_dir: str | Path, *, dtype: str = "fp32",
                      max_shard_bytes: int = 2_000_000_000) -> dict[str, Any]:
    """Write ``out_dir`` (safetensors shards, index, config.json, tokenizer); returns a summary."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype!r}: valid values are {sorted(DTYPES)}")
    start = time.perf_counter()
    ckpt, out = Path(ckpt), Path(out_dir)
    manifest = verify_checkpoint(ckpt)
    meta = manifest.get("meta", {})
    if "model" not in meta:
        raise CheckpointError(f"checkpoint {str(ckpt)!r}: its manifest names no model architecture (meta.model)")
    spec, cfg = registry.from_meta(meta)  # the family names the HF config and the weights' names
    tokenizer = sealed_files(ckpt, manifest, TOKENIZER)  # before writing anything: refused, or copied at the end
    torch_dtype, hf_dtype = DTYPES[dtype]
    infos = {i.key[len(PREFIX):]: i for i in tensor_infos(ckpt, PREFIX)}
    groups_of = spec.hf.tensors(list(infos))  # (HF name, our tensors concatenated into it)
    specs = [(hf, torch_dtype, (sum(infos[n].shape[0] for n in names), *infos[names[0]].shape[1:]))
             for hf, names in groups_of]
    out.mkdir(parents=True, exist_ok=True)
    groups = list(plan_shards(specs, max_shard_bytes))
    weight_map: dict[str, str] = {}
    total = 0
    for n, idx in enumerate(groups, 1):
        name = "model.safetensors" if len(groups) == 1 else f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        # a generator: each tensor is read, cast and written before the next is loaded
        tensors = (_joined(ckpt, [infos[n] for n in groups_of[i][1]]).to(torch_dtype) for i in idx)
        total += write_safetensors(out / name, [specs[i] for i in idx], tensors)
        weight_map.update({specs[i][0]: name for i in idx})
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(torch_dtype.itemsize * _numel(s) for _, _, s in specs)},
                 "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    tok = meta.get("tokenizer", {})
    config = spec.hf.config_dict(cfg, dtype=hf_dtype, bos_token_id=tok.get("bos_token_id"),
                                 eos_token_id=tok.get("eos_token_id"), pad_token_id=tok.get("pad_token_id"))
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    copy_sealed(ckpt, tokenizer, out)
    return {"out_dir": str(out), "step": manifest["step"], "tensors": len(specs), "files": len(groups),
            "bytes": total, "dtype": dtype, "tokenizer": bool(tokenizer), "seconds": time.perf_counter() - start}


def copy_sealed(ckpt: Path, names: list[str], out: Path) -> None:
    """Copy ``names`` (files of ``TOKENIZER/`` that core's ``sealed_files`` checked) into ``out``, as
    regular files (their contents, never a link)."""
    for name in names:
        dst = out / name[len(TOKENIZER) + 1:]
        dst.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(ckpt / name, os.O_RDONLY | os.O_NOFOLLOW)  # a link swapped in since the check: refused
        with os.fdopen(fd, "rb") as src, open(dst, "wb") as f:
            shutil.copyfileobj(src, f)


def _joined(ckpt: Path, infos: list) -> torch.Tensor:
    """One tensor, or a fused one: its pieces concatenated along dim 0."""
    if len(infos) == 1:
        return load_full_tensor(ckpt, infos[0])
    return torch.cat([load_full_tensor(ckpt, i) for i in infos])


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
