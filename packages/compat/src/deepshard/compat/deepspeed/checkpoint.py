"""DeepSpeed's checkpoint layout (``save_dir/tag/``, ``save_dir/latest``) over core's checkpoint API.

Inside ``save_dir/tag/`` is one of our checkpoints (``step-NNNNNNNN``: DCP shards, JSON scalars,
a manifest), so it loads at any world size and ZeRO stage; ``client_state`` travels as JSON.
"""

from __future__ import annotations

import json
import os
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deepshard.core import Engine
from deepshard.core.checkpoint.async_save import AsyncCheckpointer
from deepshard.core.checkpoint.manifest import MANIFEST, latest_good, read_manifest
from deepshard.core.checkpoint.plain_files import write_text
from deepshard.core.checkpoint.state import (
    clean_name,
    load_checkpoint,
    save_request,
    step_dir_name,
    write_checkpoint,
)
from deepshard.core.mesh import axis_size

from .ds_files import check_tag, no_tag_dir, read_latest

LATEST = "latest"
FROZEN_EXCLUDED = "exclude_frozen_parameters"  # the manifest's meta: a save without the frozen weights


def _json(client_state: dict) -> dict:
    try:
        json.dumps(client_state)
    except TypeError as err:
        raise ValueError(f"save_checkpoint(client_state=...): must be JSON (numbers, strings, lists, dicts): {err}. "
                         f"Checkpoints here execute nothing on load, so they hold no pickled objects") from None
    return client_state


def rank0_tag(tag: str, source: str, mode: str = "WARN") -> str:
    """The tag every rank saves under: rank 0's.  ``mode`` is the ds_config's ``checkpoint.tag_validation``
    with DeepSpeed's meanings when the ranks' tags differ (``tag=loss.item()``): WARN (its default) warns
    on every rank, IGNORE says nothing, FAIL raises on every rank before anything is written.  DeepSpeed
    would then write each rank's files under its own tag; here they stay one checkpoint, rank 0's."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tag
    tags: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(tags, tag)
    if len(set(tags)) == 1 or mode == "IGNORE":
        return str(tags[0])
    differ = {r: t for r, t in enumerate(tags) if t != tags[0]}
    message = (f"{source}: the checkpoint tag differs across ranks (rank 0: {tags[0]!r}, "
               f"{', '.join(f'rank {r}: {t!r}' for r, t in differ.items())}): a tag must be the same on every rank, "
               f"not a per-rank value such as the local loss")
    if mode == "FAIL":
        raise ValueError(f"{message}; nothing saved (the ds_config's checkpoint.tag_validation is Fail)")
    warnings.warn(f"{message}; saved under rank 0's tag {tags[0]!r} (checkpoint.tag_validation: Warn)", stacklevel=3)
    return str(tags[0])


def save_ds_style(engine: Engine, save_dir: Path, tag: str, *, client_state: dict, counters: dict[str, int],
                  save_latest: bool, extra: dict[str, Any] | None = None,
                  writer: AsyncCheckpointer | None = None, exclude_frozen: bool = False) -> Path:
    """``save_dir/tag/step-N`` (and ``save_dir/latest``).  With ``writer`` (no save in flight: the caller
    waited) the state is staged and the writer thread writes it; ``latest`` is written once it is sealed.
    ``exclude_frozen`` (DeepSpeed's ``exclude_frozen_parameters``: PEFT's adapters without their base):
    only the trained parameters and their optimizer state, no frozen weights or buffers."""
    oc = engine.config.optim
    opt = engine.optimizer
    # what a DeepSpeed optimizer group needs on resume (to_deepspeed): the rate of the next update
    optimizer = {"lr": float(opt.lr_at(opt.num_updates)), "betas": list(oc.betas), "eps": oc.eps,
                 "weight_decay": oc.weight_decay}
    app = {"client_state": _json(client_state), "counters": counters, "tag": tag, "optimizer": optimizer,
           **(extra or {})}  # e.g. a client lr_scheduler's state (engine.py)
    if axis_size(engine.mesh, "ep") > 1:  # deepspeed.moe experts as ep ranks' rows (ds_moe_export reads it)
        app["ep_size"] = axis_size(engine.mesh, "ep")
        # the module's order (a DCP checkpoint's is not), which DeepSpeed's files and optimizer ids follow
        app["state_dict_order"] = list(engine.model.state_dict().keys())
    request = save_request(save_dir / tag, counters["global_steps"], engine.optimizer, engine.mesh["dp"],
                           model=None if exclude_frozen else engine.model, app_state=app,
                           meta={FROZEN_EXCLUDED: True} if exclude_frozen else None)
    final = save_dir / tag / step_dir_name(request.step)
    if writer is not None:
        writer.on_sealed = partial(_write_latest, save_dir, tag) if save_latest else None
        writer.start(request)
        return final
    path = write_checkpoint(request)
    if save_latest:
        _write_latest(save_dir, tag, path)
    dist.barrier()
    return path


def _write_latest(save_dir: Path, tag: str, sealed: Path) -> None:
    """Rank 0 names the sealed checkpoint's tag in ``save_dir/latest``."""
    if dist.get_rank() == 0:
        write_text(save_dir / LATEST, tag)  # never through a link planted in save_dir


def resolve(load_dir: Path, tag: str | None) -> Path | None:
    """The checkpoint directory for ``load_dir`` and ``tag`` (``latest`` when no tag), or None."""
    latest = load_dir / LATEST
    if tag is None and os.path.lexists(latest):  # a link is refused (read_latest), never echoed
        target = load_dir / read_latest(latest)
        if not target.is_dir():
            raise no_tag_dir(latest)
    else:
        target = load_dir / check_tag(str(tag), f"load_checkpoint({str(load_dir)!r})") if tag is not None else load_dir
    if (target / MANIFEST).is_file():
        return target
    if not target.is_dir():
        if tag is not None:
            raise ValueError(f"load_checkpoint({str(load_dir)!r}, tag={tag!r}): no such directory {str(target)!r}")
        return None
    found, _ = latest_good(target)
    return found


def load_ds_style(engine: Engine, load_dir: Path, tag: str | None, *, optimizer_states: bool,
                  lr_scheduler_states: bool, strict: bool = True) -> tuple[Path, dict[str, Any]] | None:
    """``strict=False`` (DeepSpeed's ``load_module_strict=False``, transformers' for PEFT models): a checkpoint
    saved without its frozen weights restores the trained ones, the frozen keep their values; a full one
    restores everything, as a strict load does."""
    path = resolve(load_dir, tag) if dist.get_rank() == 0 else None
    box = [path]
    dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        return None
    path = Path(box[0])
    trained_only = not strict and bool(read_manifest(path).get("meta", {}).get(FROZEN_EXCLUDED))
    app = load_checkpoint(path, engine.optimizer, engine.mesh["dp"], model=None if trained_only else engine.model)
    opt = engine.optimizer
    if not optimizer_states:  # a fresh optimizer on the loaded weights (Adam moments zeroed)
        state = opt.store.state_dict()
        opt.store.load_state_dict({"master": state["master"],
                                   "exp_avg": [torch.zeros_like(t) for t in state["exp_avg"]],
                                   "exp_avg_sq": [torch.zeros_like(t) for t in state["exp_avg_sq"]]})
    if not lr_scheduler_states:  # the schedule (and Adam's step count) restarts
        opt.num_updates = 0
    return path, app


def full_state_dict(module: nn.Module, *, exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
    """Every rank takes part (ZeRO-3 gathers); rank 0 gets full host tensors in the compute dtype."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=exclude_frozen)
    state = get_model_state_dict(module, options=opts)
    return {clean_name(k): v.detach().contiguous() for k, v in state.items()}


def save_16bit(module: nn.Module, path: Path, *, exclude_frozen: bool) -> None:
    state = full_state_dict(module, exclude_frozen=exclude_frozen)
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file({k: v.clone() for k, v in state.items()}, str(path), metadata={"format": "pt"})
        else:
            torch.save(state, path)
    dist.barrier()
