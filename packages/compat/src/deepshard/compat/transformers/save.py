"""``save_model`` at any ZeRO stage without the whole model on one rank: HF safetensors written one
tensor at a time.

transformers' ``save_pretrained`` (and DeepSpeed's ``_zero3_consolidated_16bit_state_dict``) first
build the full state dict on rank 0, so saving needs host memory for the whole model.  Here the
plan comes first, from shapes and dtypes alone (meta tensors through transformers' own tied-weight
removal and ``split_torch_state_dict_into_shards``); each safetensors header is written from the
plan, then every rank gathers one parameter at a time (a ZeRO-3 shard's all-gather), rank 0 appends
its bytes and drops it.  The peak beyond the sharded model is one full tensor.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from deepshard.core.checkpoint.plain_files import open_file, write_text

# the names Trainer's save_pretrained uses (transformers' SAFE_WEIGHTS_NAME / SAFE_WEIGHTS_INDEX_NAME)
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
MAX_SHARD_SIZE = "50GB"  # save_pretrained's default, which Trainer's save_model uses

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def _clean(name: str) -> str:
    """A state-dict key without wrapper prefixes (activation checkpointing, torch.compile)."""
    for prefix in ("_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(prefix, "")
    return name


def plan(model: nn.Module, max_shard_size: int | str = MAX_SHARD_SIZE) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """``({file: [key, ...]}, {key: tensor})`` of what ``save_pretrained`` would write, worked out
    from shapes alone: tied duplicates removed by transformers' rules, shards cut by its splitter.
    The tensors are the model's own (DTensor shards under ZeRO-3), not gathered."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers import PreTrainedModel

    live = model.state_dict(keep_vars=True)
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in live.items()}
    if isinstance(model, PreTrainedModel):
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        for key in model._keys_to_ignore_on_save or []:
            meta.pop(key, None)
        meta = remove_tied_weights_from_state_dict(meta, model)
        reverted = revert_weight_conversion(model, dict(meta))
        if set(reverted) != set(meta):
            raise ValueError(f"save_model(): {type(model).__name__} converts its weights' layout on save "
                             f"(transformers' conversion mapping); the streaming ZeRO-3 save writes the layout it "
                             f"trains with only")
    else:  # safetensors holds no aliases: the first name of each shared tensor
        seen: set[int] = set()
        for key in list(meta):
            if id(live[key]) in seen:
                del meta[key]
            seen.add(id(live[key]))
    tensors = {_clean(k): live[k] for k in meta}
    split = split_torch_state_dict_into_shards({_clean(k): v for k, v in meta.items()},
                                               filename_pattern=WEIGHTS.replace(".safetensors", "{suffix}.safetensors"),
                                               max_shard_size=max_shard_size)
    return split.filename_to_tensors, tensors


def _header(names: list[str], tensors: dict[str, Any]) -> bytes:
    """A safetensors header for ``names`` in this order, data contiguous from offset 0."""
    head: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        t = tensors[name]
        if t.dtype not in _DTYPES:
            raise ValueError(f"save_model(): {name} has dtype {t.dtype}, which safetensors cannot hold")
        size = t.numel() * t.element_size()
        head[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def gather_to(t: Any, dst: int) -> torch.Tensor | None:
    """One tensor whole on global rank ``dst`` (None on the others when it had to be gathered).

    A ZeRO-3 parameter (``Shard(0)`` over a 1-D mesh) is received piece by piece into one buffer on
    ``dst``: each rank sends its rows (``torch.chunk``'s split, as DTensor shards), so ``dst`` holds one
    full tensor and the others nothing more (an all-gather, ``full_tensor()``, puts a copy on every
    rank, and gloo's stages it once more).  Other layouts (2-D meshes) use ``full_tensor()``."""
    if not isinstance(t, DTensor):
        return t.detach()  # already whole on every rank (ZeRO 0-2)
    if t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        whole = t.full_tensor().detach()
        return whole if dist.get_rank() == dst else None
    group = t.device_mesh.get_group()
    ranks = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
    rows = [c.numel() for c in torch.empty(t.shape[0], device="meta").chunk(len(ranks))]
    rows += [0] * (len(ranks) - len(rows))
    me = ranks.index(dist.get_rank())
    local = t.to_local().detach()[:rows[me]]
    if dist.get_rank() != dst:
        if rows[me]:
            dist.send(local.contiguous(), dst=dst, group=group)
        return None
    whole = torch.empty(t.shape, dtype=t.dtype, device=local.device)
    start = 0
    for r, (rank, n) in enumerate(zip(ranks, rows, strict=True)):
        if n and r == me:
            whole[start:start + n].copy_(local)
        elif n:
            dist.recv(whole[start:start + n], src=rank, group=group)
        start += n
    return whole


def params_in_memory(offload_params: Any) -> contextlib.AbstractContextManager:
    """Every shard in memory for a save: under ZeRO-Infinity's parameter swap (``offload.params=nvme``) the
    shards rest in swap files with the last update deferred to their next use; its ``resident()`` applies
    that update and reads them back, and releases them after.  Other layouts hold their shards already."""
    resident = getattr(offload_params, "resident", None)
    return resident() if resident is not None else contextlib.nullcontext()


def write_streaming(model: nn.Module, output_dir: str | os.PathLike, *, is_main: bool,
                    max_shard_size: int | str = MAX_SHARD_SIZE) -> list[str]:
    """Write ``model``'s weights as HF safetensors (``model.safetensors``, or shards plus the index
    json), gathering one tensor at a time.  Every rank calls it (the gathers are collective); rank
    ``is_main`` writes.  Returns the weight files written."""
    if is_main and dist.is_initialized():
        assert dist.get_rank() == 0, "the writer is global rank 0 (save_on_each_node is refused)"
    files, tensors = plan(model, max_shard_size)
    out = Path(output_dir)
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
    for filename, names in files.items():
        tmp = out / (filename + ".tmp")
        f = open_file(tmp, "wb") if is_main else None  # closed below, after the gathers; never through a link
        try:
            if f is not None:
                f.write(_header(names, tensors))
            for name in names:
                value = gather_to(tensors[name], 0)  # every rank, in the same order (ZeRO-3: sends)
                if f is not None and value is not None and value.numel():
                    f.write(value.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data)
                del value
        finally:
            if f is not None:
                f.close()
        if is_main:
            os.replace(tmp, out / filename)
    if is_main:
        sharded = len(files) > 1
        for stale in [WEIGHTS] if sharded else [INDEX]:  # what an earlier save_pretrained left there
            (out / stale).unlink(missing_ok=True)
        if sharded:
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_parameters": sum(t.numel() for t in tensors.values()), "total_size": total},
                     "weight_map": {n: fn for fn, names in files.items() for n in names}}
            write_text(out / INDEX, json.dumps(index, indent=2, sort_keys=True) + "\n")
    if dist.is_initialized():
        dist.barrier()
    return list(files)


def trainable_state(model: nn.Module, *, is_main: bool) -> dict[str, torch.Tensor]:
    """The trainable parameters (a PEFT adapter), gathered one at a time; whole on rank ``is_main``
    only (an adapter is small: the frozen base is never gathered)."""
    state = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            value = gather_to(p, 0)
            if is_main and value is not None:
                state[_clean(name)] = value.cpu().clone()
            del value
    return state
