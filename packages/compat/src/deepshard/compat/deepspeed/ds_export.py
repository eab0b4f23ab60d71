"""One of our checkpoints (a ``step-*`` directory, or a folder of them: the newest good one) as a
DeepSpeed ZeRO-1/2/3 checkpoint that DeepSpeed's ``engine.load_checkpoint(OUT_DIR)`` resumes at
data-parallel size W (default: the size it was saved at), in ``OUT_DIR/latest`` and ``OUT_DIR/TAG/``:

- ZeRO-1/2: ``mp_rank_00_model_states.pt`` (the full fp32 weights, LR-scheduler position, step
  counters) and one ``zero_pp_rank_R_mp_rank_00_optim_states.pt`` per rank (its slice of the flat
  fp32 masters and Adam moments, each group padded to a multiple of 2 x W, and with
  ``parameter_alignment`` each parameter to 16 bytes, as DeepSpeed lays them out).
- ZeRO-3: per rank ``zero_pp_rank_R_mp_rank_00_model_states.pt`` (shapes,
  counters) and ``..._optim_states.pt`` holding its ceil(numel / W) piece of every parameter.

DeepSpeed must build its engine with two parameter groups in model order, matrices first
(decayed) then vectors (weight_decay 0): the AdamW of deepshard.  Each rank file is built from one
tensor at a time (core's ``load_full_tensor``).  The fp16 dynamic loss-scaler state is not written:
ZeRO-1/2 keep DeepSpeed's fresh scaler, ZeRO-3 gets a static one at the saved scale.  Parameter names
are the checkpoint's, as DeepSpeed's module must have them.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from deepshard.core.checkpoint import (
    TensorInfo,
    iter_full_tensors,
    latest_good,
    load_full_tensor,
    read_manifest,
    read_trainer,
    tensor_infos,
    write_text,
)

from .ds_files import DS_OWN_KEYS, DsLossScaler, save_for_deepspeed

DS_VERSION = "0.19.8"
PREFIXES = {"master": "model.", "exp_avg": "optim.exp_avg.", "exp_avg_sq": "optim.exp_avg_sq."}
DS_SUB_GROUP_SIZE = 10**9  # DeepSpeed's zero_optimization.stage3_sub_group_size default


def _find(ckpt: Path) -> Path:
    if (ckpt / "manifest.json").is_file():
        return ckpt
    found, _ = latest_good(ckpt)
    if found is None:
        raise ValueError(f"{ckpt}: not a deepshard checkpoint (no manifest.json) and no good step-* inside")
    return found


def groups(infos: list[TensorInfo], num_groups: int = 2) -> list[list[TensorInfo]]:
    """Two groups in saved (model) order: matrices (decayed), then vectors and scalars; or one group
    of every parameter (a script passing ``model.parameters()``)."""
    if num_groups == 1:
        return [list(infos)]
    return [[i for i in infos if len(i.shape) >= 2], [i for i in infos if len(i.shape) < 2]]


def default_num_groups(trainer: dict) -> int:
    """An imported DeepSpeed run's own group count; else deepshard's two (decayed matrices, the rest)."""
    app = trainer["app"] if isinstance(trainer["app"], dict) else {}
    saved = app.get("deepspeed", {}).get("param_groups")
    return len(saved) if saved else 2


def export_checkpoint(ckpt: str | Path, out_dir: str | Path, *, stage: int | None = None, world: int | None = None,
                      tag: str | None = None, sub_group_size: int = DS_SUB_GROUP_SIZE, num_groups: int | None = None,
                      bf16: bool | None = None, parameter_alignment: bool | None = None, fp16: bool = False,
                      ep_size: int | None = None) -> Path:
    """``stage``: the resuming run's ZeRO stage (default 2; a ``deepspeed.moe`` model's checkpoint: 0, the
    expert files of ``ds_moe_export``, at ``ep_size``: default as saved).  ``num_groups``: the resuming script's parameter groups (1: ``model.parameters()``; 2: decayed
    matrices then the rest; default: an imported run's own count, else 2).  ``bf16``: DeepSpeed's
    bf16 file names (``bf16_zero_pp_rank_*``; default: as the imported run's files were named).
    ``parameter_alignment``: the resuming run's ``zero_optimization.parameter_alignment`` (ZeRO-1/2: each
    parameter padded to 16 bytes of its bit16 dtype, bf16 or ``fp16``, else fp32; default: as imported)."""
    from .ds_moe_export import export_moe_checkpoint, is_moe_export

    if is_moe_export(ckpt):
        if stage not in (None, 0):
            raise ValueError(f"--stage {stage}: a deepspeed.moe checkpoint is written as DeepSpeed's expert files "
                             f"without ZeRO partitions (valid: 0, resumed at zero_optimization.stage 0)")
        return export_moe_checkpoint(ckpt, out_dir, ep_size=ep_size, tag=tag, num_groups=num_groups)
    stage = 2 if stage is None else stage
    if ep_size is not None:
        raise ValueError(f"--ep-size {ep_size}: the checkpoint has no deepspeed.moe experts")
    if stage not in (1, 2, 3):
        raise ValueError(f"--stage {stage}: the exporter writes ZeRO-1, -2 or -3 checkpoints (valid: 1, 2, 3)")
    if num_groups not in (None, 1, 2):
        raise ValueError(f"--groups {num_groups}: valid values are 1 (model.parameters()) and 2 (decayed matrices, "
                         f"then vectors with weight_decay 0)")
    if sub_group_size < 1:
        raise ValueError(f"--sub-group-size {sub_group_size}: must be >= 1 (DeepSpeed's stage3_sub_group_size)")
    path = _find(Path(ckpt))
    manifest = read_manifest(path)
    trainer = read_trainer(path)
    world = world or int(manifest["world"].get("dp_size") or manifest["world"]["world_size"] or 1)
    steps = int(trainer["num_updates"])
    counters = trainer["app"].get("counters", {}) if isinstance(trainer["app"], dict) else {}
    tag = tag or f"global_step{counters.get('global_steps', steps)}"
    moments = {j.key for j in tensor_infos(path, "optim.exp_avg.")}  # trainable params have moments
    masters = [i for i in tensor_infos(path, "model.") if f"optim.exp_avg.{i.key[6:]}" in moments]
    num_groups = num_groups or default_num_groups(trainer)
    grouped = [g for g in groups(masters, num_groups) if g]
    app = trainer["app"] if isinstance(trainer["app"], dict) else {}
    file_prefix = "bf16_" if (bf16 if bf16 is not None else bool(app.get("deepspeed", {}).get("bf16"))) else ""
    out = Path(out_dir) / tag
    out.mkdir(parents=True, exist_ok=False)
    shapes = [OrderedDict((i.key[6:], torch.Size(i.shape)) for i in g) for g in grouped]
    client = client_state(trainer)
    if stage == 3:
        export_zero3(path, out, trainer, grouped, {**client, **model_states(shapes, steps, counters, world)},
                     world=world, steps=steps, sub_group_size=sub_group_size, file_prefix=file_prefix)
        write_text(Path(out_dir) / "latest", tag)
        return out
    module = OrderedDict((i.key[6:], t) for i, t in iter_full_tensors(path, "model."))
    torch.save({"module": module, **client, **model_states(shapes, steps, counters, world)},
               out / "mp_rank_00_model_states.pt")
    del module
    esize = 2 if file_prefix or fp16 else 4  # the bytes of the resuming run's bit16 (or fp32) parameters
    aligned = parameter_alignment if parameter_alignment is not None else bool(app.get("deepspeed", {}).get(
        "parameter_alignment"))
    export_zero12(path, out, trainer, grouped, world=world, steps=steps, stage=stage, file_prefix=file_prefix,
                  param_alignment=16 // math.gcd(16, esize) if aligned else 1)
    write_text(Path(out_dir) / "latest", tag)
    return out


def flat_layout(group: list[TensorInfo], world: int, param_alignment: int) -> tuple[list[int], list[int], int, int]:
    """DeepSpeed ZeRO-1/2's flat buffer of one group (stage_1_and_2.py, DeepSpeedZeroOptimizer.__init__): the
    parameters in order, each but the last followed by zeros up to a multiple of ``param_alignment``
    elements (``zero_optimization.parameter_alignment``: 16 bytes; else 1), the whole padded to a multiple
    of 2 x world and split into ``world`` equal partitions.  Returns (offsets, paddings, used, partition)."""
    offsets, paddings, current = [], [], 0
    for index, info in enumerate(group):
        offsets.append(current)
        current += math.prod(info.shape)
        pad = 0 if index == len(group) - 1 else (-current) % param_alignment
        paddings.append(pad)
        current += pad
    align = 2 * world  # nccl_start_alignment_factor x dp size
    return offsets, paddings, current, math.ceil(current / align) * align // world


def export_zero12(path: Path, out: Path, trainer: dict, grouped: list[list[TensorInfo]], *, world: int, steps: int,
                  stage: int, file_prefix: str, param_alignment: int) -> None:
    """Per rank its partition of every group's flat fp32 masters and Adam moments, as DeepSpeed's
    ``state_dict`` writes them: the masters without the partition's tail padding (``group_paddings``),
    the moments whole, and each parameter's alignment padding (``param_alignment_paddings``), which
    DeepSpeed compares with its own layout on load."""
    layouts = [flat_layout(g, world, param_alignment) for g in grouped]
    for rank in range(world):
        flats: dict[str, list[torch.Tensor]] = {k: [] for k in PREFIXES}
        group_paddings = []
        for g, (offsets, _, used, part) in zip(grouped, layouts):
            lo_r, hi_r = rank * part, (rank + 1) * part
            for kind, prefix in PREFIXES.items():
                flat = torch.zeros(part, dtype=torch.float32)
                for info, offset in zip(g, offsets):
                    n = math.prod(info.shape)
                    lo, hi = max(offset, lo_r), min(offset + n, hi_r)
                    if hi > lo:
                        t = load_full_tensor(path, TensorInfo(prefix + info.key[6:], info.shape, torch.float32))
                        flat[lo - lo_r:hi - lo_r] = t.reshape(-1)[lo - offset:hi - offset]
                flats[kind].append(flat)
            group_paddings.append(part if used <= lo_r else max(0, hi_r - used))
        # torch's Adam keeps ``step`` as a tensor it increments in place (an int would stay put)
        state = {i: {"step": torch.tensor(float(steps)), "exp_avg": flats["exp_avg"][i], "exp_avg_sq": flats["exp_avg_sq"][i]}
                 for i in range(len(grouped))}
        param_groups = [ds_group(trainer, i, decay=(i == 0 or len(grouped) == 1)) for i in range(len(grouped))]
        osd: dict[str, Any] = {
            # no loss_scaler / clip_grad / dynamic_loss_scale keys: DeepSpeed keeps its own config's values
            "base_optimizer_state": {"state": state, "param_groups": param_groups},
            "single_partition_of_fp32_groups": [f[:f.numel() - pad] for f, pad in zip(flats["master"], group_paddings)],
            "zero_stage": stage, "group_paddings": group_paddings,
            "param_alignment_paddings": [layout[1] for layout in layouts], "partition_count": [world] * len(grouped),
            "ds_version": DS_VERSION}
        torch.save({"optimizer_state_dict": osd, "ds_config": {}, "ds_version": DS_VERSION},
                   out / f"{file_prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")


def sub_groups(group: list[TensorInfo], world: int, sub_group_size: int) -> list[list[TensorInfo]]:
    """DeepSpeed ZeRO-3's sub-groups of a parameter group (stage3.py ``_create_fp16_sub_groups``):
    consecutive parameters until their per-rank partitions reach ``sub_group_size`` elements."""
    parts = [math.ceil(math.prod(i.shape) / world) for i in group]
    if sub_group_size >= sum(parts):
        return [group]
    out, current, size = [], [], 0
    for info, part in zip(group, parts):
        current.append(info)
        size += part
        if size >= sub_group_size or info is group[-1]:
            out.append(current)
            current, size = [], 0
    return out


def export_zero3(path: Path, out: Path, trainer: dict, grouped: list[list[TensorInfo]], states: dict[str, Any], *,
                 world: int, steps: int, sub_group_size: int, file_prefix: str = "") -> None:
    """ZeRO-3: every parameter split into ceil(numel / W) pieces, rank r holding piece r (the last
    padded with zeros); a rank's flat partition of a sub-group is its pieces in order.  The Adam state
    is indexed by sub-group, each parameter group listing its sub-groups."""
    subs = [sub_groups(g, world, sub_group_size) for g in grouped]
    flat_subs = [sg for g in subs for sg in g]
    groups_out, first = [], 0
    for gi, g in enumerate(subs):
        groups_out.append({**ds_group(trainer, gi, decay=(gi == 0 or len(subs) == 1)),
                           "params": list(range(first, first + len(g)))})
        first += len(g)
    scale = float(trainer.get("scaler", {}).get("scale", 1.0))
    for rank in range(world):
        flats: dict[str, list[torch.Tensor]] = {k: [] for k in PREFIXES}
        for sg in flat_subs:
            for kind, prefix in PREFIXES.items():
                pieces = []
                for info in sg:
                    n = math.prod(info.shape)
                    part = math.ceil(n / world)
                    piece = torch.zeros(part, dtype=torch.float32)
                    lo, hi = rank * part, min((rank + 1) * part, n)
                    if hi > lo:
                        t = load_full_tensor(path, TensorInfo(prefix + info.key[6:], info.shape, torch.float32))
                        piece[:hi - lo] = t.reshape(-1)[lo:hi]
                        del t
                    pieces.append(piece)
                flats[kind].append(torch.cat(pieces))
        state = {i: {"step": steps, "exp_avg": flats["exp_avg"][i],  # an int, as DeepSpeed's ZeRO-3 saves it
                     "exp_avg_sq": flats["exp_avg_sq"][i]} for i in range(len(flat_subs))}
        osd = {"zero_stage": 3, "loss_scaler": DsLossScaler(scale), "dynamic_loss_scale": False, "overflow": False,
               "partition_count": world, "optimizer_state_dict": {"state": state, "param_groups": groups_out},
               "fp32_flat_groups": flats["master"]}
        save_for_deepspeed({"optimizer_state_dict": osd, "ds_config": {}, "ds_version": DS_VERSION},
                           out / f"{file_prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        del flats, state, osd
        module = OrderedDict((i.key[6:], torch.empty(0)) for g in grouped for i in g)  # weights live in the optim files
        torch.save({"module": module, **states, "frozen_param_shapes": OrderedDict(),
                    "frozen_param_fragments": OrderedDict()}, out / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")


def client_state(trainer: dict) -> dict[str, Any]:
    """The script's ``client_state`` (saved by deepshard.compat.deepspeed, or imported from DeepSpeed) as
    DeepSpeed keeps it: top-level keys of the model-states file, which its ``load_checkpoint`` hands back.
    A key DeepSpeed uses itself would be overwritten by DeepSpeed's value: refused by name."""
    app = trainer["app"] if isinstance(trainer["app"], dict) else {}
    client = dict(app.get("client_state") or {})
    clash = sorted(k for k in client if k in DS_OWN_KEYS)
    if clash:
        raise ValueError(f"client_state keys {clash} are DeepSpeed's own model-states entries: DeepSpeed would "
                         f"read them as its own; rename them in the script's client_state")
    return client


def model_states(shapes: list[OrderedDict], steps: int, counters: dict, world: int) -> dict[str, Any]:
    """The model-states file's entries other than ``module``: shapes, LR-scheduler position, counters.
    DeepSpeed's scheduler stands at ``last_batch_iteration = updates - 1`` (it starts at -1)."""
    return {"buffer_names": [], "optimizer": None, "param_shapes": shapes,
            "frozen_param_shapes": None, "shared_params": {}, "frozen_param_fragments": None,
            "lr_scheduler": {"last_batch_iteration": steps - 1}, "data_sampler": None, "random_ltd": None,
            "sparse_tensor_module_names": set(), "skipped_steps": int(counters.get("skipped_steps", 0)),
            "global_steps": int(counters.get("global_steps", steps)),
            "global_samples": int(counters.get("global_samples", 0)), "dp_world_size": world,
            "mp_world_size": 1, "ds_config": {}, "ds_version": DS_VERSION}


def ds_group(trainer: dict, index: int, *, decay: bool) -> dict[str, Any]:
    """DeepSpeed's Adam param_group.  DeepSpeed restores every hyper-parameter from it, and the lr
    is the one its next update uses (its scheduler only moves after that update)."""
    app = trainer["app"] if isinstance(trainer["app"], dict) else {}
    imported = app.get("deepspeed", {}).get("param_groups") or []  # an imported DeepSpeed run
    saved = imported[index] if index < len(imported) else None
    if saved is None:
        saved = app.get("optimizer")  # written by deepshard.compat.deepspeed's save_checkpoint
    if not saved:
        raise ValueError("the checkpoint records no optimizer hyper-parameters (lr, betas, eps, weight_decay): "
                         "export checkpoints saved by deepshard.compat.deepspeed or imported from DeepSpeed")
    group = {"lr": float(saved["lr"]), "bias_correction": True, "betas": list(saved["betas"]),
             "eps": float(saved["eps"]), "weight_decay": float(saved["weight_decay"]) if decay else 0.0, "step": 0,
             "params": [index]}
    return group
