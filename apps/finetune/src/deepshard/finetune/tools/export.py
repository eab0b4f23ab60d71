"""``python -m deepshard.finetune.export CKPT OUT_DIR``: a checkpoint as a HF LlamaForCausalLM folder.

The checkpoint is verified, then consolidated one tensor at a time (core's streaming reader) and
written straight into safetensors shards, so memory stays near one tensor whatever the model size.
No process group is needed: it runs on a laptop from a cluster's checkpoint.  Only files the
manifest lists are read or copied: a symlink or an unlisted file in ``tokenizer/`` is refused by
name before anything is written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from deepshard.core.checkpoint.consolidate import load_full_tensor, tensor_infos
from deepshard.core.checkpoint.manifest import CheckpointError, sealed_files, verify_checkpoint
from deepshard.finetune.models.hf import hf_config_dict, plan_shards, to_hf_name, write_safetensors
from deepshard.finetune.models.llama import LlamaConfig

DTYPES = {"fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16"), "fp16": (torch.float16, "float16")}
PREFIX = "model."
TOKENIZER = "tokenizer"  # the folder a save's write_extra gives the tokenizer


def parse_size(text: str) -> int:
    """``2GB``, ``500MB``, ``1e9``: bytes."""
    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    for unit, factor in units.items():
        if t.endswith(unit):
            return int(float(t[:-len(unit)]) * factor)
    return int(float(t))


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
    cfg = LlamaConfig(**meta["model"])
    tokenizer = sealed_files(ckpt, manifest, TOKENIZER)  # before writing anything: refused, or copied at the end
    torch_dtype, hf_dtype = DTYPES[dtype]
    infos = tensor_infos(ckpt, PREFIX)
    specs = [(to_hf_name(i.key[len(PREFIX):]), torch_dtype, i.shape) for i in infos]
    out.mkdir(parents=True, exist_ok=True)
    groups = list(plan_shards(specs, max_shard_bytes))
    weight_map: dict[str, str] = {}
    total = 0
    for n, idx in enumerate(groups, 1):
        name = "model.safetensors" if len(groups) == 1 else f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        # a generator: each tensor is read, cast and written before the next is loaded
        tensors = (load_full_tensor(ckpt, infos[i]).to(torch_dtype) for i in idx)
        total += write_safetensors(out / name, [specs[i] for i in idx], tensors)
        weight_map.update({specs[i][0]: name for i in idx})
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(torch_dtype.itemsize * _numel(s) for _, _, s in specs)},
                 "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    tok = meta.get("tokenizer", {})
    config = hf_config_dict(cfg, dtype=hf_dtype, bos_token_id=tok.get("bos_token_id"),
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


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepshard.finetune.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a step-NNNNNNNN checkpoint directory")
    parser.add_argument("out_dir", help="where to write the HF model folder")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--max-shard-size", default="2GB", help="largest safetensors file (e.g. 500MB, 2GB)")
    lora = parser.add_mutually_exclusive_group()  # +peft=lora checkpoints (adapter_export.py)
    lora.add_argument("--adapter", action="store_true", help="write a PEFT adapter folder (PeftModel.from_pretrained)")
    lora.add_argument("--merge", action="store_true", help="write the base with the adapters merged, a full HF model")
    parser.add_argument("--base", default=None, help="--merge: the base's HF folder (default: the one trained on)")
    args = parser.parse_args(argv)
    try:
        from deepshard.finetune import adapter_export as ax

        if args.adapter:
            summary = ax.export_adapter(args.checkpoint, args.out_dir, dtype=args.dtype)
        elif args.merge:
            summary = ax.export_merged(args.checkpoint, args.out_dir, dtype=args.dtype, base_dir=args.base,
                                       max_shard_bytes=parse_size(args.max_shard_size))
        elif ax.is_lora_checkpoint(args.checkpoint):
            raise ValueError(f"checkpoint {args.checkpoint!r} holds LoRA adapters only (+peft=lora): pass --adapter "
                             f"(a PEFT adapter folder) or --merge (the base with the adapters merged)")
        else:
            summary = export_checkpoint(args.checkpoint, args.out_dir, dtype=args.dtype,
                                        max_shard_bytes=parse_size(args.max_shard_size))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
