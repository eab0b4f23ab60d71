"""Phi-3's checkpoints hold fused projections (``self_attn.qkv_proj``: q, k, v rows stacked;
``mlp.gate_up_proj``: gate then up); our model holds them split, as the Llama decoder names them.

Split on load, fused on export: every layout the decoder has (TP's even per-head split of q/k/v,
LoRA per projection, ZeRO's per-parameter shards, the pipeline split) applies unchanged, where a fused
weight under TP would need a per-head-group, per-half shard layout of its own.  A fused tensor is read
as row slices (safetensors' ``get_slice``), one piece at a time, and of each piece only the rows
(or columns) this rank keeps (``hf.read_local``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from deepshard.core.dtensor_utils import local_tensor
from deepshard.finetune.models.hf import (
    check_tokenizer,
    from_hf_name,
    read_local,
    safetensors_files,
    safetensors_headers,
    to_hf_name,
)

FUSED = {".self_attn.qkv_proj.weight": (".self_attn.q_proj.weight", ".self_attn.k_proj.weight",
                                         ".self_attn.v_proj.weight"),
         ".mlp.gate_up_proj.weight": (".mlp.gate_proj.weight", ".mlp.up_proj.weight")}


def pieces(hf_name: str, cfg) -> list[tuple[str, int, int]]:
    """(our name, first row, end row) of each piece of the HF tensor ``hf_name``; one piece, all rows
    (end -1), for a tensor that is not fused."""
    name = from_hf_name(hf_name)
    for fused, parts in FUSED.items():
        if name.endswith(fused):
            stem = name[:-len(fused)]
            if fused.startswith(".self_attn"):
                q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
                rows = (0, q, q + kv, q + 2 * kv)
            else:
                rows = (0, cfg.ffn_hidden, 2 * cfg.ffn_hidden)
            return [(stem + part, rows[i], rows[i + 1]) for i, part in enumerate(parts)]
    return [(name, 0, -1)]


def _group(name: str, have: set[str]) -> tuple[str, list[str], bool] | None:
    """(fused name, its pieces, whether ``name`` is the first) when ``name`` and its siblings all exist."""
    for fused, parts in FUSED.items():
        for i, part in enumerate(parts):
            stem = name[:-len(part)]
            if name.endswith(part) and all(stem + p in have for p in parts):
                return stem + fused, [stem + p for p in parts], i == 0
    return None


def fuse(names: list[str]) -> list[tuple[str, list[str]]]:
    """Export: our parameter names, in order -> (HF name, the names concatenated along dim 0 into it);
    a fused tensor takes its first piece's place."""
    have, out = set(names), []
    for name in names:
        group = _group(name, have)
        if group is None:
            out.append((to_hf_name(name), [name]))
        elif group[2]:
            out.append((to_hf_name(group[0]), group[1]))
    return out


def check_dir(path: str | Path, model: nn.Module) -> None:
    """Before any worker starts: a tokenizer, and headers holding exactly ``model``'s weights (fused
    ones by their pieces' rows) with its shapes."""
    check_tokenizer(Path(path))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    missing = set(shapes)
    for f, found in safetensors_headers(Path(path)):
        for hf_name, shape in found.items():
            for name, start, end in pieces(hf_name, model.cfg):
                if name not in shapes:
                    if "rotary_emb" in name:
                        continue
                    raise ValueError(f"{f}: weight {hf_name!r} has no place in our model")
                got = ((end if end >= 0 else shape[0]) - start, *shape[1:])
                if got != shapes[name] or end > shape[0]:
                    where = f" in its rows {start}:{end}" if end >= 0 else ""
                    raise ValueError(f"{f}: {hf_name} has shape {list(shape)}; config.json implies "
                                     f"{list(shapes[name])}{where}")
                missing.discard(name)
    if missing:
        raise ValueError(f"model.path={str(path)!r}: no weights for {sorted(missing)[:5]}")


@torch.no_grad()
def load_weights(model: nn.Module, path: str | Path) -> None:
    """A Phi-3 checkpoint into ``model`` (plain or sharded), each fused tensor's pieces read as row
    slices, each rank reading only its own part of a piece."""
    from safetensors import safe_open

    params = {n: p for n, p in model.named_parameters() if ".lora_" not in n}
    missing = set(params)
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as st:
            for hf_name in st.keys():
                for name, start, end in pieces(hf_name, model.cfg):
                    if name not in params:
                        if "rotary_emb" in name:
                            continue
                        raise ValueError(f"model.path={str(path)!r}: weight {hf_name!r} has no place in our model")
                    shape = list(st.get_slice(hf_name).get_shape())
                    if end >= 0:  # a fused tensor's piece: rows start:end (all of them must be there)
                        shape[0] = min(end, shape[0]) - start
                    if tuple(shape) != tuple(params[name].shape):
                        raise ValueError(f"model.path={str(path)!r}: {hf_name} rows {start}:{end} have shape "
                                         f"{shape}, our model expects {list(params[name].shape)}")
                    local_tensor(params[name]).copy_(read_local(st, hf_name, params[name], row0=start))
                    missing.discard(name)
    if missing:
        raise ValueError(f"model.path={str(path)!r}: no weights for {sorted(missing)[:5]}")
